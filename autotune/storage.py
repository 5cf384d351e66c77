"""Optuna's RDB storage as the tuner opens it: heartbeats, SQLite tuned for several local workers, and a trial's
params written in one transaction.

Optuna commits every suggested param on its own, 1-2 ms each on SQLite. The tuner suggests one param per unit,
so at 500 modules that was about a second of commits per trial, more than a cheap eval_fn. `ParamBatchingStorage`
holds a running trial's params until anything next writes or reads trials, then inserts them in one transaction
after Optuna's checks (made once per trial); Optuna's cache in front of it answers the running trial's params
meanwhile. It uses Optuna's RDB models, so optuna stays pinned (requirements.txt).
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.distributions import (BaseDistribution, check_distribution_compatibility, distribution_to_json,
                                  json_to_distribution)
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session


class ParamBatchingStorage(RDBStorage):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pending: list[tuple[int, str, float, BaseDistribution, BaseDistribution | None]] = []
        self._pending_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                         distribution: BaseDistribution, previous_distribution: BaseDistribution | None) -> None:
        with self._pending_lock:
            self._pending.append((trial_id, param_name, param_value_internal, distribution, previous_distribution))

    def flush_params(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
            by_trial: dict[int, list] = {}
            for trial_id, *param in pending:
                by_trial.setdefault(trial_id, []).append(param)
            if by_trial:
                with _create_scoped_session(self.scoped_session, True) as session:
                    for trial_id, params in by_trial.items():
                        self._insert_params(session, trial_id, params)

    def _insert_params(self, session: sqlalchemy.orm.Session, trial_id: int, params: list) -> None:
        """The checks of Optuna's `_set_trial_param_without_commit`, made once per trial instead of per param:
        the trial is still running, and each param's distribution is compatible with the study's."""
        trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
        self.check_trial_is_updatable(trial_id, trial.state)
        unknown = [name for name, _, _, previous in params if previous is None]
        stored = dict(session.query(models.TrialParamModel.param_name,
                                    sqlalchemy.func.min(models.TrialParamModel.distribution_json))
                      .join(models.TrialModel).filter(models.TrialModel.study_id == trial.study_id)
                      .filter(models.TrialParamModel.param_name.in_(unknown))
                      .group_by(models.TrialParamModel.param_name).all()) if unknown else {}
        rows = []
        for name, value, distribution, previous in params:
            if previous is None and name in stored:
                previous = json_to_distribution(stored[name])
            if previous is not None:
                check_distribution_compatibility(previous, distribution)
            rows.append({"trial_id": trial_id, "param_name": name, "param_value": value,
                         "distribution_json": distribution_to_json(distribution)})
        session.execute(sqlalchemy.insert(models.TrialParamModel), rows)   # one executemany, no ORM objects

    def __getstate__(self) -> dict[Any, Any]:
        self.flush_params()
        state = super().__getstate__()
        state.pop("_pending_lock", None)
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._pending_lock = threading.Lock()


def _flushing_first(method):
    def wrapper(self, *args, **kwargs):
        self.flush_params()
        return method(self, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


# Every RDBStorage method that writes a trial or reads trials back sees the pending params first.
for _name in ("_create_new_trial", "create_new_trial", "set_trial_state_values", "set_trial_intermediate_value",
              "set_trial_user_attr", "set_trial_system_attr", "get_trial", "get_trial_param", "get_trial_params",
              "get_trial_user_attrs", "get_trial_system_attrs", "_get_trials", "get_all_trials", "get_n_trials",
              "get_best_trial", "_get_best_trial_id", "_get_stale_trial_ids", "get_trial_id_from_study_id_trial_number",
              "delete_study", "remove_session"):
    setattr(ParamBatchingStorage, _name, _flushing_first(getattr(RDBStorage, _name)))


def sqlite_path(url: str) -> Path | None:
    """The database file of an `sqlite:///` URL, None for other storages."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_storage(url: str, heartbeat_interval: int = 10, grace_period: int = 30) -> ParamBatchingStorage:
    """An RDB storage whose running trials beat: a process killed mid-trial stops beating, and after the grace
    period the next run (or another worker) marks its trial FAILED and the retry callback queues the plan again.

    SQLite runs in WAL mode with synchronous=NORMAL, every transaction takes the write lock as it begins, and a
    connection waits up to a minute for that lock instead of failing with "database is locked": several workers
    on one machine share one file safely, each transaction sees the rows it changes as it read them, and a
    commit costs no fsync (Optuna commits every attribute on its own). A killed process loses nothing
    committed; only an OS crash or power cut can lose the last commits, never corrupt the file.
    """
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = ParamBatchingStorage(
            url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval, grace_period=grace_period,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3))
    if url.startswith("sqlite"):
        sqlalchemy.event.listen(storage.engine, "connect", _sqlite_wal)
        sqlalchemy.event.listen(storage.engine, "begin", _begin_immediate)
        storage.engine.dispose()   # connections opened while creating the schema lack the pragmas
    return storage


def _sqlite_wal(connection, _record) -> None:
    connection.isolation_level = None   # transactions start where SQLAlchemy begins them: _begin_immediate
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _begin_immediate(connection) -> None:
    """Every transaction takes SQLite's write lock when it starts. Optuna reads a row and then updates it in one
    transaction ("SELECT ... FOR UPDATE", which SQLite ignores); Python's sqlite3 would start the transaction only
    at the UPDATE, so two workers could both read a queued trial as WAITING and both run it."""
    connection.exec_driver_sql("BEGIN IMMEDIATE")
