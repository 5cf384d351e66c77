"""Running plans as Optuna trials: claim, apply, evaluate, time against fp32 in the same run, record everything.

Several processes may tune one study at once. Each plan is evaluated at most once across all of them: a trial
claims its plan under a lock before evaluating, and a trial whose plan another process is running waits for
that result and records it as a duplicate (no eval_fn call).
"""
from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

from autotune import study as studies
from autotune.backends import CallInputs
from autotune.config import TuningConfig
from autotune.errors import EvalFunctionError
from autotune.measure import weight_bytes
from autotune.plan import Plan, apply_plan, plan_key, summarize
from autotune.search import SearchSpace
from autotune.signals import Measurer
from autotune.timeout import call_with_timeout

log = logging.getLogger("autotune")
EvalFn = Callable[[nn.Module], Any]
CLAIM_POLL_S = 0.5


def score_of(value: Any) -> float:
    """eval_fn's return as a finite float, or EvalFunctionError saying what came back instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EvalFunctionError(f"eval_fn must return a number; it returned {type(value).__name__} {value!r:.80}")
    if not math.isfinite(value):
        raise EvalFunctionError(f"eval_fn returned {value}, not a finite number")
    return float(value)


class TrialFailed(Exception):
    """An eval_fn failure inside one trial: Optuna records the trial FAILED and the search goes on."""


@dataclass(frozen=True)
class Outcome:
    latency_ratio: float
    loss: float          # accuracy loss in the configured kind
    tolerable_loss: float

    @property
    def passed(self) -> bool:
        return self.loss <= self.tolerable_loss

    @property
    def constraint(self) -> float:   # feasible when <= 0
        return self.loss - self.tolerable_loss


def fail_stale_trials(study: optuna.Study) -> None:
    """Marks trials of dead processes FAILED (their plans are queued again by the retry callback)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def _running_elsewhere(holders: dict[int, TrialState], own: int | None = None) -> bool:
    """Whether a running trial other than `own` is among a plan's holders (studies.plan_holders)."""
    return any(state == TrialState.RUNNING and number != own for number, state in holders.items())


class TrialRunner:
    def __init__(self, study: optuna.Study, space: SearchSpace, fp32: nn.Module, eval_fn: EvalFn,
                 inputs: CallInputs, calibration: dict[str, CallInputs], baseline_accuracy: float,
                 config: TuningConfig, measurer: Measurer):
        self.study, self.space, self.fp32, self.eval_fn = study, space, fp32, eval_fn
        self.inputs, self.calibration, self.baseline, self.config = inputs, calibration, baseline_accuracy, config
        self.measurer = measurer
        self.variants: dict[tuple[str, str], nn.Module] = {}   # lowered modules, reused by apply_plan
        self.outcomes: dict[str, Outcome] = {}
        self.failed: set[str] = set()
        self.refresh()
        self.eval_calls = 0
        self.last_was_duplicate = False

    def _values(self, outcome: Outcome) -> float | tuple[float, float]:
        return outcome.latency_ratio if self.config.objective == "latency" else (outcome.latency_ratio, outcome.loss)

    def _claim(self, trial: optuna.Trial, key: str) -> None:
        """Returns once `key` is finished or failed somewhere, or claimed for `trial`; waits while another
        process runs it (a claim of a dead process ends when the heartbeat check fails its trial)."""
        while True:
            with studies.plan_lock(self.config.storage, self.study):
                if key in self.outcomes or key in self.failed:
                    return
                holders = studies.plan_holders(self.study, key)
                if any(state.is_finished() for state in holders.values()):
                    self.refresh()    # finished elsewhere since this runner last read the study
                    if key in self.outcomes or key in self.failed:
                        return
                if not _running_elsewhere(holders, trial.number):
                    trial.set_user_attr(studies.PLAN_KEY_ATTR, key)
                    return
            time.sleep(CLAIM_POLL_S)
            fail_stale_trials(self.study)

    def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        unit_plan = {unit: trial.suggest_categorical(unit, options) for unit, options in self.space.choices.items()}
        plan = self.space.expand(unit_plan)
        key = plan_key(plan)
        trial.set_user_attr("plan", plan)
        self._claim(trial, key)
        known = self.outcomes.get(key)
        self.last_was_duplicate = known is not None or key in self.failed
        # Set either way: a trial re-queued after a crash arrives with its stale trial's attributes.
        trial.set_user_attr("evaluated", not self.last_was_duplicate)
        if self.last_was_duplicate:   # spend no eval_fn call: tell the sampler the stored result
            trial.set_user_attr("duplicate", True)
            if known is None:
                raise TrialFailed("this plan failed in an earlier trial")
            if self.config.objective == "latency":
                trial.set_constraint("accuracy", known.constraint)
            return self._values(known)
        return self._evaluate(trial, plan, key)

    def _evaluate(self, trial: optuna.Trial, plan: Plan, key: str) -> float | tuple[float, float]:
        tuned = apply_plan(self.fp32, plan, self.calibration, self.variants)
        self.eval_calls += 1
        try:
            accuracy = score_of(call_with_timeout(self.eval_fn, tuned, self.config.trial_timeout))
        except Exception as exc:  # the user's code: any failure fails this trial only
            self.failed.add(key)
            trial.set_user_attr("fail_reason", f"{type(exc).__name__}: {exc}"[:2000])
            log.warning("trial %d failed: %s: %s", trial.number, type(exc).__name__, exc)
            raise TrialFailed(str(exc)) from exc
        timing = self.measurer.latency({"fp32": self.fp32, "plan": tuned}, self.inputs, self.config.repeats)
        loss = self.config.accuracy_loss(self.baseline, accuracy)
        outcome = Outcome(timing["plan"].median_ms / timing["fp32"].median_ms, loss, self.config.tolerable_loss)
        for name, value in (("accuracy", accuracy), ("accuracy_loss", loss), ("passed", outcome.passed),
                            ("latency_ms", timing["plan"].median_ms), ("latency_spread_ms", timing["plan"].spread_ms),
                            ("fp32_latency_ms", timing["fp32"].median_ms), ("weight_bytes", weight_bytes(tuned)),
                            ("plan_summary", summarize(plan))):
            trial.set_user_attr(name, value)
        if self.config.objective == "latency":   # after the attributes: its read writes them in one transaction
            trial.set_constraint("accuracy", outcome.constraint)
        self.outcomes[key] = outcome
        log.info("trial %d [%s] %s: accuracy %.4f (loss %.4f) latency %.2fx fp32 %s", trial.number,
                 trial.user_attrs.get("source", "sampler"), summarize(plan), accuracy, loss,
                 outcome.latency_ratio, "pass" if outcome.passed else "FAIL")
        return self._values(outcome)

    def run_once(self) -> None:
        self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,))

    def run_plan(self, unit_plan: Plan, source: str) -> Outcome | None:
        """The outcome of `unit_plan`, evaluating it only if no trial has it yet; None if its trial failed.

        Queued trials run in order (plans re-queued after a crash first), so this may run others before ours;
        while another process runs ours, this waits for its result.
        """
        key = plan_key(self.space.expand(unit_plan))
        queued = False
        while True:
            view = self.refresh()
            if key in self.outcomes or key in self.failed:
                return self.outcomes.get(key)
            if not queued:
                self.study.enqueue_trial(unit_plan, user_attrs={"source": source})
                queued = True
                continue   # read again: another worker may take the queued trial before we do
            if view.waiting:
                self.run_once()
                continue
            # Our plan's trial is running elsewhere, or died: wait, then queue it again if nobody holds it.
            time.sleep(CLAIM_POLL_S)
            fail_stale_trials(self.study)
            queued = self.held_elsewhere(key)

    def held_elsewhere(self, key: str) -> bool:
        """Whether a running trial has claimed plan `key`: one query for its holders, the study is not read."""
        return _running_elsewhere(studies.plan_holders(self.study, key))

    def run_queued(self) -> None:
        """Runs the plans still queued (re-queued after a crash, or left by a stopped worker)."""
        while self.refresh().waiting:
            self.run_once()

    def refresh(self) -> studies.TrialsView:
        """Adds plans finished elsewhere (another worker or an earlier run) to what this runner knows; returns
        the study's trials as read (`evaluated` counts all processes' evaluations: the shared budget)."""
        view = studies.view_trials(self.study)
        for key, trial in view.finished.items():
            if key not in self.outcomes:
                self.outcomes[key] = Outcome(trial.values[0], trial.user_attrs["accuracy_loss"],
                                             self.config.tolerable_loss)
        self.failed |= view.failed
        self.evaluated = view.evaluated
        return view
