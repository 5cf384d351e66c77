"""A cheap per-module signal, no eval_fn call: how much lowering one module alone disturbs the model's output."""
from __future__ import annotations

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import call
from autotune.clone import clone
from autotune.plan import lower_module, replace_module
from autotune.tree import float_tensors


def _flat_output(output) -> torch.Tensor:
    floats = float_tensors(output)
    if not floats:
        raise TypeError("the model returned no floating tensor to compare")
    return torch.cat([t.detach().float().flatten() for t in floats])


def output_error(reference: torch.Tensor, output) -> float:
    """Relative L2 error of a model output against the fp32 reference (nan/inf counts as total loss)."""
    flat = _flat_output(output)
    error = ((flat - reference).norm() / reference.norm().clamp(min=1e-12)).item()
    return error if error == error and error != float("inf") else float("inf")


def module_sensitivity(model: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
                       calibration: dict[str, CallInputs]) -> dict[str, dict[str, float]]:
    """{module: {dtype: output error with only that module in that dtype}}; fp32 is 0 by definition."""
    work = clone(model).eval()
    with torch.inference_mode():
        reference = _flat_output(call(work, inputs))
        errors: dict[str, dict[str, float]] = {}
        for name, dtypes in candidates.items():
            original = work.get_submodule(name)
            errors[name] = {"fp32": 0.0}
            for dtype in dtypes:
                if dtype == "fp32":
                    continue
                work = replace_module(work, name, lower_module(original, dtype, calibration.get(name)))
                errors[name][dtype] = output_error(reference, call(work, inputs))
                work = replace_module(work, name, original)
    return errors
