"""A plan maps each tunable module name to a dtype; applying it builds a new model and leaves the original alone."""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

from torch import nn

from autotune.backends import CallInputs, dtype_names, dtype_of, get_backend
from autotune.capture import as_call_inputs, record_module_inputs
from autotune.clone import clone
from autotune.errors import PlanError
from autotune.fused_paths import calls_children_as_modules

Plan = dict[str, str]


def plan_key(plan: Plan) -> str:
    """A stable text key: equal plans give equal keys, whatever the dict order."""
    return json.dumps(dict(sorted(plan.items())), separators=(",", ":"))


def plan_of_key(key: str) -> Plan:
    """The plan `plan_key` made `key` of."""
    return json.loads(key)


def plan_id(plan: Plan) -> str:
    """A short id telling plans apart where a summary (`int8×1 fp32×3`) cannot: 8 hex digits of the key's sha1."""
    return hashlib.sha1(plan_key(plan).encode()).hexdigest()[:8]


def is_baseline(plan: Plan) -> bool:
    """Whether every module stays fp32: the baseline model, measured before any trial."""
    return all(dtype == "fp32" for dtype in plan.values())


def low_dtype(plan: Plan) -> str:
    """The first dtype the plan lowers a module to ("fp32" where it lowers none): the one low dtype of a plan that
    holds only one, as the lowp engine's plans do."""
    return next((dtype for dtype in plan.values() if dtype != "fp32"), "fp32")


def summarize(plan: Plan, kept: str = "fp32") -> str:
    """`int8×2 fp32×1`: how many modules take each dtype, lowered dtypes first (in registration order). `kept`
    names what "fp32" (the module as it is) holds: a model handed over in bf16 keeps its modules bf16."""
    counts = Counter(kept if dtype == "fp32" else dtype for dtype in plan.values())
    order = [d for d in dtype_names() if d != "fp32"] + ["fp32"]
    order += sorted(set(counts) - set(order))
    return " ".join(f"{dtype}×{counts[dtype]}" for dtype in order if counts[dtype])


def uniform_plan(candidates: dict[str, list[str]], dtype: str) -> Plan:
    """Every module (or unit) whose options include `dtype` in it, the rest fp32."""
    return {name: dtype if dtype in options else "fp32" for name, options in candidates.items()}


def validate_plan(plan: Plan, candidates: dict[str, list[str]]) -> None:
    """Checks a plan against the tunable modules and their dtypes (discovery.search_candidates).

    Raises:
        PlanError: naming the unknown modules, or the modules given dtypes they cannot take.
    """
    unknown = sorted(set(plan) - set(candidates))
    if unknown:
        raise PlanError(f"plan names modules that are not tunable in this model: {unknown[:10]}"
                        + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
    bad = {name: dtype for name, dtype in plan.items() if dtype not in candidates[name]}
    if bad:
        raise PlanError("plan gives modules dtypes they cannot take: "
                        + ", ".join(f"{n}={d} (allowed {candidates[n]})" for n, d in list(bad.items())[:10]))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Puts `new` at dotted `name` inside `model`, and wherever else the module there is registered (a TCN block
    holding its convolution and a Sequential of it: the forward may call it through either); returns the
    (possibly new) root."""
    if name == "":
        return new
    old = model.get_submodule(name)
    paths = [path for path, module in model.named_modules(remove_duplicate=False) if module is old]
    for path in paths:
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    calls_children_as_modules(model, paths)
    return model


def lower_module(module: nn.Module, dtype: str, calibration: CallInputs | None) -> nn.Module:
    """A new module: `module` in `dtype` (backends leave the module they are given as it was)."""
    return get_backend(dtype).apply(module, calibration)


def apply_plan(model: nn.Module, plan: Plan, calibration: dict[str, CallInputs] | None = None,
               variants: dict[tuple[str, str], nn.Module] | None = None, *, example_inputs: Any = None) -> nn.Module:
    """A copy of `model` with each module of `plan` in its dtype; `model` is left as it was.

    The lowered modules are handed to the copy as the copies of the modules they replace, so the fp32 weights of
    those modules are never copied.

    Args:
        model: the fp32 model.
        plan: {module name: dtype name}; modules it does not name stay as they are.
        calibration: {module name: the inputs it was called with}, for techniques that calibrate (static int8).
        variants: kept across calls, holds each (module, dtype) lowered once; a plan gets deep copies of them
            (int8 copies share their packed weights, which nothing changes in place).
        example_inputs: inputs for one call of `model` (a tensor, a tuple, a dict of keyword arguments or an
            (args, kwargs) pair, as `autotune` takes them): the plan's lowered modules not in `calibration` are
            calibrated on what they were called with there.
    Returns:
        The new model, in eval mode.
    Raises:
        PlanError: the plan names a module the model lacks, or a dtype no technique takes the module in.
        KeyError: the plan names a dtype no technique is registered under.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    if missing := [name for name in plan if name not in modules]:
        raise PlanError(f"plan names module {missing[0]!r}, which {type(model).__name__} does not have")
    if example_inputs is not None:
        uncalibrated = [name for name, dtype in plan.items() if dtype != "fp32" and name not in (calibration or {})]
        calibration = {**record_module_inputs(model, uncalibrated, as_call_inputs(example_inputs)),
                       **(calibration or {})}
    lowered: dict[int, nn.Module] = {}
    tied: dict[tuple, nn.Module] = {}   # modules holding the same parameters (discovery.tied_groups): lowered once
    for name, dtype in plan.items():
        if dtype == "fp32":
            continue
        original = modules[name]
        holds = (type(original), dtype, tuple(id(p) for p in original.parameters()))
        if holds[2] and holds in tied:
            lowered[id(original)] = tied[holds]
            continue
        if variants is None:
            lowered[id(original)] = lower_module(original, dtype, (calibration or {}).get(name))
        else:
            if (name, dtype) not in variants:
                variants[name, dtype] = lower_module(original, dtype, (calibration or {}).get(name))
            lowered[id(original)] = clone(variants[name, dtype])
        tied[holds] = lowered[id(original)]
    tuned = clone(model, memo=lowered).eval()
    calls_children_as_modules(tuned, [name for name, dtype in plan.items() if dtype != "fp32"])
    return tuned


def plan_of(model: nn.Module, names: Iterable[str]) -> Plan:
    """The plan a model built by apply_plan holds, read back from the techniques its modules carry.

    Args:
        model: a model apply_plan built (modules no technique built count as fp32).
        names: the module names to read.
    Raises:
        PlanError: the model has no module of one of the names.
    """
    modules = dict(model.named_modules(remove_duplicate=False))   # one walk, not one get_submodule per name
    names = list(names)
    missing = [name for name in names if name not in modules]
    if missing:
        raise PlanError(f"{type(model).__name__} has no module {missing[0]!r}")
    return {name: dtype_of(modules[name]) for name in names}


def module_shapes(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """{module name: the shapes of the parameters it holds itself, "32x1x3x3 32"}: what a plan file records of the
    model it was tuned on, so a plan applied to a model of other shapes (a wider variant, a 5x5 convolution where it
    was 3x3) says so (shapes_differ)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    return {name: " ".join("x".join(map(str, p.shape)) for p in modules[name].parameters(recurse=False))
            for name in names if name in modules}


def shapes_differ(recorded: dict[str, str], model: nn.Module) -> list[str]:
    """How `model`'s modules differ in shape from those `recorded` (module_shapes), in words, one per module."""
    here = module_shapes(model, recorded)
    return [f"{name} held {shapes or 'no parameter'} there, {here[name] or 'no parameter'} here"
            for name, shapes in recorded.items() if name in here and here[name] != shapes]
