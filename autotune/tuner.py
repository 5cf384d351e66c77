"""`autotune(model, tune_config, eval_fn)`: baseline, cheap signals, guided search, sampler, verified winner."""
from __future__ import annotations

import copy
import logging
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable

import optuna
import torch
from torch import nn

from autotune.backends import CallInputs, get_backend
from autotune.capture import as_call_inputs, record_module_inputs, run_capturing, to_device
from autotune.config import TuningConfig
from autotune.discovery import tunable_modules
from autotune.errors import EvalFunctionError
from autotune.measure import measure_latency, weight_bytes
from autotune.plan import Plan, apply_plan, plan_key, summarize
from autotune.result import Measurement, TuningResult
from autotune.search import SearchSpace, exhaustive_order, guided_search
from autotune.sensitivity import module_latency, module_sensitivity
from autotune import study as studies

log = logging.getLogger("autotune")
EXHAUSTIVE_LIMIT = 256  # spaces this small are enumerated instead of sampled (TPE would mostly repeat plans)
EvalFn = Callable[[nn.Module], Any]


def score_of(value: Any) -> float:
    """eval_fn's return as a finite float, or EvalFunctionError saying what came back instead."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EvalFunctionError(f"eval_fn must return a number; it returned {type(value).__name__} {value!r:.80}")
    if not math.isfinite(value):
        raise EvalFunctionError(f"eval_fn returned {value}, not a finite number")
    return float(value)


class _TrialFailed(Exception):
    """An eval_fn failure inside one trial: Optuna records the trial FAILED and the search goes on."""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    latency_ratio: float
    constraint: float  # accuracy loss minus the tolerable loss: feasible when <= 0


def _outcome_of(trial: optuna.trial.FrozenTrial) -> Outcome:
    return Outcome(bool(trial.user_attrs["passed"]), trial.values[0], trial.constraints["accuracy"])


class TrialRunner:
    """Runs plans as Optuna trials: apply, evaluate, time against fp32 in the same run, record everything."""

    def __init__(self, study: optuna.Study, space: SearchSpace, fp32: nn.Module, eval_fn: EvalFn,
                 inputs: CallInputs, calibration: dict[str, CallInputs], baseline_accuracy: float,
                 config: TuningConfig):
        self.study, self.space, self.fp32, self.eval_fn = study, space, fp32, eval_fn
        self.inputs, self.calibration, self.baseline, self.config = inputs, calibration, baseline_accuracy, config
        self.device = torch.device(config.device)
        self.outcomes: dict[str, Outcome] = {}
        self.refresh()
        self.failed: set[str] = set()
        self.eval_calls = 0
        self.last_was_duplicate = False

    def objective(self, trial: optuna.Trial) -> float:
        plan = {name: trial.suggest_categorical(name, options) for name, options in self.space.choices.items()}
        key = plan_key(plan)
        known = self.outcomes.get(key)
        self.last_was_duplicate = known is not None
        # Set either way: a trial re-queued after a crash arrives with its stale trial's attributes.
        trial.set_user_attr("evaluated", known is None)
        if known is not None:   # already evaluated: tell the sampler the stored result, spend no eval_fn call
            trial.set_user_attr("duplicate", True)
            trial.set_constraint("accuracy", known.constraint)
            return known.latency_ratio
        tuned = apply_plan(self.fp32, plan, self.calibration)
        self.eval_calls += 1
        try:
            accuracy = score_of(self.eval_fn(tuned))
        except Exception as exc:  # the user's code: any failure fails this trial only
            self.failed.add(key)
            trial.set_user_attr("fail_reason", f"{type(exc).__name__}: {exc}"[:2000])
            log.warning("trial %d failed: %s: %s", trial.number, type(exc).__name__, exc)
            raise _TrialFailed(str(exc)) from exc
        timing = measure_latency({"fp32": self.fp32, "plan": tuned}, self.inputs, warmup=self.config.warmup,
                                 repeats=self.config.repeats, num_threads=self.config.num_threads,
                                 device=self.device)
        loss = self.config.accuracy_loss(self.baseline, accuracy)
        passed = loss <= self.config.tolerable_loss
        ratio = timing["plan"].median_ms / timing["fp32"].median_ms
        trial.set_constraint("accuracy", loss - self.config.tolerable_loss)
        for name, value in (("accuracy", accuracy), ("accuracy_loss", loss), ("passed", passed),
                            ("latency_ms", timing["plan"].median_ms), ("latency_spread_ms", timing["plan"].spread_ms),
                            ("fp32_latency_ms", timing["fp32"].median_ms), ("weight_bytes", weight_bytes(tuned)),
                            ("plan_summary", summarize(plan))):
            trial.set_user_attr(name, value)
        self.outcomes[key] = Outcome(passed, ratio, loss - self.config.tolerable_loss)
        log.info("trial %d [%s] %s: accuracy %.4f (loss %.4f) latency %.2fx fp32 %s", trial.number,
                 trial.user_attrs.get("source", "sampler"), summarize(plan), accuracy, loss, ratio,
                 "pass" if passed else "FAIL")
        return ratio

    def run_once(self) -> None:
        self.study.optimize(self.objective, n_trials=1, catch=(_TrialFailed,))

    def run_plan(self, plan: Plan, source: str) -> Outcome | None:
        """The outcome of `plan`, evaluating it only if no finished trial has it; None if its trial failed."""
        key = plan_key(plan)
        if key not in self.outcomes:
            self.study.enqueue_trial(plan, user_attrs={"source": source})
            # Trials queued earlier (re-queued after a crash) run first; another worker may take ours.
            queued = len(self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
            for _ in range(queued):
                if key in self.outcomes or key in self.failed:
                    break
                self.run_once()
            if key not in self.outcomes and key not in self.failed:
                self.refresh()
        return self.outcomes.get(key)

    def refresh(self) -> None:
        """Adds plans finished elsewhere (another worker on the same study) to what this runner knows."""
        for key, trial in studies.finished_by_plan(self.study).items():
            self.outcomes.setdefault(key, _outcome_of(trial))


def _signals(study: optuna.Study, fp32: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
             calibration: dict[str, CallInputs], config: TuningConfig) -> SearchSpace:
    """Per-module sensitivity and latency, computed once and kept on the study for resumed runs."""
    sensitivity = studies.get_attr(study, "sensitivity")
    if sensitivity is None:
        sensitivity = module_sensitivity(fp32, candidates, inputs, calibration)
        studies.set_attr(study, "sensitivity", sensitivity)
    latency = studies.get_attr(study, "module_latency_ms")
    if latency is None:
        latency = module_latency(fp32, candidates, calibration, repeats=config.repeats,
                                 num_threads=config.num_threads, device=torch.device(config.device))
        studies.set_attr(study, "module_latency_ms", latency)
    return SearchSpace.build(candidates, sensitivity, latency)


def search_candidates(model: nn.Module, config: TuningConfig) -> dict[str, list[str]]:
    """Tunable modules and the dtypes the configured device supports for each (speed is measured later)."""
    device = torch.device(config.device)
    return {name: [d for d in dtypes if get_backend(d).supports(model.get_submodule(name), device)]
            for name, dtypes in tunable_modules(model, config.config_set).items()}


def study_name_for(model: nn.Module, config: TuningConfig, candidates: dict[str, list[str]] | None = None) -> str:
    """The configured study name, or the one derived from the model class and search space."""
    return config.study_name or studies.default_study_name(
        type(model).__name__, candidates if candidates is not None else search_candidates(model, config), config)


def _search(runner: TrialRunner, config: TuningConfig, deadline: float) -> None:
    def budget_left() -> bool:
        return len(studies.evaluated_trials(runner.study)) < config.max_trials and time.monotonic() < deadline

    search = guided_search(runner.space)
    try:
        plan = next(search)
        while budget_left():
            outcome = runner.run_plan(plan, "guided")
            plan = search.send(outcome is not None and outcome.passed)
    except StopIteration:
        pass

    def best_ratio() -> float:
        return min((o.latency_ratio for o in runner.outcomes.values() if o.passed), default=math.inf)

    best, stale, duplicates = best_ratio(), 0, 0

    def note_progress() -> None:
        nonlocal best, stale
        now = best_ratio()
        stale = 0 if now < best else stale + 1
        best = now

    if runner.space.size <= EXHAUSTIVE_LIMIT:
        for plan in exhaustive_order(runner.space):
            if not budget_left() or stale >= config.patience:
                return
            if plan_key(plan) not in runner.outcomes:
                runner.run_plan(plan, "exhaustive")
                note_progress()
        return
    while budget_left() and stale < config.patience and duplicates < 3 * config.patience:
        runner.run_once()
        if runner.last_was_duplicate:
            duplicates += 1
            continue
        duplicates = 0
        note_progress()


def _verified_winner(runner: TrialRunner, config: TuningConfig) -> tuple[Plan, nn.Module, float, dict]:
    """Re-times the best passing plans interleaved with fp32 and re-evaluates the fastest; fp32 if none holds."""
    fp32_plan = {name: "fp32" for name in runner.space.choices}
    finalists = {f"trial {t.number}": studies.trial_plan(t) for t in studies.passing_trials(runner.study)[:3]}
    models = {name: apply_plan(runner.fp32, plan, runner.calibration) for name, plan in finalists.items()}
    timing = measure_latency({"fp32": runner.fp32, **models}, runner.inputs, warmup=config.warmup,
                             repeats=2 * config.repeats, num_threads=config.num_threads,
                             device=torch.device(config.device))
    for name in sorted(models, key=lambda n: timing[n].median_ms):
        if timing[name].median_ms >= timing["fp32"].median_ms:
            break
        runner.eval_calls += 1
        accuracy = score_of(runner.eval_fn(copy.deepcopy(models[name])))
        if config.passes(runner.baseline, accuracy):
            return finalists[name], models[name], accuracy, timing | {"best": timing[name]}
        log.warning("%s passed before but missed the requirement on re-evaluation (%.4f); trying the next",
                    name, accuracy)
    log.warning("no lowered plan both met the accuracy requirement and ran faster than fp32; keeping fp32")
    return fp32_plan, copy.deepcopy(runner.fp32), runner.baseline, timing | {"best": timing["fp32"]}


def autotune(model: nn.Module, tune_config: TuningConfig | dict, eval_fn: EvalFn,
             example_inputs: Any = None) -> TuningResult:
    """Finds the fastest per-module dtype plan whose eval_fn score stays within the tolerable loss.

    `eval_fn(model) -> number` scores a model (higher is better unless the config says otherwise).
    `example_inputs` feed latency measurement and calibration; by default the first batch eval_fn gives the
    model is captured. The user's `model` is never modified: every candidate is built on a private copy.
    """
    started = time.monotonic()
    config = tune_config if isinstance(tune_config, TuningConfig) else TuningConfig.from_mapping(tune_config)
    if not callable(eval_fn):
        raise EvalFunctionError(f"eval_fn must be callable as eval_fn(model) -> number; got {type(eval_fn).__name__}")
    device = torch.device(config.device)
    fp32 = copy.deepcopy(model).eval().to(device)
    candidates = search_candidates(fp32, config)
    study = studies.open_study(config, study_name_for(model, config, candidates), candidates)

    baseline = studies.get_attr(study, "baseline_accuracy")
    eval_calls = 0
    if baseline is None or example_inputs is None:
        eval_calls += 1
        try:
            returned, captured = run_capturing(copy.deepcopy(fp32), eval_fn, stop_early=baseline is not None)
            if baseline is None:
                baseline = score_of(returned)
        except EvalFunctionError as exc:
            raise EvalFunctionError(f"the fp32 baseline evaluation failed, so no trial was run: {exc}") from exc
        except Exception as exc:
            raise EvalFunctionError(f"the fp32 baseline evaluation failed, so no trial was run: "
                                    f"{type(exc).__name__}: {exc}") from exc
        studies.set_attr(study, "baseline_accuracy", baseline)
    inputs = to_device(as_call_inputs(example_inputs), device) if example_inputs is not None else captured
    calibration = record_module_inputs(fp32, list(candidates), inputs)
    space = _signals(study, fp32, candidates, inputs, calibration, config)
    log.info("baseline accuracy %.4f; %d tunable modules; %d combinations after pruning", baseline,
             len(candidates), space.size)

    runner = TrialRunner(study, space, fp32, eval_fn, inputs, calibration, baseline, config)
    _search(runner, config, started + (config.timeout or math.inf))
    plan, tuned, accuracy, timing = _verified_winner(runner, config)
    studies.set_attr(study, "best", {"plan": plan, "accuracy": accuracy,
                                     "speedup": timing["fp32"].median_ms / timing["best"].median_ms})
    return TuningResult(
        model=tuned, plan=plan, study=study,
        baseline=Measurement(baseline, timing["fp32"], weight_bytes(fp32)),
        best=Measurement(accuracy, timing["best"], weight_bytes(tuned)),
        eval_calls=eval_calls + runner.eval_calls, trials_evaluated=len(studies.evaluated_trials(study)),
        wall_time_s=time.monotonic() - started)
