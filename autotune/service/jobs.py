"""Tuning jobs, queued in a table of the study database: the YAML text of a config, who submitted it and when, a
priority, and a state (queued, running, finishing, done, failed, cancelled) with its reason.

A plain table rather than a queue library: workers take jobs with `SELECT ... FOR UPDATE SKIP LOCKED` on
PostgreSQL (SQLite takes the write lock as every transaction begins, which serialises them just as well), and
the rows stay beside the studies they produce, readable by `autotune jobs` and any SQL client.
"""
from __future__ import annotations

import datetime
import getpass
import json
import os
import socket
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy
from optuna.storages import RDBStorage
from sqlalchemy import Column, DateTime, Float, Integer, MetaData, String, Table, Text

from autotune.config.file import read_yaml
from autotune.errors import AutotuneError, ConfigError
from autotune.storage.claims import create_tables, kept_alive, live_lease

QUEUED, RUNNING, FINISHING, DONE, FAILED, CANCELLED = "queued", "running", "finishing", "done", "failed", "cancelled"
OPEN = (QUEUED, RUNNING, FINISHING)     # not ended: a user may cancel it
FINISH_LEASE = "finish"   # held by the one worker that verifies a finishing job's winner

_metadata = MetaData()
jobs_table = Table(
    "autotune_jobs", _metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("config_yaml", Text, nullable=False),
    Column("config_dir", Text, nullable=False),      # relative dataset paths of the config are read from here
    Column("config_name", String(512), nullable=False),
    Column("priority", Integer, nullable=False, default=0),
    Column("state", String(16), nullable=False, default=QUEUED),
    Column("reason", Text),
    Column("study_name", String(512)),
    Column("submitted_by", String(256), nullable=False),
    Column("submitted_at", DateTime, nullable=False),
    Column("finished_at", DateTime))


workers_table = Table(      # the workers serving the queue, each kept alive by its own renewals
    "autotune_workers", _metadata,
    Column("id", String(128), primary_key=True),       # host:pid:random
    Column("allow", Text, nullable=False),             # its --allow patterns, as JSON
    Column("job_id", Integer),                         # the job it works on, if any
    Column("seen_at", Float, nullable=False))          # seconds since the epoch
WORKER_TTL_S = 30.0     # a worker not seen for this long has died


class JobError(AutotuneError):
    """A job that does not exist, or cannot be moved to the state asked for."""


@dataclass(frozen=True)
class LiveWorker:
    id: str
    allow: tuple[str, ...]
    job_id: int | None


@dataclass(frozen=True)
class Job:
    id: int
    config_yaml: str
    config_dir: str
    config_name: str
    priority: int
    state: str
    reason: str | None
    study_name: str | None
    submitted_by: str
    submitted_at: datetime.datetime
    finished_at: datetime.datetime | None
    found: str = ""    # the state `take` found it in (it marks a queued job running)


def _now() -> datetime.datetime:
    """UTC, kept without a zone: workers and submitters in several time zones write one clock."""
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def _names_study(job: Job, study_name: str) -> bool:
    if job.study_name is not None:
        return job.study_name == study_name
    try:
        tuning = read_yaml(job.config_yaml, f"job {job.id}").get("tuning")
    except ConfigError:    # fails as its worker reads it
        return False
    return isinstance(tuning, dict) and tuning.get("study_name") == study_name


class JobQueue:
    """The jobs of one database, through the engine of its Optuna storage."""

    def __init__(self, storage: RDBStorage):
        self.engine = storage.engine
        create_tables(self.engine)     # take() reads the leases
        try:
            _metadata.create_all(self.engine, checkfirst=True)
        except sqlalchemy.exc.DatabaseError:   # another process created it between the check and the create
            if not set(_metadata.tables) <= set(sqlalchemy.inspect(self.engine).get_table_names()):
                raise

    def submit(self, config_yaml: str, config_dir: str, config_name: str, priority: int = 0) -> int:
        """Queues a job; returns its id."""
        row = dict(config_yaml=config_yaml, config_dir=config_dir, config_name=config_name, priority=priority,
                   state=QUEUED, submitted_by=f"{getpass.getuser()}@{socket.gethostname()}", submitted_at=_now())
        with self.engine.begin() as connection:
            return connection.execute(jobs_table.insert().values(**row)).inserted_primary_key[0]

    def take(self, leaving: Collection[int] = ()) -> Job | None:
        """The job of highest priority (oldest first) that needs a worker, marked running if it was queued; None
        when no job does. A running job is shared: a worker joins it while its study has budget left. A finishing
        job needs one only where its finisher died (its lease expired). The jobs in `leaving` are not taken."""
        order = (jobs_table.c.priority.desc(), jobs_table.c.id)
        wanted = sqlalchemy.or_(jobs_table.c.state.in_((QUEUED, RUNNING)), sqlalchemy.and_(
            jobs_table.c.state == FINISHING, ~live_lease(jobs_table.c.study_name, FINISH_LEASE)))
        if leaving:
            wanted = sqlalchemy.and_(wanted, jobs_table.c.id.not_in(list(leaving)))
        with self.engine.begin() as connection:
            row = connection.execute(
                sqlalchemy.select(jobs_table).where(wanted).order_by(*order).limit(1)
                .with_for_update(skip_locked=True)).mappings().first()
            if row is None:
                return None
            if row["state"] == QUEUED:
                connection.execute(jobs_table.update().where(jobs_table.c.id == row["id"])
                                   .values(state=RUNNING, reason=None))   # a refusal it waited after is past
        return Job(**{**row, "state": RUNNING if row["state"] == QUEUED else row["state"]}, found=row["state"])

    def requeue(self, job_id: int, reason: str) -> None:
        """Puts back a job `take` marked running, where no worker has run any of it (it names no study yet), with
        why it waits."""
        with self.engine.begin() as connection:
            connection.execute(jobs_table.update().where(jobs_table.c.id == job_id, jobs_table.c.state == RUNNING,
                                                         jobs_table.c.study_name.is_(None))
                               .values(state=QUEUED, reason=reason[:2000]))

    @contextmanager
    def serving(self, allow: tuple[str, ...]) -> Iterator[str]:
        """Lists this process among the queue's live workers, with its `allow` patterns, while the block runs;
        yields its id."""
        worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        with self.engine.begin() as connection:   # and forgets those long dead (killed: they left no word)
            connection.execute(workers_table.delete().where(workers_table.c.seen_at < time.time() - 10 * WORKER_TTL_S))
            connection.execute(workers_table.insert().values(id=worker_id, allow=json.dumps(allow),
                                                             seen_at=time.time()))
        mine = workers_table.c.id == worker_id
        try:
            with kept_alive(self.engine, lambda: workers_table.update().where(mine).values(seen_at=time.time()),
                            WORKER_TTL_S / 3, f"worker {worker_id}"):
                yield worker_id
        finally:
            with self.engine.begin() as connection:
                connection.execute(workers_table.delete().where(mine))

    def live_workers(self) -> list[LiveWorker]:
        with self.engine.connect() as connection:
            rows = connection.execute(sqlalchemy.select(workers_table).where(
                workers_table.c.seen_at >= time.time() - WORKER_TTL_S).order_by(workers_table.c.id)).mappings().all()
        return [LiveWorker(row["id"], tuple(json.loads(row["allow"])), row["job_id"]) for row in rows]

    def working_on(self, worker_id: str, job_id: int | None) -> None:
        with self.engine.begin() as connection:
            connection.execute(workers_table.update().where(workers_table.c.id == worker_id).values(job_id=job_id))

    def get(self, job_id: int) -> Job:
        with self.engine.connect() as connection:
            row = connection.execute(sqlalchemy.select(jobs_table).where(jobs_table.c.id == job_id)).mappings().first()
        if row is None:
            raise JobError(f"no job {job_id} in this storage; `autotune jobs` lists them")
        return Job(**row)

    def all(self) -> list[Job]:
        with self.engine.connect() as connection:
            rows = connection.execute(sqlalchemy.select(jobs_table).order_by(jobs_table.c.id)).mappings().all()
        return [Job(**row) for row in rows]

    def of_study(self, study_name: str, states: tuple[str, ...]) -> list[Job]:
        """The jobs in `states` that tune `study_name`, oldest first: by the study a worker set on them, or, for
        a job no worker has read yet, by its YAML's (one whose YAML cannot be read names no study)."""
        with self.engine.connect() as connection:
            rows = connection.execute(sqlalchemy.select(jobs_table).where(jobs_table.c.state.in_(states))
                                      .order_by(jobs_table.c.id)).mappings().all()
        return [job for job in (Job(**row) for row in rows) if _names_study(job, study_name)]

    def set_study(self, job_id: int, study_name: str) -> None:
        with self.engine.begin() as connection:
            connection.execute(jobs_table.update().where(jobs_table.c.id == job_id).values(study_name=study_name))

    def finishing(self, job_id: int) -> None:
        """Marks a running job as past its search: new workers go to other jobs."""
        with self.engine.begin() as connection:
            connection.execute(jobs_table.update().where(jobs_table.c.id == job_id, jobs_table.c.state == RUNNING)
                               .values(state=FINISHING))

    def end(self, job_id: int, state: str, reason: str | None = None) -> bool:
        """Moves an open job to `state` (done, failed or cancelled); False if it had ended already."""
        with self.engine.begin() as connection:
            moved = connection.execute(
                jobs_table.update().where(jobs_table.c.id == job_id, jobs_table.c.state.in_(OPEN))
                .values(state=state, reason=reason and reason[:2000], finished_at=_now()))
            return moved.rowcount == 1

    def cancel(self, job_id: int) -> None:
        """Cancels an open job: a queued one never runs, workers on a running one stop after their trial.

        Raises:
            JobError: no such job, or it has ended already.
        """
        job = self.get(job_id)
        if not self.end(job_id, CANCELLED, "cancelled by the user"):
            raise JobError(f"job {job_id} is {job.state} already; only queued, running or finishing jobs can be"
                           " cancelled")
