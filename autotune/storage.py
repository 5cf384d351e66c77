"""Optuna's RDB storage as the tuner opens it: heartbeats, SQLite tuned for several local workers, a trial's
writes batched into one transaction, and trials read back without an ORM object per param.

Optuna commits every suggested param and every attribute on its own, 1-3 ms each on SQLite, and reads a trial's
params back as ORM objects whose distributions it parses twice. The tuner suggests one param per unit and reads
its running trial several times per trial, so at 500 modules that was most of a second per trial, more than a
cheap eval_fn. `WriteBatchingStorage` holds a running trial's params and user attributes until anything next
writes trial state or reads trials (or `flush` is called: the tuner's plan lock does as it is released), then
writes them in one transaction after Optuna's checks, made once per trial: an incompatible distribution is
refused there. It reads params as plain rows, parsing each distinct distribution once, and reads a trial this
process runs from what it wrote, with only the state from the database. It uses Optuna's RDB models, so optuna
stays pinned (requirements.txt); tests/test_storage.py checks that plain Optuna reads back what it wrote, and
that it reads what Optuna reads.
"""
from __future__ import annotations

import functools
import json
import threading
import warnings
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
import sqlalchemy.dialects.postgresql
import sqlalchemy.dialects.sqlite
from optuna.distributions import (BaseDistribution, check_distribution_compatibility, distribution_to_json,
                                  json_to_distribution)
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.trial import FrozenTrial, TrialState


@dataclass
class _OwnRunningTrial:
    """A trial this process runs, as this process wrote it. Only the process running a trial writes it (another
    may only fail it, once its heartbeat stops), so a read of it needs the trial's row alone: its state."""
    number: int
    params: dict[str, Any]
    distributions: dict[str, BaseDistribution]
    user_attrs: dict[str, str]        # as stored, JSON: each read decodes its own copy, as a database read does
    system_attrs: dict[str, str]
    intermediate_values: dict[int, float]

    @classmethod
    def of(cls, trial: FrozenTrial) -> "_OwnRunningTrial":
        return cls(trial.number, dict(trial.params), dict(trial.distributions),
                   {key: json.dumps(value) for key, value in trial.user_attrs.items()},
                   {key: json.dumps(value) for key, value in trial.system_attrs.items()},
                   dict(trial.intermediate_values))

    def frozen(self, row: models.TrialModel) -> FrozenTrial:
        return FrozenTrial(
            number=self.number, state=row.state, value=None, values=None, datetime_start=row.datetime_start,
            datetime_complete=row.datetime_complete, params=dict(self.params), distributions=dict(self.distributions),
            user_attrs={key: json.loads(text) for key, text in self.user_attrs.items()},
            system_attrs={key: json.loads(text) for key, text in self.system_attrs.items()},
            intermediate_values=dict(self.intermediate_values), trial_id=row.trial_id)


class WriteBatchingStorage(RDBStorage):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pending_params: list[tuple[int, str, float, BaseDistribution, BaseDistribution | None]] = []
        self._pending_attrs: dict[tuple[int, str], Any] = {}
        self._pending_lock = threading.Lock()
        # Trials this process set running; None until first read back. Optuna reads a running trial three
        # times per trial (as it starts, for a constraint, as it is told); at 500 params that was ~5 ms a read.
        self._own: dict[int, _OwnRunningTrial | None] = {}
        super().__init__(*args, **kwargs)

    def _set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                         distribution: BaseDistribution, previous_distribution: BaseDistribution | None) -> None:
        with self._pending_lock:
            self._pending_params.append((trial_id, param_name, param_value_internal, distribution,
                                         previous_distribution))
            if own := self._own.get(trial_id):
                own.params[param_name] = distribution.to_external_repr(param_value_internal)
                own.distributions[param_name] = distribution

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._pending_lock:
            self._pending_attrs[trial_id, key] = value
            if own := self._own.get(trial_id):
                own.user_attrs[key] = json.dumps(value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        super().set_trial_system_attr(trial_id, key, value)
        if own := self._own.get(trial_id):
            own.system_attrs[key] = json.dumps(value)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        super().set_trial_intermediate_value(trial_id, step, intermediate_value)
        if own := self._own.get(trial_id):
            own.intermediate_values[step] = float(intermediate_value)

    def _create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> FrozenTrial:
        trial = super()._create_new_trial(study_id, template_trial)
        if trial.state == TrialState.RUNNING:    # ask() with no queued trial: this process runs it
            self._own[trial._trial_id] = None
        return trial

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
        updated = super().set_trial_state_values(trial_id, state, values)
        if state == TrialState.RUNNING and updated:    # this process took a queued trial
            self._own[trial_id] = None
        elif state.is_finished():
            self._own.pop(trial_id, None)
        return updated

    def flush(self) -> None:
        """Writes the pending params and user attributes, all in one transaction."""
        with self._pending_lock:
            params, self._pending_params = self._pending_params, []
            attrs, self._pending_attrs = self._pending_attrs, {}
            by_trial: dict[int, tuple[list, dict]] = {}
            for trial_id, *param in params:
                by_trial.setdefault(trial_id, ([], {}))[0].append(param)
            for (trial_id, key), value in attrs.items():
                by_trial.setdefault(trial_id, ([], {}))[1][key] = value
            if by_trial:
                with _create_scoped_session(self.scoped_session, True) as session:
                    for trial_id, (trial_params, trial_attrs) in by_trial.items():
                        self._write_trial(session, trial_id, trial_params, trial_attrs)

    def _write_trial(self, session: sqlalchemy.orm.Session, trial_id: int, params: list, attrs: dict) -> None:
        """The checks of Optuna's `_set_trial_param_without_commit`, made once per trial instead of per param
        (the trial is still running; each param's distribution is compatible with the study's), then one
        executemany for the params and one upsert for the attributes."""
        trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
        self.check_trial_is_updatable(trial_id, trial.state)
        if params:   # into the table, not the ORM class: a plain executemany, not SQLAlchemy's ORM bulk insert
            session.execute(sqlalchemy.insert(models.TrialParamModel.__table__),
                            self._param_rows(session, trial, params))
        insert = _UPSERTS.get(self.engine.name)
        if attrs and insert is None:   # another database Optuna supports: its own upsert, one per attribute
            for key, value in attrs.items():
                self._set_trial_attr_without_commit(session, models.TrialUserAttributeModel, trial_id, key, value)
        elif attrs:
            rows = [{"trial_id": trial_id, "key": key, "value_json": json.dumps(value)} for key, value in attrs.items()]
            upsert = insert(models.TrialUserAttributeModel)
            session.execute(upsert.on_conflict_do_update(index_elements=["trial_id", "key"],
                                                         set_={"value_json": upsert.excluded.value_json}), rows)

    @staticmethod
    def _param_rows(session: sqlalchemy.orm.Session, trial: models.TrialModel, params: list) -> list[dict]:
        unknown = [name for name, _, _, previous in params if previous is None]
        stored = dict(session.query(models.TrialParamModel.param_name,
                                    sqlalchemy.func.min(models.TrialParamModel.distribution_json))
                      .join(models.TrialModel).filter(models.TrialModel.study_id == trial.study_id)
                      .filter(models.TrialParamModel.param_name.in_(unknown))
                      .group_by(models.TrialParamModel.param_name).all()) if unknown else {}
        rows = []
        for name, value, distribution, previous in params:
            text = _json(distribution)
            if previous is None and name in stored:
                previous = _distribution(stored[name])
            if previous is not None and _json(previous) != text:   # equal ones are compatible
                check_distribution_compatibility(previous, distribution)
            rows.append({"trial_id": trial.trial_id, "param_name": name, "param_value": value,
                         "distribution_json": text})
        return rows

    def trials_with_user_attr(self, study_id: int, key: str, value: Any) -> dict[int, TrialState]:
        """{number: state} of the study's trials whose user attribute `key` is `value`: one query, no trial read."""
        with _create_scoped_session(self.scoped_session) as session:
            rows = session.execute(
                sqlalchemy.select(models.TrialModel.number, models.TrialModel.state)
                .join(models.TrialUserAttributeModel)
                .where(models.TrialModel.study_id == study_id, models.TrialUserAttributeModel.key == key,
                       models.TrialUserAttributeModel.value_json == json.dumps(value))).all()
        return dict(rows)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        """Optuna's, with the params read as plain rows (building 500 ORM objects per read of a running trial
        cost more than the rest of the read); a trial this process runs is read from what it wrote, with the
        state from the database: another process may have failed it."""
        with _create_scoped_session(self.scoped_session) as session:
            trial = models.TrialModel.find_or_raise_by_id(trial_id, session)
            own = self._own.get(trial_id)
            if own is not None and trial.state == TrialState.RUNNING:
                return own.frozen(trial)
            params = session.execute(sqlalchemy.select(*_PARAM_COLUMNS)
                                     .where(models.TrialParamModel.trial_id == trial_id)
                                     .order_by(models.TrialParamModel.param_id)).all()
            frozen = self._frozen_trial(trial, params)
        if trial_id in self._own:
            if frozen.state == TrialState.RUNNING:
                self._own[trial_id] = _OwnRunningTrial.of(frozen)
            else:
                del self._own[trial_id]
        return frozen

    def _get_trials(self, study_id: int, states: Container[TrialState] | None, included_trial_ids: set[int],
                    trial_id_greater_than: int) -> list[FrozenTrial]:
        """Optuna's read of a study's trials (those in `states`; with `trial_id_greater_than` > -1, only those
        newer than it or among `included_trial_ids`), with the params read as plain rows, as in `get_trial`."""
        included = [trial_id for trial_id in included_trial_ids if trial_id <= trial_id_greater_than]
        where = [models.TrialModel.study_id == study_id]
        if states is not None:
            where.append(models.TrialModel.state.in_(list(states)))
        if trial_id_greater_than > -1:
            newer = models.TrialModel.trial_id > trial_id_greater_than
            where.append(sqlalchemy.or_(models.TrialModel.trial_id.in_(included), newer) if included else newer)
        with _create_scoped_session(self.scoped_session) as session:
            models.StudyModel.find_or_raise_by_id(study_id, session)
            relations = (sqlalchemy.orm.selectinload(getattr(models.TrialModel, name)) for name in _TRIAL_RELATIONS)
            trials = (session.query(models.TrialModel).options(*relations)
                      .filter(*where).order_by(models.TrialModel.trial_id).all())
            params: dict[int, list] = {}
            if trials:
                for trial_id, *row in session.execute(
                        sqlalchemy.select(models.TrialParamModel.trial_id, *_PARAM_COLUMNS)
                        .join(models.TrialModel).where(*where).order_by(models.TrialParamModel.param_id)):
                    params.setdefault(trial_id, []).append(row)
            return [self._frozen_trial(trial, params.get(trial.trial_id, [])) for trial in trials]

    @staticmethod
    def _frozen_trial(trial: models.TrialModel, params: list[tuple[str, float, str]]) -> FrozenTrial:
        """Optuna's build of a trial read back, with each distinct distribution parsed once: Optuna parses every
        param's JSON twice per read, most of the time it takes to build a trial of 500 params."""
        values = None
        if trial.values:
            values = [0.0] * len(trial.values)
            for value in trial.values:
                values[value.objective] = models.TrialValueModel.stored_repr_to_value(value.value, value.value_type)
        return FrozenTrial(
            number=trial.number, state=trial.state, value=None, values=values,
            datetime_start=trial.datetime_start, datetime_complete=trial.datetime_complete,
            params={name: _distribution(dist).to_external_repr(value) for name, value, dist in params},
            distributions={name: _distribution(dist) for name, _, dist in params},
            user_attrs={attr.key: json.loads(attr.value_json) for attr in trial.user_attributes},
            system_attrs={attr.key: json.loads(attr.value_json) for attr in trial.system_attributes},
            intermediate_values={v.step: models.TrialIntermediateValueModel.stored_repr_to_intermediate_value(
                v.intermediate_value, v.intermediate_value_type) for v in trial.intermediate_values},
            trial_id=trial.trial_id)

    def __getstate__(self) -> dict[Any, Any]:
        self.flush()
        state = super().__getstate__()
        state.pop("_pending_lock", None)
        state["_own"] = {}    # another process runs none of this one's trials
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._pending_lock = threading.Lock()


_PARAM_COLUMNS = (models.TrialParamModel.param_name, models.TrialParamModel.param_value,
                  models.TrialParamModel.distribution_json)
_TRIAL_RELATIONS = ("values", "user_attributes", "system_attributes", "intermediate_values")  # backrefs: by name
# Upserts by dialect: the databases the tuner documents (SQLite by default, PostgreSQL for several machines);
# any other falls back to Optuna's write per attribute.
_UPSERTS = {"sqlite": sqlalchemy.dialects.sqlite.insert, "postgresql": sqlalchemy.dialects.postgresql.insert}


@functools.lru_cache(maxsize=1024)
def _distribution(distribution_json: str) -> BaseDistribution:
    return json_to_distribution(distribution_json)   # shared between trials: distributions are never changed


_JSON_OF: dict[tuple[type, str], str] = {}


def _json(distribution: BaseDistribution) -> str:
    """`distribution_to_json`, remembered by the repr of the distribution's attributes (which, unlike equality,
    tells 1, 1.0 and True apart): each suggest makes a new distribution object, and JSON-encoding or comparing
    two categorical ones costs several times this lookup."""
    key = (type(distribution), repr(tuple(distribution.__dict__.items())))
    if key not in _JSON_OF:
        if len(_JSON_OF) >= 4096:
            _JSON_OF.clear()
        _JSON_OF[key] = distribution_to_json(distribution)
    return _JSON_OF[key]


def _flushing_first(method):
    def wrapper(self, *args, **kwargs):
        self.flush()
        return method(self, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__ = method.__name__, method.__doc__
    return wrapper


# Every RDBStorage method that writes a trial or reads trials back sees the pending writes first.
for _name in ("_create_new_trial", "create_new_trial", "set_trial_state_values", "set_trial_intermediate_value",
              "set_trial_system_attr", "get_trial", "get_trial_param", "get_trial_params", "get_trial_user_attrs",
              "get_trial_system_attrs", "_get_trials", "trials_with_user_attr", "get_all_trials", "get_n_trials",
              "get_best_trial", "_get_best_trial_id", "_get_stale_trial_ids", "get_trial_id_from_study_id_trial_number",
              "delete_study", "remove_session"):
    setattr(WriteBatchingStorage, _name, _flushing_first(getattr(WriteBatchingStorage, _name)))


def sqlite_path(url: str) -> Path | None:
    """The database file of an `sqlite:///` URL, None for other storages."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_storage(url: str, heartbeat_interval: int = 10, grace_period: int = 30) -> WriteBatchingStorage:
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
        storage = WriteBatchingStorage(
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
