"""The built-in evaluator of YAML configs: a local dataset, columns fed to the model, and a metric."""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from autotune.errors import ConfigError, EvalFunctionError, describe


class DatasetSpec(Protocol):
    files: list[str]
    file_format: str


class EvaluationSpec(Protocol):
    """What the evaluator reads of a file config's `evaluation:` section (autotune.config.file.Evaluation)."""
    dataset: DatasetSpec
    inputs: str | list[str] | dict[str, str]
    input_shape: list[int] | None
    input_dtype: str
    label: str
    metric: str
    batch_size: int

_DTYPES = {"float32": torch.float32, "int64": torch.int64}


def load_columns(evaluation: EvaluationSpec) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], torch.Tensor]:
    """(positional inputs, keyword inputs, labels) as whole-dataset tensors, read once."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is first imported
    import datasets

    spec = evaluation.dataset
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()     # a bar per read of a few local files says nothing
    try:
        table = datasets.load_dataset(spec.file_format, data_files=spec.files, split="train").with_format("numpy")
    except Exception as exc:   # pyarrow and datasets raise many kinds for a file they cannot read
        while exc.__cause__ is not None:     # datasets wraps the reader's own error in a general one
            exc = exc.__cause__
        raise ConfigError(f"evaluation.dataset.files: cannot read {spec.files} as {spec.file_format}: "
                          f"{describe(exc)}", [("evaluation.dataset.files", describe(exc))]) from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    missing = sorted({*_columns(evaluation.inputs), evaluation.label} - set(table.column_names))
    if missing:
        raise ConfigError(f"evaluation: columns {missing} are not in {spec.files} (it has {table.column_names})",
                          [("evaluation.inputs", str(missing))])
    dtype = _DTYPES[evaluation.input_dtype]

    data = table[:]  # every column as a numpy array; list-valued rows may come as an object array

    def column(name: str) -> torch.Tensor:
        values = data[name]
        try:
            return torch.as_tensor(np.stack(list(values)) if values.dtype == object else values)
        except (TypeError, ValueError) as exc:   # text, or rows of unequal length
            raise ConfigError(f"evaluation: column {name!r} is not numbers of one shape per row ({describe(exc)})",
                              [("evaluation", f"column {name!r}")]) from None

    if isinstance(evaluation.inputs, dict):
        args, kwargs = (), {arg: column(name).to(dtype) for arg, name in evaluation.inputs.items()}
    else:
        names = _columns(evaluation.inputs)
        x = column(names[0]) if isinstance(evaluation.inputs, str) else torch.stack([column(n) for n in names], 1)
        if evaluation.input_shape:
            if x[0].numel() != math.prod(evaluation.input_shape):
                raise ConfigError(f"evaluation.input_shape: {evaluation.input_shape} does not hold a row of "
                                  f"{names} ({x[0].numel()} values)", [("evaluation.input_shape", "size mismatch")])
            x = x.reshape(len(x), *evaluation.input_shape)
        args, kwargs = (x.to(dtype),), {}
    return args, kwargs, _labels(column(evaluation.label), evaluation)


def _labels(labels: torch.Tensor, evaluation: EvaluationSpec) -> torch.Tensor:
    """The label column as the metric compares it: floats for mse, class numbers else. A missing label (NaN) or,
    for a class, a fractional one is a config error: `.long()` made NaN -9223372036854775808, a miss in every
    model's score, without a word."""
    where = [("evaluation.label", evaluation.label)]
    if labels.is_floating_point():
        if (missing := torch.isnan(labels).nonzero()).numel():
            rows = ", ".join(str(row[0].item()) for row in missing[:5])
            raise ConfigError(f"evaluation.label: column {evaluation.label!r} has {len(missing)} missing values "
                              f"(rows {rows}{', ...' if len(missing) > 5 else ''}): drop those rows", where)
        if evaluation.metric != "mse" and not torch.equal(labels, labels.round()):
            raise ConfigError(f"evaluation.label: column {evaluation.label!r} holds fractional values, not class "
                              f"numbers, which metric {evaluation.metric} compares; for a regression, metric: mse",
                              where)
    return labels.float() if evaluation.metric == "mse" else labels.long()


def _columns(inputs: str | list[str] | dict[str, str]) -> list[str]:
    if isinstance(inputs, str):
        return [inputs]
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def _logits(output: Any) -> torch.Tensor:
    """The prediction tensor of a model's output: a tensor, `.logits`, a dict's "logits", or the first item."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return output.get("logits", next(iter(output.values())))
    return _logits(output[0])


def predicted_classes(scores: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension; a single output per example is a logit, positive meaning class 1."""
    if scores.ndim > 1 and scores.shape[-1] > 1:
        return scores.argmax(dim=-1)
    return (scores.reshape(len(scores)) > 0).long()


def macro_f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    scores = []
    for cls in torch.unique(torch.cat([predicted, labels])):
        true_pos = ((predicted == cls) & (labels == cls)).sum().item()
        denominator = (predicted == cls).sum().item() + (labels == cls).sum().item()
        scores.append(2 * true_pos / denominator)
    return float(np.mean(scores))


def score(metric: str, outputs: torch.Tensor, labels: torch.Tensor) -> float:
    if metric == "mse":
        if outputs.numel() != labels.numel():
            raise EvalFunctionError(f"metric mse compares one output per row with its label; the model gives "
                                    f"{outputs.numel() // max(len(outputs), 1)} per row (shape "
                                    f"{tuple(outputs.shape)}): class scores are compared with metric accuracy or f1")
        return torch.mean((outputs.float().reshape(labels.shape) - labels) ** 2).item()
    predicted = predicted_classes(outputs)
    if metric == "f1":
        return macro_f1(predicted, labels)
    return (predicted == labels).float().mean().item()


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def dataset_eval(evaluation: EvaluationSpec) -> Callable[[nn.Module], float]:
    """An eval_fn scoring a model over the whole dataset in batches of `batch_size`."""
    args, kwargs, labels = load_columns(evaluation)
    size, step = len(labels), evaluation.batch_size

    def eval_fn(model: nn.Module) -> float:
        device = _device_of(model)
        outputs = []
        with torch.inference_mode():
            for start in range(0, size, step):
                batch_args = [a[start:start + step].to(device) for a in args]
                batch_kwargs = {k: v[start:start + step].to(device) for k, v in kwargs.items()}
                outputs.append(_logits(model(*batch_args, **batch_kwargs)).float().cpu())
        return score(evaluation.metric, torch.cat(outputs), labels)
    return eval_fn
