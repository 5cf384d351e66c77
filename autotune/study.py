"""Glue to Optuna's storage: where studies live, what the tuner keeps on them, and reading trials back.

Studies stay plain Optuna studies: params are module dtypes, the value is latency as a ratio of fp32 measured
in the same trial, and every measurement is a trial user attribute, so `optuna.load_study` reads them as is.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from autotune.config import TuningConfig
from autotune.errors import StudyMismatchError
from autotune.plan import Plan, plan_key

# A process killed mid-trial stops beating; after the grace period another run marks its trial FAILED and
# the retry callback re-queues the same plan.
HEARTBEAT_INTERVAL_S = 10
GRACE_PERIOD_S = 30
ATTR_PREFIX = "autotune."


def sqlite_path(url: str) -> Path | None:
    """The database file of an `sqlite:///` URL, None for other storages."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_storage(url: str) -> RDBStorage:
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_INTERVAL_S,
                          grace_period=GRACE_PERIOD_S,
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3))


def default_study_name(model_class: str, candidates: dict[str, list[str]], config: TuningConfig) -> str:
    space = json.dumps([candidates, config.tolerable_loss, config.loss_kind, config.higher_is_better,
                        config.device], sort_keys=True)
    return f"{model_class}-{hashlib.sha1(space.encode()).hexdigest()[:10]}"


def open_study(config: TuningConfig, study_name: str, candidates: dict[str, list[str]]) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Trials carry their accuracy constraint (Trial.set_constraint), which TPE reads on its own.
        sampler = optuna.samplers.TPESampler(seed=config.seed, multivariate=True, group=True, n_startup_trials=5)
    study = optuna.create_study(study_name=study_name, storage=open_storage(config.storage), sampler=sampler,
                                direction="minimize", load_if_exists=True)
    stored = get_attr(study, "candidates")
    if stored is None:
        set_attr(study, "candidates", candidates)
    elif stored != candidates:
        raise StudyMismatchError(
            f"study {study_name!r} in {config.storage} was made for other modules or dtypes "
            f"({len(stored)} modules there, {len(candidates)} here); use another study_name")
    return study


def get_attr(study: optuna.Study, key: str) -> Any:
    return study.user_attrs.get(ATTR_PREFIX + key)


def set_attr(study: optuna.Study, key: str, value: Any) -> None:
    study.set_user_attr(ATTR_PREFIX + key, value)


def trial_plan(trial: FrozenTrial) -> Plan:
    return {name: str(dtype) for name, dtype in trial.params.items()}


def evaluated_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Trials whose eval_fn call ended (complete, or failed with a reason), duplicates excluded.

    A trial failed by the heartbeat check (its process died mid-trial) has no fail_reason and does not count.
    """
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
            if t.user_attrs.get("evaluated") and (t.state == TrialState.COMPLETE or "fail_reason" in t.user_attrs)]


def finished_by_plan(study: optuna.Study) -> dict[str, FrozenTrial]:
    """The first completed, evaluated trial of each plan: what a resumed search reuses instead of re-evaluating."""
    found: dict[str, FrozenTrial] = {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if trial.user_attrs.get("evaluated"):
            found.setdefault(plan_key(trial_plan(trial)), trial)
    return found


def passing_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Completed trials that met the accuracy requirement, fastest first."""
    return sorted((t for t in finished_by_plan(study).values() if t.user_attrs.get("passed")),
                  key=lambda t: t.values[0])
