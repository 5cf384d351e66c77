"""A plan maps each tunable module name to a dtype; applying it builds a new model and leaves the original alone."""
from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterable

from torch import nn

from autotune.backends import CallInputs, dtype_of, get_backend
from autotune.errors import PlanError

Plan = dict[str, str]


def plan_key(plan: Plan) -> str:
    """A stable text key: equal plans give equal keys, whatever the dict order."""
    return json.dumps(dict(sorted(plan.items())), separators=(",", ":"))


def is_baseline(plan: Plan) -> bool:
    """Whether every module stays fp32: the baseline model, measured before any trial."""
    return all(dtype == "fp32" for dtype in plan.values())


def summarize(plan: Plan) -> str:
    counts = Counter(plan.values())
    return " ".join(f"{dtype}×{counts[dtype]}" for dtype in ("int8", "bf16", "fp16", "fp32") if counts[dtype])


def uniform_plan(candidates: dict[str, list[str]], dtype: str) -> Plan:
    """Every module (or unit) whose options include `dtype` in it, the rest fp32."""
    return {name: dtype if dtype in options else "fp32" for name, options in candidates.items()}


def validate_plan(plan: Plan, candidates: dict[str, list[str]]) -> None:
    unknown = sorted(set(plan) - set(candidates))
    if unknown:
        raise PlanError(f"plan names modules that are not tunable in this model: {unknown[:10]}"
                        + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
    bad = {name: dtype for name, dtype in plan.items() if dtype not in candidates[name]}
    if bad:
        raise PlanError("plan gives modules dtypes they cannot take: "
                        + ", ".join(f"{n}={d} (allowed {candidates[n]})" for n, d in list(bad.items())[:10]))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Puts `new` at dotted `name` inside `model`; returns the (possibly new) root."""
    if name == "":
        return new
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)
    return model


def lower_module(module: nn.Module, dtype: str, calibration: CallInputs | None) -> nn.Module:
    """A private copy of `module` in `dtype`."""
    return get_backend(dtype).apply(copy.deepcopy(module), calibration)


def apply_plan(model: nn.Module, plan: Plan, calibration: dict[str, CallInputs] | None = None) -> nn.Module:
    """A deep copy of `model` with each module of `plan` in its dtype. `calibration` feeds static int8."""
    tuned = copy.deepcopy(model).eval()
    for name, dtype in plan.items():
        if dtype == "fp32":
            continue
        try:
            original = tuned.get_submodule(name)
        except AttributeError:
            raise PlanError(f"plan names module {name!r}, which {type(model).__name__} does not have") from None
        new = get_backend(dtype).apply(original, (calibration or {}).get(name))
        tuned = replace_module(tuned, name, new)
    return tuned


def plan_of(model: nn.Module, names: Iterable[str]) -> Plan:
    """The plan a model built by apply_plan holds, read back from the module types at `names`."""
    return {name: dtype_of(model.get_submodule(name)) for name in names}
