"""`autotune(model, tune_config, eval_fn)`: baseline, cheap signals, guided search, sampler, verified winner."""
from __future__ import annotations

import gc
import logging
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from autotune.backends import get_backend
from autotune.capture import as_call_inputs, record_module_inputs, run_capturing, to_device
from autotune.clone import clone
from autotune.config import TuningConfig
from autotune.discovery import qkv_groups, tunable_modules
from autotune.errors import EvalFunctionError
from autotune.measure import weight_bytes
from autotune.plan import Plan, apply_plan, is_baseline, plan_key
from autotune.result import Measurement, TuningResult
from autotune.search import SearchSpace, exhaustive_order, guided_search
from autotune.signals import DeviceMeasurer, Measurer, cached_signals
from autotune.timeout import call_with_timeout
from autotune.trials import EvalFn, TrialRunner, fail_stale_trials, score_of
from autotune import study as studies

log = logging.getLogger("autotune")
EXHAUSTIVE_LIMIT = 256  # spaces this small are enumerated instead of sampled (TPE would mostly repeat plans)


def search_candidates(model: nn.Module, config: TuningConfig) -> dict[str, list[str]]:
    """Tunable modules and the dtypes the configured device supports for each (speed is measured later)."""
    device = torch.device(config.device)
    return {name: [d for d in dtypes if get_backend(d).supports(model.get_submodule(name), device)]
            for name, dtypes in tunable_modules(model, config.config_set).items()}


def study_name_for(model: nn.Module, config: TuningConfig, candidates: dict[str, list[str]] | None = None) -> str:
    """The configured study name, or the one derived from the model class and search space."""
    return config.study_name or studies.default_study_name(
        type(model).__name__, candidates if candidates is not None else search_candidates(model, config), config)


def module_groups(candidates: dict[str, list[str]], config: TuningConfig) -> list[list[str]]:
    """The user's groups, plus q/k/v groups (if enabled) of modules no user group holds."""
    groups = [list(group) for group in config.groups]
    if config.group_qkv:
        taken = {name for group in groups for name in group}
        groups += [group for group in qkv_groups(candidates) if not taken.intersection(group)]
    return groups


def _guided_then_sampled(runner: TrialRunner, config: TuningConfig, deadline: float) -> None:
    def budget_left() -> bool:   # runner.evaluated: all workers' evaluations as of the runner's last read
        return runner.evaluated < config.max_trials and time.monotonic() < deadline

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
            key = plan_key(runner.space.expand(plan))
            if key in runner.outcomes:
                continue
            # A plan another worker is running is theirs: move on rather than wait for it.
            if not runner.held_elsewhere(key):
                runner.run_plan(plan, "exhaustive")
                note_progress()
        return
    while budget_left() and stale < config.patience and duplicates < 3 * config.patience:
        runner.run_once()
        runner.refresh()
        if runner.last_was_duplicate:
            duplicates += 1
            continue
        duplicates = 0
        note_progress()


def _verified_winner(runner: TrialRunner, config: TuningConfig) -> tuple[Plan, nn.Module, float, dict]:
    """Re-times the best passing plans interleaved with fp32 and re-evaluates the fastest; fp32 if none holds.

    The finalists are the three fastest passing trials and the fastest passing uniform plan, so the winner is
    never slower than the best uniform dtype in that timing (trial timings on a noisy host can rank them wrong).
    """
    fp32_plan = runner.space.expand({unit: "fp32" for unit in runner.space.choices})
    passing = studies.passing_trials(runner.study)
    uniform = {plan_key(runner.space.expand(plan)) for plan in runner.space.uniform_plans()}
    best_uniform = [t for t in passing if studies.trial_plan_key(t) in uniform][:1]
    finalists = {f"trial {t.number}": plan for t in passing[:3] + best_uniform
                 if not is_baseline(plan := studies.trial_plan(t))}
    models = {name: apply_plan(runner.fp32, plan, runner.calibration, runner.variants)
              for name, plan in finalists.items()}
    timing = runner.measurer.latency({"fp32": runner.fp32, **models}, runner.inputs, 2 * config.repeats)
    for name in sorted(models, key=lambda n: timing[n].median_ms):
        if timing[name].median_ms >= timing["fp32"].median_ms:
            break
        runner.eval_calls += 1
        try:
            accuracy = score_of(call_with_timeout(runner.eval_fn, clone(models[name]), config.trial_timeout))
        except Exception as exc:  # the user's code; the trials are saved, so try the next finalist
            log.warning("%s: re-evaluation failed (%s: %s); trying the next", name, type(exc).__name__, exc)
            continue
        if config.passes(runner.baseline, accuracy):
            return finalists[name], models[name], accuracy, timing | {"best": timing[name]}
        log.warning("%s passed before but missed the requirement on re-evaluation (%.4f); trying the next",
                    name, accuracy)
    log.warning("no lowered plan both met the accuracy requirement and ran faster than fp32; keeping fp32")
    return fp32_plan, clone(runner.fp32), runner.baseline, timing | {"best": timing["fp32"]}


@contextmanager
def _fewer_collections(allocations: int = 20_000) -> Iterator[None]:
    """Lets the cyclic garbage collector wait for more allocations while the tuner runs (restored after).

    A trial allocates a few hundred thousand short-lived objects (its model's modules, Optuna's trial records),
    nearly all freed by reference counting. At Python's default threshold (700) the collector ran ~1,400 times
    over a 24-trial search at 500 modules, scanning the long-lived model and study each time: ~0.9 s, a fifth
    of the tuner's own time there; at 20,000 it runs ~30 times (~0.2 s).
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], allocations), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def autotune(model: nn.Module, tune_config: TuningConfig | dict, eval_fn: EvalFn,
             example_inputs: Any = None, *, measurer: Measurer | None = None) -> TuningResult:
    """Finds the fastest per-module dtype plan whose eval_fn score stays within the tolerable loss.

    `eval_fn(model) -> number` scores a model (higher is better unless the config says otherwise).
    `example_inputs` feed latency measurement and calibration; by default the first batch eval_fn gives the
    model is captured. The user's `model` is never modified: every candidate is built on a private copy.
    `measurer` replaces on-device measurement (signals and latency), e.g. with a simulator.
    """
    started = time.monotonic()
    runner = start_runner(model, tune_config, eval_fn, example_inputs, measurer)
    search(runner, started)
    return finish(runner, started)


@_fewer_collections()
def start_runner(model: nn.Module, tune_config: TuningConfig | dict, eval_fn: EvalFn, example_inputs: Any = None,
                 measurer: Measurer | None = None) -> TrialRunner:
    """Opens (or joins) the study and makes it ready for trials: baseline score, signals, search space.

    Several processes may do this on one study at once: the first evaluates the baseline and measures the
    signals under the study's lock, the others reuse them.
    """
    config = tune_config if isinstance(tune_config, TuningConfig) else TuningConfig.from_mapping(tune_config)
    if not callable(eval_fn):
        raise EvalFunctionError(f"eval_fn must be callable as eval_fn(model) -> number; got {type(eval_fn).__name__}")
    device = torch.device(config.device)
    fp32 = clone(model).eval().to(device)
    candidates = search_candidates(fp32, config)
    study = studies.open_study(config, study_name_for(model, config, candidates), candidates)
    measurer = measurer or DeviceMeasurer(config)
    fail_stale_trials(study)   # trials of a killed earlier run: FAILED now, their plans queued again

    with studies.plan_lock(config.storage, study):
        baseline = studies.get_attr(study, "baseline_accuracy")
        eval_calls = 0
        if baseline is None or example_inputs is None:
            eval_calls += 1
            try:
                returned, captured = run_capturing(clone(fp32), eval_fn, stop_early=baseline is not None)
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
        sensitivity, latency = cached_signals(study, measurer, fp32, candidates, inputs, calibration)
    space = SearchSpace.build(candidates, sensitivity, latency, module_groups(candidates, config))
    log.info("baseline accuracy %.4f; %d tunable modules in %d units; %d combinations after pruning", baseline,
             len(candidates), len(space.choices), space.size)
    runner = TrialRunner(study, space, fp32, eval_fn, inputs, calibration, baseline, config, measurer)
    runner.eval_calls = eval_calls
    return runner


@_fewer_collections()
def search(runner: TrialRunner, started: float) -> None:
    """Runs trials until the budget (max_trials, timeout, patience) is spent; all processes share it."""
    _guided_then_sampled(runner, runner.config, started + (runner.config.timeout or math.inf))
    runner.run_queued()   # plans re-queued after a crash are retried even when the budget is spent


@_fewer_collections()
def finish(runner: TrialRunner, started: float) -> TuningResult:
    """The verified winner of the study, recorded on it as `best`."""
    plan, tuned, accuracy, timing = _verified_winner(runner, runner.config)
    study = runner.study
    studies.set_attr(study, "best", {"plan": plan, "accuracy": accuracy,
                                     "speedup": timing["fp32"].median_ms / timing["best"].median_ms})
    return TuningResult(
        model=tuned, plan=plan, study=study,
        baseline=Measurement(runner.baseline, timing["fp32"], weight_bytes(runner.fp32)),
        best=Measurement(accuracy, timing["best"], weight_bytes(tuned)),
        eval_calls=runner.eval_calls, trials_evaluated=len(studies.evaluated_trials(study)),
        wall_time_s=time.monotonic() - started)
