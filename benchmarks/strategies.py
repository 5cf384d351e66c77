"""Search strategies the harness compares with autotune, and the instrumentation around them.

Every strategy gets the same eval_fn wrapped in `CountingEval` (calls, the plan each call saw, time inside) and
returns a `Found`: the plan it settled on (a per-module dict), the accuracy eval_fn gave it, the eval_fn call at
which that plan was first evaluated, and its wall time. Latency is not part of a strategy's eval budget: the
harness times real workloads' final models interleaved with fp32 in one run, and the simulator knows it.

- `run_autotune`: autotune() with eval_fn and the Measurer wrapped in timers, a fresh SQLite study in a temp dir;
  also times apply_plan and the guided search's knapsack (monkeypatched wrappers) to split the tuner's overhead.
- `best_uniform`: each dtype on every module that takes it (the rest fp32), evaluated; the fastest passing one.
- `random_search`: random plans over the full candidate space (no signals, no pruning), with a random density of
  lowered modules per plan (q ~ U(0, 1): each module lowered with probability q to one of its non-fp32 dtypes,
  so both sparse, likely-passing plans and dense, fast ones get drawn); the fastest passing one.
- `exhaustive`: every plan of a given SearchSpace (the tuner's pruned space, rebuilt from its study's stored
  signals): the exact optimum of that space up to latency noise.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from autotune.config import TuningConfig
from autotune.plan import Plan, apply_plan, is_baseline, plan_key, plan_of, uniform_plan


class Stopwatch:
    """Adds up the seconds spent in the calls it makes."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, fn: Callable, *args, **kwargs) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


class CountingEval(Stopwatch):
    """eval_fn with a call counter, the plan key of each call's model and the time spent inside."""

    def __init__(self, eval_fn: Callable[[nn.Module], Any], names: list[str]):
        super().__init__()
        self.eval_fn, self.names = eval_fn, names
        self.keys: list[str] = []

    def __call__(self, model: nn.Module) -> Any:
        self.keys.append(plan_key(plan_of(model, self.names)))
        return self.call(self.eval_fn, model)

    @property
    def calls(self) -> int:
        return len(self.keys)

    def first_call_of(self, plan: Plan) -> int:
        """1-based index of the first eval_fn call that saw `plan` (the baseline call is 1)."""
        key = plan_key(plan)
        return next((i + 1 for i, k in enumerate(self.keys) if k == key), 0)


class TimedMeasurer(Stopwatch):
    """Wraps a Measurer; adds up the seconds spent in its two methods."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def sensitivity(self, *args, **kwargs):
        return self.call(self.inner.sensitivity, *args, **kwargs)

    def module_latency(self, *args, **kwargs):
        return self.call(self.inner.module_latency, *args, **kwargs)

    def latency(self, *args, **kwargs):
        return self.call(self.inner.latency, *args, **kwargs)


@dataclass
class Found:
    method: str
    plan: Plan
    accuracy: float
    reached_at: int              # eval_fn call (1-based, baseline = 1) that first evaluated `plan`
    eval_calls: int
    wall_s: float
    model: nn.Module | None = None
    extra: dict = field(default_factory=dict)


class _Timer(Stopwatch):
    """Monkeypatches `owner.attr` with a timed wrapper for the duration of a `with` block."""

    def __init__(self, targets: list[tuple[Any, str]]):
        super().__init__()
        self.targets, self.saved = targets, []

    def __enter__(self):
        for owner, attr in self.targets:
            original = getattr(owner, attr)
            self.saved.append((owner, attr, original))
            setattr(owner, attr, lambda *args, _original=original, **kwargs: self.call(_original, *args, **kwargs))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def run_autotune(model: nn.Module, config: TuningConfig, eval_fn: Callable, example_inputs: Any,
                 measurer) -> tuple[Found, Any, CountingEval]:
    """autotune() instrumented: eval_fn and measurer timed, apply_plan and the knapsack timed separately."""
    from autotune import autotune
    from autotune.discovery import search_candidates
    from autotune.engines import eager as eager_mod
    from autotune.search import space as search_mod
    from autotune.search import trials as trials_mod

    names = list(search_candidates(model, config))
    counted = CountingEval(eval_fn, names)
    timed = TimedMeasurer(measurer)
    apply_timer = _Timer([(trials_mod, "apply_plan"), (eager_mod, "apply_plan")])
    search_timer = _Timer([(search_mod.SearchSpace, "knapsack_plan")])
    started = time.perf_counter()
    with apply_timer, search_timer:
        result = autotune(model, config, counted, example_inputs, measurer=timed)
    wall = time.perf_counter() - started
    sources = {plan_key(t.user_attrs["plan"]): t.user_attrs.get("source", "sampler")
               for t in result.study.trials if "plan" in t.user_attrs}
    overhead = wall - counted.seconds - timed.seconds
    # A plan no trial evaluated (a uniform finalist; or one whose model plan_of cannot read: lowp runs the whole
    # model in the low dtype) is first scored by the winner's re-evaluation, the run's last eval_fn call.
    reached_at = counted.first_call_of(result.plan) or counted.calls
    found = Found("autotune (ours)", result.plan, result.best.accuracy, reached_at, counted.calls, wall, result.model,
                  extra={
                      "eval_s": counted.seconds, "measure_s": timed.seconds, "overhead_s": overhead,
                      "overhead_share": overhead / wall, "apply_plan_s": apply_timer.seconds,
                      "knapsack_s": search_timer.seconds, "tuner_speedup": result.speedup,
                      "trials_evaluated": result.trials_evaluated, "n_modules": len(names),
                      "found_by": sources.get(plan_key(result.plan),
                                              "baseline" if is_baseline(result.plan) else "finalists"),
                      "sources": [t.user_attrs.get("source", "sampler") for t in result.study.trials
                                  if t.user_attrs.get("evaluated")]})
    return found, result, counted


def _evaluate(fp32: nn.Module, plan: Plan, counted: CountingEval, calibration) -> tuple[float, nn.Module]:
    model = apply_plan(fp32, plan, calibration)
    return float(counted(copy.deepcopy(model))), model


def _pick_fastest(method: str, fp32: nn.Module, baseline: float, passing: dict[str, tuple[Plan, float, nn.Module]],
                  counted: CountingEval, started: float, latency_of: Callable[[dict[str, nn.Module]], dict[str, float]],
                  extra: dict | None = None) -> Found:
    """Among passing plans, the fastest by `latency_of` (ms, fp32 included); fp32 if none beats it."""
    fp32_plan = {name: "fp32" for name in counted.names}
    ms = latency_of({"fp32": fp32, **{key: model for key, (_, _, model) in passing.items()}}) if passing else {}
    best = min(passing, key=lambda key: ms[key], default=None)
    if best is None or ms[best] >= ms["fp32"]:
        return Found(method, fp32_plan, baseline, 1, counted.calls, time.perf_counter() - started,
                     copy.deepcopy(fp32), extra or {})
    plan, accuracy, model = passing[best]
    return Found(method, plan, accuracy, counted.first_call_of(plan), counted.calls,
                 time.perf_counter() - started, model, extra or {})


def best_uniform(fp32: nn.Module, candidates: dict[str, list[str]], eval_fn: Callable, config: TuningConfig,
                 calibration, latency_of) -> Found:
    started = time.perf_counter()
    counted = CountingEval(eval_fn, list(candidates))
    baseline = float(counted(copy.deepcopy(fp32)))
    dtypes = [d for d in ("int8", "bf16", "fp16") if any(d in options for options in candidates.values())]
    passing, tried = {}, {}
    for dtype in dtypes:
        plan = uniform_plan(candidates, dtype)
        accuracy, model = _evaluate(fp32, plan, counted, calibration)
        tried[dtype] = accuracy
        if config.passes(baseline, accuracy):
            passing[plan_key(plan)] = (plan, accuracy, model)
    found = _pick_fastest("best uniform", fp32, baseline, passing, counted, started, latency_of,
                          {"uniform_accuracy": tried})
    found.method = "best uniform" + (f" ({next(iter(set(found.plan.values()) - {'fp32'}), 'fp32')})")
    return found


def random_search(fp32: nn.Module, candidates: dict[str, list[str]], eval_fn: Callable, config: TuningConfig,
                  calibration, latency_of, budget: int, seed: int = 0) -> Found:
    """`budget` eval_fn calls in all (the baseline is one); random density per plan, duplicates redrawn."""
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    counted = CountingEval(eval_fn, list(candidates))
    baseline = float(counted(copy.deepcopy(fp32)))
    seen, passing = {plan_key({n: "fp32" for n in candidates})}, {}
    while counted.calls < budget:
        for _ in range(100):
            q = rng.random()
            plan = {name: (str(rng.choice([d for d in options if d != "fp32"]))
                           if rng.random() < q and len(options) > 1 else "fp32")
                    for name, options in candidates.items()}
            if plan_key(plan) not in seen:
                break
        else:
            break
        seen.add(plan_key(plan))
        accuracy, model = _evaluate(fp32, plan, counted, calibration)
        if config.passes(baseline, accuracy):
            passing[plan_key(plan)] = (plan, accuracy, model)
    return _pick_fastest("random search", fp32, baseline, passing, counted, started, latency_of,
                         {"passing": len(passing)})


def exhaustive(fp32: nn.Module, space, eval_fn: Callable, config: TuningConfig, calibration, latency_of,
               names: list[str]) -> Found:
    """Every plan of `space` (a SearchSpace) evaluated; the fastest passing one by measured latency."""
    started = time.perf_counter()
    counted = CountingEval(eval_fn, names)
    baseline = float(counted(copy.deepcopy(fp32)))
    passing = {}
    for unit_plan in space.all_plans():
        if is_baseline(unit_plan):
            continue
        plan = space.expand(unit_plan)
        accuracy, model = _evaluate(fp32, plan, counted, calibration)
        if config.passes(baseline, accuracy):
            passing[plan_key(plan)] = (plan, accuracy, model)
    return _pick_fastest("oracle (exhaustive, pruned space)", fp32, baseline, passing, counted, started,
                         latency_of, {"space_size": space.size, "passing": len(passing)})
