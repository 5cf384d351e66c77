"""Cheap per-module signals, no eval_fn call: how much lowering one module alone disturbs the model's output,
and how long the module itself takes in each dtype on the inputs it really sees (boundary casts included).

A module timed alone can mislead: in the model, its output's layout, the next module and the allocator's state
change what a dtype costs (the MNIST net's first conv measures up to 3x slower in int8 alone, yet lowering it
speeds the whole net up by a fifth). `confirm_in_context` checks such verdicts against the whole model."""
from __future__ import annotations

import torch
from torch import nn

from autotune.backends import CallInputs
from autotune.capture import call
from autotune.clone import clone
from autotune.measure import measure_latency
from autotune.plan import apply_plan, lower_module, replace_module, uniform_plan
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


def confirm_in_context(model: nn.Module, candidates: dict[str, list[str]], latency: dict[str, dict[str, float]],
                       inputs: CallInputs, calibration: dict[str, CallInputs], *, warmup: int, repeats: int,
                       num_threads: int | None, device: torch.device) -> dict[str, dict[str, float]]:
    """`latency`, with a dtype kept where the module alone measured it slower than fp32 but the whole model in
    that dtype runs faster than fp32 (timed interleaved with fp32; only dtypes with mixed module verdicts).

    A kept module's cost in that dtype becomes its fp32 cost: no saving is predicted for it, so the knapsack and
    the fastest plan leave it in fp32, but the uniform plan of that dtype stays in the search space and is tried.
    """
    slower = {d: [n for n, ds in candidates.items() if d in ds and latency[n][d] >= latency[n]["fp32"]]
              for d in {d for ds in candidates.values() for d in ds if d != "fp32"}}
    mixed = sorted(d for d, names in slower.items() if 0 < len(names) < sum(d in ds for ds in candidates.values()))
    if not mixed:
        return latency
    uniform = {d: apply_plan(model, uniform_plan(candidates, d), calibration) for d in mixed}
    timing = measure_latency({"fp32": model, **uniform}, inputs, warmup=warmup, repeats=repeats,
                             num_threads=num_threads, device=device)
    confirmed = {n: dict(costs) for n, costs in latency.items()}
    for dtype in mixed:
        if timing[dtype].median_ms < timing["fp32"].median_ms:
            for name in slower[dtype]:
                confirmed[name][dtype] = latency[name]["fp32"]
    return confirmed
