"""Glue to Optuna studies: opening one for a model and search space, what the tuner keeps on it, reading back.

Studies stay plain Optuna studies: params are dtypes per unit (a module, or a group sharing one dtype), the
value is latency as a ratio of fp32 measured in the same trial, and the per-module plan and every measurement
are trial user attributes, so `optuna.load_study` reads them as is.
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import optuna
import torch
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.config.tuning import TuningConfig
from autotune.errors import StudyMismatchError
from autotune.plan import Plan, plan_key
from autotune.storage.rdb import shown
from autotune.tree import tensors

ATTR_PREFIX = "autotune."
PLAN_KEY_ATTR = "plan_key"   # the trial attribute a claim writes: TrialRunner.claim
QUEUED_KEY_ATTR = "queued_plan_key"   # the key of the plan a trial was queued with (TrialRunner.queue)
CANCELLED_ATTR = "cancelled"           # which service job tuning the study was cancelled (service.worker)
BASELINE_ATTR = "baseline_accuracy"    # the fp32 model's eval_fn score (autotune.search.scores)
BASELINE_EVAL_S_ATTR = "baseline_eval_s"   # the seconds its eval_fn call took: the least a trial takes
BEST_RECORDED_WITH = "recorded_with"   # in `best`: the study's evaluated trials, the engines and knobs configured

HELD_DTYPE_ATTR = "held_dtype"          # the dtype the model was handed over in: what its plans' "fp32" keeps
LATENCY_INPUTS_ATTR = "latency_inputs"  # the config's latency_inputs, where each is written down (no callable)
MODULE_SHAPES_ATTR = "module_shapes"    # the tunable modules' parameter shapes (plan.module_shapes), for export
log = logging.getLogger("autotune")


def default_study_name(model_class: str, candidates: dict[str, list[str]], config: TuningConfig) -> str:
    settings = [candidates, config.tolerable_loss, config.loss_kind, config.higher_is_better, config.device]
    if config.objective != "latency":   # its study has two directions; latency-only names stay as they were
        settings.append(config.objective)
    if config.latency_inputs:           # another objective too; names without them stay as they were
        settings.append([entry.describe() for entry in config.latency_inputs])
    space = json.dumps(settings, sort_keys=True)
    return f"{model_class}-{hashlib.sha1(space.encode()).hexdigest()[:10]}"


# Relative difference past which two weights signatures are two models: a model built again on another CPU (a head
# fitted there) differs in its last bits, ~1e-7; retraining or fine-tuning moves its weights by far more.
WEIGHTS_RTOL = 1e-5


def weights_signature(model: torch.nn.Module) -> dict[str, list[float]]:
    """{state entry: [sum of |w|, sum of w²]} (in float64) for each tensor of the model's state: what tells one set of
    weights from another, across machines. A floating tensor in another dtype than float32 is entered under its
    name and dtype: the sums of a bf16 copy of a model are those of its fp32 weights to 1e-6, and its trials' scores
    are not theirs."""
    return {name if not value.is_floating_point() or value.dtype == torch.float32 else f"{name} ({value.dtype})":
            _sums(value) for name, value in model.state_dict().items()
            if isinstance(value, torch.Tensor) and not value.is_meta}


def _sums(value: torch.Tensor) -> list[float]:
    values = (value.dequantize() if value.is_quantized else value).detach()
    if values.is_complex():   # both parts count (a Fourier layer's weights): .double() would drop the imaginary one
        values = torch.view_as_real(values.resolve_conj())
    values = values.double()
    return [values.abs().sum().item(), values.square().sum().item()]


def built_from(study: optuna.Study, model: torch.nn.Module, batches: Any) -> str:
    """What a finalist built for `study` holds besides its plan, as a short hash: the model's weights, the code of
    its modules' classes and the batches static int8 is calibrated on. A compile cache keyed by the study's name
    alone hands a new study of another model of the same class (a new storage, or the old database deleted) the
    old model's finalists; keyed without the code, a model whose forward was edited got its old exported graph
    back, or its old attributes under the new code ("object has no attribute")."""
    inputs = [[list(t.shape), str(t.dtype), *_sums(t)] for t in tensors(batches)]
    text = json.dumps([get_attr(study, "weights"), _code_of(model), inputs], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _code_of(model: torch.nn.Module) -> list[str]:
    """The source of each class among the model's modules (its name where Python keeps no source: a class made in
    a notebook cell or by `type`)."""
    found = {}
    for cls in {type(module) for module in model.modules()}:
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            found[name] = inspect.getsource(cls)
        except (OSError, TypeError):
            found[name] = name
    return [found[name] for name in sorted(found)]


def same_weights(one: dict[str, list[float]], other: dict[str, list[float]]) -> bool:
    return one.keys() == other.keys() and all(
        math.isclose(a, b, rel_tol=WEIGHTS_RTOL, abs_tol=1e-12) for name in one for a, b in zip(one[name], other[name]))


def study_name_for_weights(storage: BaseStorage, name: str, weights: dict[str, list[float]]) -> str:
    """`name`, or where that study holds another model's weights (the same class and search space, retrained), the
    first of `name`.2, `name`.3, ... that is new or holds these weights: a derived name leads each set of weights to
    its own study, and a resumed run back to its own."""
    existing = set(optuna.get_all_study_names(storage))
    for number in itertools.count(1):
        candidate = name if number == 1 else f"{name}.{number}"
        if candidate not in existing:
            return candidate
        stored = get_attr(optuna.load_study(study_name=candidate, storage=storage), "weights")
        if stored is None or same_weights(stored, weights):
            if number > 1:
                log.info("study %r holds trials of other weights of this model; these are tuned in %r", name,
                         candidate)
            return candidate
    raise AssertionError("unreachable")


def open_study(config: TuningConfig, study_name: str, candidates: dict[str, list[str]],
               storage: BaseStorage, weights: dict[str, list[float]]) -> optuna.Study:
    """Creates the study in `storage`, or loads it if it exists.

    Raises:
        StudyMismatchError: the existing study was made for another objective, other modules or dtypes, another
            accuracy requirement, or other weights.
    """
    # Not a line per trial from Optuna, nor its traceback of each failed trial: the tuner logs each failure itself,
    # with its reason, in one line.
    if optuna.logging.get_verbosity() < optuna.logging.ERROR:
        optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Trials carry their accuracy constraint (Trial.set_constraint), which TPE reads on its own.
        # constant_liar: parallel workers steer away from the plans the others are running.
        sampler = optuna.samplers.TPESampler(seed=config.seed, multivariate=True, group=True, n_startup_trials=5,
                                             constant_liar=True)
    directions = ["minimize"] if config.objective == "latency" else ["minimize", "minimize"]
    study = optuna.create_study(study_name=study_name, storage=storage, sampler=sampler,
                                directions=directions, load_if_exists=True)
    if len(study.directions) != len(directions):
        made_for = "latency" if len(study.directions) == 1 else "pareto"    # its one or two directions
        raise StudyMismatchError(f"study {study_name!r} in {shown(config.storage)} was made for objective "
                                 f"{made_for}, not {config.objective}; use another study_name")
    stored = _recorded(study, "candidates", candidates)
    if stored != candidates:
        raise StudyMismatchError(
            f"study {study_name!r} in {shown(config.storage)} was made for other modules or dtypes "
            f"({candidates_differ(stored, candidates)}); use another study_name")
    requirement = {"tolerable_loss": config.tolerable_loss, "loss_kind": config.loss_kind,
                   "higher_is_better": config.higher_is_better}
    if (asked := _recorded(study, "requirement", requirement)) != requirement:
        raise StudyMismatchError(
            f"study {study_name!r} in {shown(config.storage)} was tuned to another accuracy requirement ({asked}, "
            f"here {requirement}): its trials' pass or fail does not hold for this one; use another study_name")
    if not same_weights(_recorded(study, "weights", weights), weights):
        raise StudyMismatchError(
            f"study {study_name!r} in {shown(config.storage)} was tuned on other weights of this model (retrained or "
            f"fine-tuned since?): its trials' scores do not hold for these; use another study_name")
    return study


def candidates_differ(stored: dict[str, list[str]], candidates: dict[str, list[str]]) -> str:
    """How a study's tunable modules and their dtypes differ from these, in words: the first few differences."""
    differences = [f"{name} only there" for name in stored if name not in candidates]
    differences += [f"{name} only here" for name in candidates if name not in stored]
    differences += [f"{name}: {'/'.join(stored[name])} there, {'/'.join(dtypes)} here"
                    for name, dtypes in candidates.items() if name in stored and stored[name] != dtypes]
    listed = "; ".join(differences[:3]) + (f"; {len(differences) - 3} more" if len(differences) > 3 else "")
    return f"{len(stored)} modules there, {len(candidates)} here: {listed}"


def check_shapes(study: optuna.Study, config: TuningConfig, weights: dict[str, float]) -> None:
    """Records the shapes latency is measured at ({name: weight}) on a new study; a study made for other shapes
    would mix two objectives.

    Raises:
        StudyMismatchError: the study was made for other shapes or weights.
    """
    stored = _recorded(study, "latency_shapes", weights)
    if stored != weights:
        raise StudyMismatchError(f"study {study.study_name!r} in {shown(config.storage)} measures latency at "
                                 f"{stored}, not {weights}; use another study_name, or name its shapes in "
                                 "latency_inputs (a batch size eval_fn's first batch no longer has: "
                                 "latency_inputs: [{batch: N}])")


def _recorded(study: optuna.Study, key: str, value: Any) -> Any:
    """What the study records under `key`: `value`, recorded now if the study had nothing there yet."""
    stored = get_attr(study, key)
    if stored is None:
        set_attr(study, key, value)
        return value
    return stored


def score_name(study: optuna.Study) -> str:
    """What the study's eval_fn scores are called where they are shown: "accuracy", or "score (lower is better)"
    for a study tuned with higher_is_better=False (a loss, an error rate, a perplexity)."""
    requirement = get_attr(study, "requirement") or {}
    return "accuracy" if requirement.get("higher_is_better", True) else "score (lower is better)"


def get_attr(study: optuna.Study, key: str) -> Any:
    return study.user_attrs.get(ATTR_PREFIX + key)


def kept_dtype(study: optuna.Study) -> str:
    """What a plan's "fp32" (a module kept as it is) computes in: the dtype the study's model was handed over in."""
    return get_attr(study, HELD_DTYPE_ATTR) or "fp32"


def set_attr(study: optuna.Study, key: str, value: Any) -> None:
    study.set_user_attr(ATTR_PREFIX + key, value)


def trial_plan(trial: FrozenTrial) -> Plan:
    """The per-module plan of a trial (its params name units: a group of modules is one param)."""
    if "plan" in trial.user_attrs:
        return dict(trial.user_attrs["plan"])
    return {name: str(dtype) for name, dtype in trial.params.items()}


def trial_plan_key(trial: FrozenTrial) -> str:
    """The key of a trial's plan: the one its claim recorded (TrialRunner.claim; an evaluated trial has one), or
    made from its plan for a trial written before claims recorded it."""
    return trial.user_attrs.get(PLAN_KEY_ATTR) or plan_key(trial_plan(trial))


def _evaluated(trial: FrozenTrial) -> bool:
    """Whether a finished trial's eval_fn call ended (complete, or failed with a reason); duplicates are not.
    A trial failed by the heartbeat check (its process died mid-trial) has no fail_reason and does not count."""
    return (trial.state.is_finished() and bool(trial.user_attrs.get("evaluated"))
            and (trial.state == TrialState.COMPLETE or "fail_reason" in trial.user_attrs))


def evaluated_trials(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
            if _evaluated(t)]


def failures(study: optuna.Study) -> dict[str, list[int]]:
    """Why evaluated trials failed (eval_fn raised, returned no number or ran past its timeout), most trials first:
    each reason's first line with the numbers of the trials it failed."""
    found: dict[str, list[int]] = {}
    for trial in evaluated_trials(study):
        if trial.state == TrialState.FAIL:
            reason = str(trial.user_attrs["fail_reason"]).strip().splitlines() or [""]
            found.setdefault(reason[0][:300], []).append(trial.number)
    return dict(sorted(found.items(), key=lambda item: -len(item[1])))


def failures_said(study: optuna.Study) -> str:
    """"N failed: the commonest reason (and M for other reasons)", or "" where no evaluated trial failed: a study
    whose every trial's eval_fn call failed read as a search that found nothing faster."""
    if not (found := failures(study)):
        return ""
    (reason, numbers), *others = found.items()
    rest = sum(len(more) for _, more in others)
    return (f"{sum(map(len, found.values()))} failed: {reason}"
            + (f" ({rest} for other reasons: `autotune show`)" if rest else ""))


@dataclass(frozen=True)
class TrialsView:
    """What the search needs to know of a study's trials, from one read of the storage (one consistent state).
    Who holds a plan is asked of the claims (storage.claims), not read from the trials."""
    finished: dict[str, FrozenTrial]  # plan key -> its first completed, evaluated trial: reused, not evaluated again
    failed: set[str]                  # plans whose eval_fn call failed (raised, timed out, no number): not again
    waiting: int                      # queued trials
    evaluated: int                    # trials whose eval_fn call ended
    stale: int = 0                    # see stale_trials
    taken: frozenset[str] = frozenset()   # plans of queued and running trials: their outcomes are coming
    unguided_in_flight: int = 0       # queued and running trials outside the guided phase: stale ones to come
    running: int = 0                  # trials some process is running now (or was, until its heartbeat is checked)
    longest_trial_s: float = 0.0      # the longest evaluated trial's wall time: eval_fn and timing (0: none yet)


def view_trials(study: optuna.Study) -> TrialsView:
    finished: dict[str, FrozenTrial] = {}
    failed: set[str] = set()
    done: list[FrozenTrial] = []
    waiting = unguided_in_flight = running = 0
    taken: set[str] = set()
    for trial in study.get_trials(deepcopy=False):
        if trial.state in (TrialState.WAITING, TrialState.RUNNING):
            waiting += trial.state == TrialState.WAITING
            running += trial.state == TrialState.RUNNING
            unguided_in_flight += trial.user_attrs.get("source") != "guided"
            taken.add(trial.user_attrs.get(QUEUED_KEY_ATTR) or trial.user_attrs.get(PLAN_KEY_ATTR))
        elif _evaluated(trial):
            done.append(trial)
            if trial.state == TrialState.COMPLETE:
                finished.setdefault(trial_plan_key(trial), trial)
            else:
                failed.add(trial_plan_key(trial))
    took = [(t.datetime_complete - t.datetime_start).total_seconds() for t in done if t.datetime_start]
    return TrialsView(finished, failed, waiting, len(done), stale_trials(done), frozenset(taken - {None}),
                      unguided_in_flight, running, max(took, default=0.0))


def stale_trials(evaluated: list[FrozenTrial]) -> int:
    """Evaluated trials outside the guided phase, by any process and any run, since the study's fastest passing
    plan last got faster: the patience every worker of a study shares, and a run resumed after a kill goes on
    counting (one killed while verifying the winner goes straight back to it)."""
    best, stale = math.inf, 0
    for trial in sorted(evaluated, key=lambda t: t.datetime_complete):
        ratio = trial.values[0] if trial.state == TrialState.COMPLETE and trial.user_attrs.get("passed") else math.inf
        if ratio < best:
            best, stale = ratio, 0
        elif trial.user_attrs.get("source") != "guided":
            stale += 1
    return stale


def passing_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials that met the accuracy requirement, fastest first."""
    return sorted((t for t in view_trials(study).finished.values() if t.user_attrs.get("passed")),
                  key=lambda t: t.values[0])


def recorded_with(trials_evaluated: int, config: TuningConfig) -> dict:
    """What a `best` recorded now, with the study's `trials_evaluated`, is recorded with: it stands for a run that has
    as much (standing_best)."""
    return {"trials": trials_evaluated, "engines": list(config.engines), "knobs": list(config.knobs)}


# How a study whose best was recorded searches on: patience counts the study's trials, so after a stop on patience
# a larger max_trials alone evaluates nothing more.
SEARCHES_ON = "a larger max_trials, or a larger patience where patience stopped it, searches on"


def standing_best(study: optuna.Study, config: TuningConfig) -> dict | None:
    """The study's recorded `best` where it still answers a run of `config`: no trial was evaluated since, and the
    engines and knobs configured are the same. None otherwise."""
    best = get_attr(study, "best")
    if not best or best.get(BEST_RECORDED_WITH) != recorded_with(len(evaluated_trials(study)), config):
        return None
    return best


def why_no_best(study: optuna.Study) -> str:
    """Why `study` has no best plan: its baseline was never scored (its eval_fn failed there, or the run stopped
    before it), the service's job tuning it was cancelled (CANCELLED_ATTR), or its tuning has not finished."""
    if get_attr(study, BASELINE_ATTR) is None:
        return "its fp32 baseline was never scored: eval_fn failed on it, or the run stopped before; tune it again"
    if cancelled := get_attr(study, CANCELLED_ATTR):
        return f"{cancelled} before its search ended; `autotune submit` of its config, or `autotune tune`, resumes it"
    return "tuning has not finished; the same tune command resumes it"
