"""Cheap per-module signals, no eval_fn call: how much lowering one module alone disturbs the model's output,
and how long the module itself takes in each dtype on the inputs it really sees (boundary casts included)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from autotune.backends import CallInputs
from autotune.capture import call
from autotune.measure import measure_latency
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
    work = copy.deepcopy(model).eval()
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


def module_latency(model: nn.Module, candidates: dict[str, list[str]], calibration: dict[str, CallInputs], *,
                   repeats: int, num_threads: int | None, device: torch.device) -> dict[str, dict[str, float]]:
    """{module: {dtype: median ms of the module alone on its recorded inputs}}, dtypes interleaved per module."""
    timings: dict[str, dict[str, float]] = {}
    for name, dtypes in candidates.items():
        original = model.get_submodule(name)
        variants = {dtype: lower_module(original, dtype, calibration[name]) for dtype in dtypes}
        stats = measure_latency(variants, calibration[name], warmup=2, repeats=repeats,
                                num_threads=num_threads, device=device)
        timings[name] = {dtype: s.median_ms for dtype, s in stats.items()}
    return timings
