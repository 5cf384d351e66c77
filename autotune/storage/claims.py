"""Who runs what, kept in the study's own database so it holds across processes and machines: a claim row per
(study, plan) under a unique key, so no two trials evaluate one plan, and leases, so one worker at a time does a
study's one-off work (its fp32 baseline and signals). Both live in tables of their own beside Optuna's, written
with SQLAlchemy Core; nothing in Optuna's schema is touched."""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import sqlalchemy
from optuna.storages import RDBStorage
from optuna.trial import TrialState
from sqlalchemy import Column, Float, Integer, MetaData, String, Table

from autotune.errors import describe

log = logging.getLogger("autotune")

_metadata = MetaData()
plan_claims = Table(
    "autotune_plan_claims", _metadata,
    Column("study_name", String(512), primary_key=True),
    Column("plan_hash", String(64), primary_key=True),   # sha256 of the plan key: keys of big models are long
    Column("trial_number", Integer, nullable=False))
leases = Table(
    "autotune_leases", _metadata,
    Column("study_name", String(512), primary_key=True),
    Column("name", String(64), primary_key=True),
    Column("holder", String(128), nullable=False),
    Column("expires_at", Float, nullable=False))   # seconds since the epoch


def create_tables(engine: sqlalchemy.Engine) -> None:
    """Creates the claim and lease tables if missing; safe when several processes start at once."""
    try:
        _metadata.create_all(engine, checkfirst=True)
    except sqlalchemy.exc.DatabaseError:   # another process created them between the check and the create
        if not set(_metadata.tables) <= set(sqlalchemy.inspect(engine).get_table_names()):
            raise


def forget_study(storage: RDBStorage, study_name: str) -> None:
    """Deletes a study's plan claims and leases (with the study itself): a new study of that name would otherwise
    find its plans claimed by trials of the old one."""
    create_tables(storage.engine)
    with storage.engine.begin() as connection:
        for table in (plan_claims, leases):
            connection.execute(table.delete().where(table.c.study_name == study_name))


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class PlanClaims:
    """The plans claimed in one study, each by one trial (number); the trial's state says whether it lives."""

    def __init__(self, storage: RDBStorage, study_name: str):
        self.storage, self.study_name = storage, study_name
        self.engine = storage.engine
        self.study_id = storage.get_study_id_from_name(study_name)
        create_tables(self.engine)

    def _where(self, key: str) -> list:
        return [plan_claims.c.study_name == self.study_name, plan_claims.c.plan_hash == _hash(key)]

    def claim(self, key: str, trial_number: int) -> int:
        """Claims plan `key` for a trial unless another trial holds it; returns the holder's number."""
        try:
            with self.engine.begin() as connection:
                connection.execute(plan_claims.insert().values(
                    study_name=self.study_name, plan_hash=_hash(key), trial_number=trial_number))
            return trial_number
        except sqlalchemy.exc.IntegrityError:
            holder = self.holder(key)
            return trial_number if holder is None else holder   # None: released in between; the next try takes it

    def holder(self, key: str) -> int | None:
        """The number of the trial holding plan `key`, None if no trial does."""
        with self.engine.connect() as connection:
            return connection.execute(sqlalchemy.select(plan_claims.c.trial_number).where(*self._where(key))
                                      ).scalar_one_or_none()

    def take_over(self, key: str, dead_holder: int, trial_number: int) -> bool:
        """Moves plan `key` from a trial whose process died to `trial_number`; False if someone else did first."""
        with self.engine.begin() as connection:
            moved = connection.execute(plan_claims.update().where(
                *self._where(key), plan_claims.c.trial_number == dead_holder).values(trial_number=trial_number))
            return moved.rowcount == 1

    def state_of(self, trial_number: int) -> TrialState:
        """The state of the trial holding a claim; FAIL where the study has no such trial: a claim left by a study
        of this name deleted outside autotune (optuna-dashboard, `optuna.delete_study`), since a trial exists
        before it claims. A claim left so by a trial number the new study has reads as that trial's, which gives
        the plan up once that trial ends without it."""
        try:
            trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial_number)
        except KeyError:
            return TrialState.FAIL
        return self.storage.get_trial(trial_id).state


@contextmanager
def lease(storage: RDBStorage, study_name: str, name: str, ttl_s: float, poll_s: float = 0.5,
          wait: bool = True) -> Iterator[bool]:
    """Holds lease `name` of a study while the block runs (yielding True): other holders wait, or with `wait=False`
    run the block at once, told False. The holder renews it every third of `ttl_s`; a holder that dies stops
    renewing, and after `ttl_s` the lease is free again."""
    engine = storage.engine
    create_tables(engine)
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    where = [leases.c.study_name == study_name, leases.c.name == name]
    while not _acquire(engine, study_name, name, holder, ttl_s, where):
        if not wait:
            yield False
            return
        time.sleep(poll_s)
    with kept_alive(engine, lambda: leases.update().where(*where, leases.c.holder == holder)
                    .values(expires_at=time.time() + ttl_s), ttl_s / 3, f"lease {name} of study {study_name}"):
        try:
            yield True
        finally:
            with engine.begin() as connection:
                connection.execute(leases.delete().where(*where, leases.c.holder == holder))


@contextmanager
def kept_alive(engine: sqlalchemy.Engine, renewal: Callable[[], sqlalchemy.Executable], every_s: float,
               what: str) -> Iterator[None]:
    """Executes `renewal()` (a row's expiry or last-seen time set to now) every `every_s` in a thread while the
    block runs: a process that dies stops renewing, and its row then lapses."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every_s):
            try:
                with engine.begin() as connection:
                    connection.execute(renewal())
            except sqlalchemy.exc.SQLAlchemyError as exc:   # a locked SQLite file, a dropped connection: next tick
                log.warning("%s: renewing failed (%s); trying again", what, describe(exc))

    renewer = threading.Thread(target=renew, name=f"autotune-renew-{what}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        # Not joined: a renewal waiting on a locked database kept a Ctrl-C'd worker waiting with it, and one that
        # lands after the block updates a row its owner has deleted, which is none.
        stop.set()


def _acquire(engine: sqlalchemy.Engine, study_name: str, name: str, holder: str, ttl_s: float, where: list) -> bool:
    try:
        with engine.begin() as connection:
            connection.execute(leases.insert().values(study_name=study_name, name=name, holder=holder,
                                                      expires_at=time.time() + ttl_s))
        return True
    except sqlalchemy.exc.IntegrityError:
        with engine.begin() as connection:   # an expired lease: its holder died
            taken = connection.execute(leases.update().where(*where, leases.c.expires_at < time.time())
                                       .values(holder=holder, expires_at=time.time() + ttl_s))
            return taken.rowcount == 1


def live_lease(study_name_column: sqlalchemy.ColumnElement, name: str) -> sqlalchemy.Exists:
    """SQL that is true where lease `name` of the study in `study_name_column` is held and not expired."""
    return sqlalchemy.exists().where(leases.c.study_name == study_name_column, leases.c.name == name,
                                     leases.c.expires_at >= time.time())
