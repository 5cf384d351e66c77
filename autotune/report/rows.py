"""The study's evaluated trials and the chosen plan, as the report shows them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.plan import Plan, plan_key, summarize
from autotune.result import BUSY_KEY, NOISE_KEY
from autotune.storage import study as studies


@dataclass(frozen=True)
class Row:
    """One evaluated trial as the report shows it."""
    number: int
    plan: Plan
    source: str
    accuracy: float | None
    loss: float | None
    ratio: float | None          # plan latency / fp32 latency, both timed once in this trial
    latency_ms: float | None
    spread_ms: float | None      # interquartile range of the plan's timing in this trial
    fp32_ms: float | None
    passed: bool
    error: str | None            # why the evaluation failed, for a failed trial
    chosen: bool
    by_shape: dict[str, dict[str, float]]   # {shape: ratio, latency_ms, latency_spread_ms, fp32_latency_ms, ...}
    kept: str = "fp32"           # what the plan's "fp32" computes in: the dtype the model was handed over in

    @property
    def summary(self) -> str:
        return summarize(self.plan, self.kept)

    @property
    def speedup(self) -> float | None:
        return 1 / self.ratio if self.ratio else None

    @property
    def outcome(self) -> str:
        return "error" if self.error is not None else "pass" if self.passed else "FAIL"


@dataclass(frozen=True)
class Chosen:
    """The plan the tuner returned (study attribute `best`): re-evaluated accuracy, re-timed speedup."""
    plan: Plan
    accuracy: float
    speedup: float
    trial: Row | None            # the trial that first evaluated this plan, if any did
    extra: dict[str, Any]        # any further keys the tuner stored with it
    noise: float | None = None   # how far off the speedup may be, where its timing was noisy
    busy: bool = False           # timed beside other busy processes: it may be far off
    kept: str = "fp32"           # what the plan's "fp32" computes in: the dtype the model was handed over in

    @property
    def summary(self) -> str:
        return summarize(self.plan, self.kept)


def trial_speedups(rows: list[Row]) -> str:
    """What these trials' speedups are: timed within each trial, predicted from per-module costs (`trial_timing:
    predicted`, or a plan that missed the tolerance, which is never timed), or some of each."""
    with_ratio = [r for r in rows if r.ratio is not None]
    timed = sum(r.latency_ms is not None for r in with_ratio)
    if timed == len(with_ratio):
        return "in-trial timing"
    return "predicted" if not timed else "in-trial timing or predicted"


def _row(trial: FrozenTrial, chosen_key: str | None, first: set[str], kept: str) -> Row:
    attrs, plan = trial.user_attrs, studies.trial_plan(trial)
    key = studies.trial_plan_key(trial)
    complete = trial.state == TrialState.COMPLETE
    chosen = complete and key == chosen_key and key not in first
    if complete:
        first.add(key)
    return Row(trial.number, plan, str(attrs.get("source", "sampler")), attrs.get("accuracy"),
               attrs.get("accuracy_loss"), trial.values[0] if complete and trial.values else None,
               attrs.get("latency_ms"), attrs.get("latency_spread_ms"), attrs.get("fp32_latency_ms"),
               bool(attrs.get("passed")) and complete, None if complete else str(attrs.get("fail_reason", "failed")),
               chosen, dict(attrs.get("latency_by_shape") or {}), kept)


def trial_rows(study: optuna.Study) -> tuple[list[Row], Chosen | None]:
    """The study's evaluated trials by number (duplicates reuse a result and are left out), and the chosen plan."""
    best = studies.get_attr(study, "best")
    chosen_key = plan_key(best["plan"]) if best else None
    first: set[str] = set()
    kept = studies.kept_dtype(study)
    rows = [_row(t, chosen_key, first, kept) for t in sorted(studies.evaluated_trials(study), key=lambda t: t.number)]
    if not best:
        return rows, None
    trial = next((row for row in rows if row.chosen), None)
    extra = {k: v for k, v in best.items() if k not in ("plan", "accuracy", "speedup", NOISE_KEY, BUSY_KEY)}
    return rows, Chosen(dict(best["plan"]), best["accuracy"], best["speedup"], trial, extra, best.get(NOISE_KEY),
                        bool(best.get(BUSY_KEY)), kept)


def pareto_front(rows: list[Row]) -> list[Row]:
    """Completed trials no other beats on both in-trial latency ratio and accuracy loss, fastest first."""
    front, best_loss = [], math.inf
    for row in sorted((r for r in rows if r.ratio is not None), key=lambda r: (r.ratio, r.loss)):
        if row.loss < best_loss:
            front.append(row)
            best_loss = row.loss
    return front


def tolerance_limit(baseline: float | None, settings: dict[str, Any]) -> float | None:
    """The worst accuracy within tolerance, if the study records its tolerance (settings attribute)."""
    if baseline is None or "tolerable_loss" not in settings:
        return None
    tolerance = settings["tolerable_loss"]
    allowed = tolerance if settings.get("loss_kind") == "absolute" else tolerance * abs(baseline)
    return baseline - allowed if settings.get("higher_is_better", True) else baseline + allowed
