"""Running plans as Optuna trials: claim, apply, evaluate, time against fp32 in the same run, record everything.

Several processes, on one machine or many, may tune one study at once. Each plan is evaluated at most once
across all of them: a trial claims its plan in the database before evaluating (storage.claims), and a trial
whose plan another process is running waits for that result and records it as a duplicate (no eval_fn call).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from torch import nn

from autotune.backends import CallInputs, held_dtype
from autotune.capture import eval_fn_batches, with_fed_batches
from autotune.clone import clone
from autotune.config.tuning import TuningConfig
from autotune.engines import get_engine
from autotune.errors import describe
from autotune.measure.measurer import Measurer, latency_by_shape, ratios_to_fp32
from autotune.measure.shapes import Shape, weighted_ratio
from autotune.measure.size import weight_bytes
from autotune.plan import Plan, apply_plan, plan_key, summarize
from autotune.search.guided import Status
from autotune.search.scores import HandedState, scored, study_baseline
from autotune.search.space import SearchSpace
from autotune.storage import study as studies
from autotune.storage.claims import PlanClaims, lease

log = logging.getLogger("autotune")
EvalFn = Callable[[nn.Module], Any]
# Optuna's callback interface: called with (study, finished trial) after every trial this process runs.
TrialCallback = Callable[[optuna.Study, FrozenTrial], None]
CLAIM_POLL_S = 0.5
TURN_POLL_S = 0.05    # a turn is held for one read of the study and a few writes
QUEUE_TURN = "queue"  # held to choose, queue and start a trial


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

    @property
    def tolerances_lost(self) -> float | None:
        """The loss over the tolerable loss (1 is the limit); None where no loss is tolerated."""
        return self.loss / self.tolerable_loss if self.tolerable_loss > 0 else None


def fail_stale_trials(study: optuna.Study, grace_period: float) -> None:
    """Marks trials of dead processes FAILED: those whose heartbeat stopped (Optuna's check; the retry callback
    queues their plans again), and those older than `grace_period` that never reached the objective.

    The second kind exists because Optuna starts a trial's heartbeat only after creating the trial: a process
    killed in between leaves a RUNNING trial with no heartbeat, which Optuna's check never finds. A live trial
    marks itself (RUNNER_ATTR) as the objective starts, within moments of its creation; it has no plan yet, so
    nothing is queued again for it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=grace_period)
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.datetime_start < cutoff and not _marked_by_its_runner(trial):
            try:
                study.tell(trial.number, state=TrialState.FAIL)
            except (ValueError, RuntimeError):   # finished meanwhile: by its own process, or another worker's check
                pass


RUNNER_ATTR = "runner"   # "<host>:<pid>:<run>:<trial number>", the objective's first write


def _marked_by_its_runner(trial: FrozenTrial) -> bool:
    # A trial queued again after a crash arrives with its dead predecessor's mark, naming another number.
    return str(trial.user_attrs.get(RUNNER_ATTR, "")).endswith(f":{trial.number}")


class TrialRunner:
    """Runs plans of one study as trials in this process, and knows every plan's outcome in the study."""

    def __init__(self, study: optuna.Study, claims: PlanClaims, space: SearchSpace, fp32: nn.Module,
                 eval_fn: EvalFn, inputs: CallInputs, calibration: dict[str, CallInputs], config: TuningConfig,
                 measurer: Measurer, callbacks: Sequence[TrialCallback] = (),
                 batches: list[CallInputs] | None = None, shapes: list[Shape] | None = None):
        self.study, self.claims, self.space, self.fp32, self.eval_fn = study, claims, space, fp32, eval_fn
        self.inputs, self.calibration, self.config = inputs, calibration, config
        self.kept = held_dtype(fp32)    # what a plan's "fp32" computes in: the dtype the model was handed over in
        self._baseline: float | None = None    # the study's, read (or evaluated) when first needed
        self.rescored: bool | None = None      # whether the fp32 model scored otherwise as this process joined
        self.measurer = measurer
        self.shapes = shapes or [Shape("example", inputs, 1.0)]   # where latency is measured, weighted
        self.batches = batches or [inputs]     # whole-model batches: timed, and calibrating static ranges
        # Where `batches` are the example_inputs alone (`example_alone`), static ranges are calibrated on them and
        # then eval_fn's first batches (`calibration_batches`): those the fp32 call this process made fed it.
        self.example_alone, self._fed = False, None
        self._calibration_batches: list[CallInputs] | None = None
        self.callbacks = [*callbacks, self._keep_last]
        self.variants: dict[tuple[str, str], nn.Module] = {}   # lowered modules, reused by apply_plan
        self.outcomes: dict[str, Outcome] = {}
        self.failed: set[str] = set()
        self.baseline_eval_s = 0.0
        self.refresh()
        self.eval_calls = 0
        self.handed_state: HandedState | None = None   # buffers its forward moves, put back in the model handed back
        self._last: FrozenTrial | None = None
        self._running: tuple[int, str | None] | None = None   # (number, plan key) of the trial the objective runs
        self._end_turn: Callable[[], None] | None = None      # releases the turn start_next holds
        self._token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    @property
    def trial_s(self) -> float:
        """How long a trial is taken to last, as of the last read of the study: the longest evaluated so far, and no
        less than the baseline's eval_fn call (the first trial has no other to go by)."""
        return max(self.longest_trial_s, self.baseline_eval_s)

    @property
    def baseline(self) -> float:
        """The fp32 model's score, read from the study (or evaluated here, if no worker has) on first use."""
        if self._baseline is None:
            self._baseline, evaluated_here = study_baseline(self.study, self.claims.storage, self.fp32,
                                                            self.eval_fn, self.config)
            self.eval_calls += evaluated_here is not None
            self.fed(evaluated_here)
        return self._baseline

    def fed(self, batches: list[CallInputs] | None) -> None:
        """Keeps the first batches an eval_fn call on the fp32 model fed it (None: it made none here), for
        `calibration_batches` where the example_inputs are all it has."""
        if self.example_alone and self._fed is None and batches is not None:
            self._fed = batches

    @property
    def calibration_batches(self) -> list[CallInputs]:
        """The whole-model batches the finalists are built from: `batches`, followed, where they are the
        example_inputs alone and an engine of the run calibrates static ranges on them, by eval_fn's first batches
        called alike (capture.with_fed_batches), as `autotune apply` calibrates. Where this process scored no fp32
        model (another worker did, as it joined), eval_fn is started for them and abandoned: one call, cut short."""
        if self._calibration_batches is None:
            fed = self.example_alone and any(get_engine(name).calibrates_on_batches for name in self.config.engines)
            if fed and self._fed is None:
                self.eval_calls += 1
                self._fed = eval_fn_batches(clone(self.fp32), self.eval_fn)
            self._calibration_batches = with_fed_batches(self.batches, self._fed) if fed else self.batches
        return self._calibration_batches

    def resumed_at(self, score: float) -> None:
        """Judges what this process evaluates against `score`: the fp32 model's as it joined the study, on eval_fn's
        data now (scores.rescored), where it may differ from the study's recorded one within the tolerance."""
        self.rescored = score != self.baseline
        self._baseline = score

    def _keep_last(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._last = trial

    def _values(self, outcome: Outcome) -> float | tuple[float, float]:
        return outcome.latency_ratio if self.config.objective == "latency" else (outcome.latency_ratio, outcome.loss)

    def claim(self, trial: optuna.Trial, key: str) -> None:
        """Returns once `key` is finished or failed somewhere, or claimed for `trial`; waits while another
        process runs it (a claim of a dead process ends when the heartbeat check fails its trial)."""
        while key not in self.outcomes and key not in self.failed:
            holder = self.claims.claim(key, trial.number)
            if holder == trial.number:
                trial.set_user_attr(studies.PLAN_KEY_ATTR, key)
                return
            if self.claims.state_of(holder).is_finished():
                self.refresh()    # finished elsewhere since this runner last read the study
                if key in self.outcomes or key in self.failed:
                    return
                # Finished with no result: its process died mid-trial and the heartbeat check failed it.
                if self.claims.take_over(key, holder, trial.number):
                    trial.set_user_attr(studies.PLAN_KEY_ATTR, key)
                    return
                continue
            time.sleep(CLAIM_POLL_S)
            fail_stale_trials(self.study, self.config.grace_period)

    def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        if self._end_turn is not None:
            self._end_turn()
        self._running = (trial.number, None)
        trial.set_user_attr(RUNNER_ATTR, f"{self._token}:{trial.number}")
        unit_plan = {unit: trial.suggest_categorical(unit, options) for unit, options in self.space.choices.items()}
        plan = self.space.expand(unit_plan)
        key = plan_key(plan)
        self._running = (trial.number, key)
        trial.set_user_attr("plan", plan)
        self.claim(trial, key)
        known = self.outcomes.get(key)
        duplicate = known is not None or key in self.failed
        # Both set either way: a trial re-queued after a crash arrives with its stale trial's attributes.
        trial.set_user_attr("evaluated", not duplicate)
        trial.set_user_attr("duplicate", duplicate)
        if duplicate:   # spend no eval_fn call: tell the sampler the stored result
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
            accuracy = scored(self.eval_fn, tuned, self.config.trial_timeout)
        except Exception as exc:  # the user's code: any failure fails this trial only
            self.failed.add(key)
            trial.set_user_attr("fail_reason", f"{type(exc).__name__}: {exc}"[:2000])
            log.warning("trial %d failed: %s", trial.number, describe(exc))
            # Where the baseline is not known yet (another worker's, still to come), an eval_fn failing on the
            # fp32 model too is found now and ends the run, as a failing baseline does before any trial.
            self.baseline  # noqa: B018
            raise TrialFailed(str(exc)) from exc
        loss = self.config.accuracy_loss(self.baseline, accuracy)
        # A failing plan cannot be chosen: its latency is predicted (with the latency objective, the sampler
        # ranks failing plans by how far they miss); so is every plan's where only the finalists are timed.
        timed = self.config.objective != "latency" or (loss <= self.config.tolerable_loss
                                                        and self.config.trial_timing == "measured")
        ratio = self._timed_ratio(trial, tuned) if timed else self._predicted_ratio(trial)
        if not timed:   # a trial re-queued after a crash arrives with its stale trial's timings
            for name in ("latency_ms", "latency_spread_ms", "fp32_latency_ms", "latency_by_shape"):
                trial.set_user_attr(name, None)
        outcome = Outcome(ratio, loss, self.config.tolerable_loss)
        summary = summarize(plan, self.kept)
        for name, value in (("accuracy", accuracy), ("accuracy_loss", loss), ("passed", outcome.passed),
                            ("latency_measured", timed), ("weight_bytes", weight_bytes(tuned)),
                            ("plan_summary", summary)):
            trial.set_user_attr(name, value)
        if self.config.objective == "latency":
            trial.set_constraint("accuracy", outcome.constraint)
        self.outcomes[key] = outcome
        log.info("trial %d [%s] %s: score %.6g (loss %.4g) latency %.2fx fp32%s %s", trial.number,
                 trial.user_attrs.get("source", "sampler"), summary, accuracy, loss, outcome.latency_ratio,
                 "" if timed else " (predicted)", "pass" if outcome.passed else "FAIL")
        return self._values(outcome)

    def _timed_ratio(self, trial: optuna.Trial, tuned: nn.Module) -> float:
        """The plan timed against fp32 at every shape; each shape's figures go on the trial, the weighted ratio
        is returned."""
        by_shape = latency_by_shape(self.measurer, {"fp32": self.fp32, "plan": tuned}, self.shapes,
                                    self.config.repeats)
        ratios = ratios_to_fp32(by_shape, "plan")
        timing = by_shape[self.shapes[0].name]
        for name, value in (("latency_ms", timing["plan"].median_ms), ("latency_spread_ms", timing["plan"].spread_ms),
                            ("fp32_latency_ms", timing["fp32"].median_ms),
                            ("latency_by_shape", {shape: {"ratio": ratios[shape], "latency_ms": t["plan"].median_ms,
                                                          "latency_spread_ms": t["plan"].spread_ms,
                                                          "fp32_latency_ms": t["fp32"].median_ms,
                                                          "fp32_spread_ms": t["fp32"].spread_ms}
                                                  for shape, t in by_shape.items()})):
            trial.set_user_attr(name, value)
        return weighted_ratio(ratios, self.shapes)

    def _predicted_ratio(self, trial: optuna.Trial) -> float:
        """The plan's latency ratio as its module costs predict it."""
        fp32 = {unit: "fp32" for unit in self.space.choices}
        return self.space.predicted_ms(trial.params) / self.space.predicted_ms(fp32)

    def run_once(self) -> FrozenTrial:
        """Runs one trial (a queued plan, else one the sampler proposes); returns it as it finished."""
        self._last, self._running = None, None
        try:
            self.study.optimize(self.objective, n_trials=1, catch=(TrialFailed,), callbacks=self.callbacks)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):   # "Cannot tell a FAIL trial."
            if (lost := self._failed_elsewhere()) is None:
                raise
            return lost
        assert self._last is not None   # optimize calls the callbacks after every trial, failed ones too
        return self._last

    def _failed_elsewhere(self) -> FrozenTrial | None:
        """The trial the objective ran, where another process failed it as it ran, or None. Its heartbeat stopped
        (this process was paused, or the database did not answer for a while), so another worker's stale-trial
        check failed it and queued its plan again; what this process found is dropped, as a dead process's is.
        Before, the late result failed the whole job: `ValueError: Cannot tell a FAIL trial.`"""
        if self._running is None:
            return None
        number, key = self._running
        lost = next((t for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                     if t.number == number), None)
        if lost is None:
            return None
        self.outcomes.pop(key, None)
        self.failed.discard(key)
        log.warning("trial %d was failed by another process while this one ran it: its heartbeat stopped (this "
                    "process was paused, or the database did not answer), and its plan was queued again; what this "
                    "process found is dropped", number)
        return lost

    def start_next(self, choose: Callable[[], bool] = lambda: True, queued_only: bool = False) -> FrozenTrial | None:
        """Runs the next trial if `choose`, asked after a fresh read of the study, lets one start (it may queue a
        plan first): the oldest queued trial, else, unless `queued_only`, one the sampler proposes. Returns it as
        it finished, or None where none started.

        The study's turn is held from that read until the trial exists, so two workers cannot both start the
        budget's last trial (a study of 12 ended with 13), nor both take one queued plan (the second would start
        a sampled plan in its place)."""
        with ExitStack() as turn:
            turn.enter_context(self.turn(QUEUE_TURN))
            self._end_turn = turn.close    # the objective ends it first thing: the trial exists by then
            try:
                self.refresh()
                # No second read: under the turn no other worker takes a queued trial, and `queue` counts its own.
                if not choose() or (queued_only and not self.waiting):
                    return None
                return self.run_once()
            finally:
                self._end_turn = None

    def queue(self, unit_plan: Plan, source: str) -> None:
        """Queues `unit_plan` as a trial; until it ends, every worker's `status_of` sees it running."""
        key = plan_key(self.space.expand(unit_plan))
        # Queued with its params set (as Optuna's heartbeat retry callback re-queues a trial), so the objective's
        # suggest calls read them back: one storage write for the plan instead of one per unit.
        distributions = {unit: CategoricalDistribution(self.space.choices[unit]) for unit in unit_plan}
        self.study.add_trial(create_trial(state=TrialState.WAITING, params=unit_plan, distributions=distributions,
                                          user_attrs={"source": source, studies.QUEUED_KEY_ATTR: key}))
        self.waiting += 1    # the study as last read, with this trial: what start_next goes by
        self.in_flight += 1

    def status_of(self, unit_plan: Plan) -> Status:
        """What the study knows of `unit_plan`, as of this runner's last `refresh`."""
        key = plan_key(self.space.expand(unit_plan))
        if key in self.outcomes:
            return Status.PASSED if self.outcomes[key].passed else Status.FAILED
        if key in self.failed:
            return Status.FAILED
        return Status.RUNNING if key in self.taken else Status.NEW

    def missed(self, unit_plan: Plan) -> bool:
        """Whether `unit_plan` was evaluated and missed the tolerance (a trial that raised or timed out did not)."""
        outcome = self._outcome(unit_plan)
        return outcome is not None and not outcome.passed

    def tolerances_lost(self, unit_plan: Plan) -> float | None:
        """An evaluated plan's accuracy loss over the tolerable loss (1 is the limit), None where not known."""
        outcome = self._outcome(unit_plan)
        return None if outcome is None else outcome.tolerances_lost

    def _outcome(self, unit_plan: Plan) -> Outcome | None:
        return self.outcomes.get(plan_key(self.space.expand(unit_plan)))

    def turn(self, name: str) -> AbstractContextManager[None]:
        """Holds the study's lease `name` (one worker at a time) for a short step such as choosing a plan."""
        return lease(self.claims.storage, self.study.study_name, name, ttl_s=self.config.grace_period,
                     poll_s=TURN_POLL_S)

    def run_the_rest(self, should_stop: Callable[[], str | None] | None = None) -> None:
        """Runs what is queued, and waits out the trials other processes are running, so that no trial is left
        behind and the winner is chosen from all of them: a live one ends; a dead one is failed by the heartbeat
        check (within grace_period) and its plan, queued again, runs here. `should_stop` giving a reason ends it
        (a cancelled job)."""
        while True:
            fail_stale_trials(self.study, self.config.grace_period)
            # Asked first: a queued trial ran after the job was cancelled.
            if should_stop is not None and should_stop():
                return
            view = self.refresh()     # read without the turn: workers still searching need it to start trials
            if view.waiting:
                log.info("a plan queued again when its trial stopped mid-run is tried, the search stopped or not")
                self.start_next(queued_only=True)
            elif not view.running:
                return
            else:
                time.sleep(CLAIM_POLL_S)

    def refresh(self) -> studies.TrialsView:
        """Adds plans finished elsewhere (another worker or an earlier run) to what this runner knows; returns
        the study's trials as read (`evaluated` counts all processes' evaluations: the shared budget)."""
        view = studies.view_trials(self.study)
        for key, trial in view.finished.items():
            if key not in self.outcomes:
                self.outcomes[key] = Outcome(trial.values[0], trial.user_attrs["accuracy_loss"],
                                             self.config.tolerable_loss)
        self.failed |= view.failed
        self.taken = view.taken
        self.evaluated = view.evaluated
        self.in_flight = view.waiting + view.running
        self.waiting = view.waiting
        self.stale = view.stale
        self.unguided_in_flight = view.unguided_in_flight
        self.longest_trial_s = view.longest_trial_s
        if not self.baseline_eval_s:   # stored once the baseline is evaluated, by whichever worker did
            self.baseline_eval_s = studies.get_attr(self.study, studies.BASELINE_EVAL_S_ATTR) or 0.0
        return view
