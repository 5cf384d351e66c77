"""A cheap per-module signal, no eval_fn call: how much lowering one module alone disturbs the model's output."""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.clone import clone_sharing_weights
from autotune.discovery import shared_dtypes, unit_name, units_of
from autotune.errors import describe
from autotune.fused_paths import calls_children_as_modules
from autotune.measure.prefix import PrefixReplay
from autotune.model_call import call, same_random_draws
from autotune.plan import lower_module, replace_module
from autotune.tree import float_tensors, tensors

log = logging.getLogger("autotune")


def _flat_output(output) -> torch.Tensor:
    """The output's float tensors, flattened into one; where it has none, its others (labels, token ids)."""
    floats = float_tensors(output)
    if floats:
        return torch.cat([t.detach().float().flatten() for t in floats])
    others = tensors(output)
    if not others:
        raise TypeError(f"the model returned no tensor to compare (a {type(output).__name__})")
    return torch.cat([t.detach().flatten() for t in others])


def output_error(reference: torch.Tensor, output) -> float:
    """Relative L2 error of a model output against the fp32 reference (nan/inf counts as total loss); for an
    output of labels or token ids (a forward ending in argmax or a greedy decode), the square root of the share of
    them that changed, so that errors of modules lowered together add as squared errors do."""
    flat = _flat_output(output)
    if not reference.is_floating_point():
        return (flat != reference).float().mean().sqrt().item() if flat.shape == reference.shape else math.inf
    error = ((flat - reference).norm() / reference.norm().clamp(min=1e-12)).item()
    return error if error == error and error != float("inf") else float("inf")


def module_sensitivity(model: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
                       calibration: dict[str, CallInputs], groups: Sequence[Sequence[str]] = ()
                       ) -> dict[str, dict[str, float]]:
    """{module: {dtype: output error with only that module in that dtype}}; fp32 is 0 by definition, and a dtype
    in which the model fails to run (a parent reading what the lowered module lacks) is inf, as a lost output is.

    The modules of a group, which the search gives one dtype (q/k/v), are lowered together, once per dtype they
    all may keep, and each holds an equal share of that error (error / sqrt(members)): the search adds errors in
    variance, so the group's is the one measured, and it costs one forward of the model instead of one per member.
    What runs before a unit is answered from the reference forward (autotune.measure.prefix), not run again.
    """
    work = clone_sharing_weights(model).eval()
    calls_children_as_modules(work, candidates)   # as in the lowered models compared with it
    errors: dict[str, dict[str, float]] = {name: {"fp32": 0.0} for name in candidates}
    units = [members for members in units_of(candidates, list(groups)).values()
             if any(d != "fp32" for d in shared_dtypes(candidates, members))]
    # One forward per unit and lowered dtype: minutes on a big model where bf16 is emulated, so it is said first
    runs = sum(d != "fp32" for members in units for d in shared_dtypes(candidates, members))
    log.info("output error of %d units in their lower dtypes: %d runs of the model's rest past each", len(units), runs)
    output, replay = PrefixReplay.record(work, inputs, units, lambda ref, out: output_error(_flat_output(ref), out))
    reference = _flat_output(output)
    with torch.inference_mode():
        for members in units:
            originals = {name: work.get_submodule(name) for name in members}
            with replay.replaying(members) if replay else nullcontext():
                for dtype in (d for d in shared_dtypes(candidates, members) if d != "fp32"):
                    try:
                        for name, original in originals.items():
                            work = replace_module(work, name, lower_module(original, dtype, calibration.get(name)))
                        with same_random_draws(work):
                            error = output_error(reference, call(work, inputs))
                    except Exception as exc:  # the model around the unit fails with it lowered: that dtype only
                        log.warning("%s in %s: the model fails with it (%s), so it stays out of %s",
                                    unit_name(members), dtype, describe(exc, 200), dtype)
                        error = math.inf
                    for name, original in originals.items():
                        errors[name][dtype] = error / math.sqrt(len(members))
                        work = replace_module(work, name, original)
    return errors
