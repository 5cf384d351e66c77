"""Optuna's RDB storage as the tuner opens it: heartbeats for running trials, and SQLite set up for several
local workers. Any RDB URL Optuna accepts works (PostgreSQL for several machines)."""
from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from autotune.errors import UNENCODED_AT, StorageError, describe, masked, unencoded_at

log = logging.getLogger("autotune")
SCHEMA_ATTEMPTS = 5
MOST_WAIT_S = 10.0    # longest pause between looks at a database that does not answer
# What SQLAlchemy raises where the database connection fails, as opposed to what was asked of it (IntegrityError..)
CONNECTION_ERRORS = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)
# Optuna's own hint puts the URL, password and all, on a command line that `ps` shows: this reads it from the
# variable the CLI reads it from.
UPGRADE_COMMAND = ("""python -c "import os, optuna; optuna.storages.RDBStorage(os.environ['AUTOTUNE_STORAGE'], """
                   """skip_compatibility_check=True).upgrade()" (with AUTOTUNE_STORAGE set to its URL)""")


def shown(url: str) -> str:
    """`url` as messages show it: with its password masked."""
    if unencoded_at(url):   # parsed, it would show the password's part after its "@" as the host
        return masked(url)
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):   # ValueError: a port that is no number
        return masked(url)


def sqlite_path(url: str) -> Path | None:
    """The database file of an `sqlite:///` URL, None for other storages."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


@contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turns what the database layer raises for `url` into a StorageError saying what is wrong, in one line."""
    try:
        yield
    except (sqlalchemy.exc.ArgumentError, NotAPort):
        raise StorageError(f"cannot parse the storage URL {shown(url)!r}; expected e.g. sqlite:///studies/autotune.db "
                           "or postgresql+psycopg://user:password@host/database") from None
    except ImportError as exc:
        raise StorageError(f"no database driver for the storage URL {shown(url)!r} is installed ({exc}); for "
                           "PostgreSQL: pip install 'psycopg[binary]'") from None
    except RuntimeError as exc:   # Optuna's check of its tables' version: the one error it raises as a RuntimeError
        if "compatible with the table schema" not in str(exc):
            raise
        raise StorageError(f"cannot use the study storage {shown(url)}: {exc}".replace(
            "`$ optuna storage upgrade --storage $STORAGE_URL`", UPGRADE_COMMAND)) from None
    except sqlalchemy.exc.DBAPIError as exc:
        reason = database_says(exc)
        path = sqlite_path(url)
        kept = "; the file was left as it is" if path is not None and path.exists() else ""
        hint = UNENCODED_AT if unencoded_at(url) else _read_only(path) if path is not None else ""
        raise StorageError(f"cannot use the study storage {shown(url)}: {reason}{kept}{hint}") from None


READ_ONLY_SQLITE = ("SQLite writes beside the file even to read it: copy the folder somewhere writable and name "
                    "that copy's file")


def _read_only(path: Path) -> str:
    """Why SQLite failed where the file's folder, or the file, cannot be written (a read-only share or mount):
    in WAL mode it writes beside the file to read it too."""
    blocked = [p for p in (path.parent, path) if p.exists() and not os.access(p, os.W_OK)]
    if not blocked:
        return ""
    return f"; {blocked[0]} cannot be written here (read-only), and {READ_ONLY_SQLITE}"


def database_error(exc: BaseException) -> sqlalchemy.exc.DBAPIError | None:
    """The database's error behind `exc`, as SQLAlchemy raised it (Optuna's storage raises its own errors from
    it), or None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, sqlalchemy.exc.DBAPIError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def database_says(error: sqlalchemy.exc.DBAPIError) -> str:
    """The database's own message, on one line (without SQLAlchemy's statement and links, nor PostgreSQL's copy of
    a row it refused, which may hold a job's config)."""
    said = str(error.orig).split("DETAIL:  Failing row contains")[0]
    return " ".join(line.strip() for line in said.splitlines()       # less PostgreSQL's quote of the statement
                    if line.strip() and not re.match(r"LINE \d+:|\s*\^\s*$", line))


def cannot_write(error: sqlalchemy.exc.DBAPIError) -> str | None:
    """Where the database refused a write for its file system (a read-only SQLite file or folder, a full disk):
    what to do. None for other errors."""
    said = str(error.orig)
    if "readonly database" in said:
        return READ_ONLY_SQLITE
    if "disk is full" in said or "No space left on device" in said:
        return "free space on its disk, then run the command again (a tuning run resumes from its finished trials)"
    return None


def tables_differ(error: sqlalchemy.exc.DBAPIError) -> bool:
    """Whether the database refused a statement for its tables (a column or table missing or changed by hand), as
    opposed to not answering. SQLite says so with an OperationalError, as it says most things."""
    return not isinstance(error, CONNECTION_ERRORS) or "no such table" in str(error.orig) \
        or "no such column" in str(error.orig)


def reachable(engine: sqlalchemy.engine.Engine) -> bool:
    """Whether the database answers a query now."""
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except sqlalchemy.exc.DBAPIError:
        return False
    return True


def lost_connection(exc: BaseException, engine: sqlalchemy.engine.Engine) -> bool:
    """Whether `exc` came of losing the database rather than of what was asked of it: a connection dropped
    mid-use (a server restart or failover, a network cut), or refused while the database does not answer."""
    error = database_error(exc)
    if not isinstance(error, CONNECTION_ERRORS):
        return False
    return error.connection_invalidated or not reachable(engine)


def wait_until_reachable(engine: sqlalchemy.engine.Engine, why: BaseException) -> None:
    """Returns once the database answers again, looking at it ever less often (up to every MOST_WAIT_S)."""
    error = database_error(why)
    log.warning("the study storage is unreachable (%s): waiting for it; what it holds is kept",
                database_says(error) if error is not None else describe(why))
    started = time.monotonic()
    for pause in _pauses():
        if reachable(engine):
            break
        time.sleep(pause)
    log.warning("the study storage answers again after %.0f s: going on", time.monotonic() - started)


def _pauses() -> Iterator[float]:
    """Seconds between looks at a database that does not answer: ever longer, up to MOST_WAIT_S."""
    pause = 1.0
    while True:
        yield pause
        pause = min(2 * pause, MOST_WAIT_S)


# What a server says where it refuses this client for good; psycopg gives failures to connect no SQLSTATE, so a
# refusal is told from a server not up yet (refused, unresolvable, starting up, closed for a while) by its words.
REFUSED_FOR_GOOD = ("password authentication failed", "does not exist", "pg_hba.conf", "authentication failed")


def not_up_yet(exc: BaseException, url: str) -> bool:
    """Whether `exc` says the server of `url` (not SQLite's file) does not answer yet, as opposed to refusing
    this client for good (a wrong password, no such database or role)."""
    error = database_error(exc)
    if sqlite_path(url) is not None or not isinstance(error, CONNECTION_ERRORS):
        return False
    return not any(words in str(error.orig) for words in REFUSED_FOR_GOOD)


def open_storage_once_up(url: str) -> RDBStorage:
    """open_storage, waiting while the server does not answer yet, as a running worker waits out an outage: a
    service's workers may start before its database (a host's reboot, a compose file without a health check).
    Anything else is raised at once."""
    started = time.monotonic()
    for pause in _pauses():
        try:
            return open_storage(url)
        except StorageError as exc:
            if not not_up_yet(exc, url):
                raise
            if pause == 1.0:
                log.warning("%s: waiting for it", exc)
            elif pause == MOST_WAIT_S:
                log.info("the study storage still does not answer after %.0f s", time.monotonic() - started)
        time.sleep(pause)
    raise AssertionError("_pauses ends only where it is stopped")


class SteadyHeartbeatStorage(RDBStorage):
    """Optuna's RDBStorage whose heartbeats outlast a database that stops answering for a while. Optuna's heartbeat
    thread ends at the first write that fails; the trial it beat for then runs on unseen, and once the database
    answers again the other workers' stale-trial check fails it and queues its plan for a second evaluation
    while its own process is still evaluating it. Here a failed write is logged (once per outage) and the next
    one tried at the next beat.

    With `waits_out_outages` (a service's worker), a running trial's reads and writes wait for a database that
    stopped answering, rather than failing: an eval_fn's finished score is written once it answers again, where it
    had been lost with its trial. The trial's heartbeat is written first, so that the other workers' stale-trial
    check leaves it alone; if that check failed it during the outage, the error is raised as before."""

    _failing = False
    waits_out_outages = False

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._waiting_out_outages(super().set_trial_user_attr, trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._waiting_out_outages(super().set_trial_system_attr, trial_id, key, value)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        return self._waiting_out_outages(super().set_trial_state_values, trial_id, state, values)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._waiting_out_outages(super().get_trial, trial_id, writes=False)

    def _waiting_out_outages(self, call: Callable[..., Any], trial_id: int, *args: Any, writes: bool = True) -> Any:
        while True:
            try:
                return call(trial_id, *args)
            except Exception as exc:
                if not self.waits_out_outages or not lost_connection(exc, self.engine):
                    raise
                wait_until_reachable(self.engine, exc)
                self.record_heartbeat(trial_id)
                if writes and RDBStorage.get_trial(self, trial_id).state.is_finished():
                    raise     # failed meanwhile by a stale-trial check elsewhere (its plan is queued again)

    def record_heartbeat(self, trial_id: int) -> None:
        try:
            super().record_heartbeat(trial_id)
        except Exception as exc:
            error = database_error(exc)
            if not isinstance(error, CONNECTION_ERRORS):
                raise
            if not self._failing:
                log.warning("a running trial's heartbeat could not be written (%s): trying again at the next beat",
                            database_says(error))
            self._failing = True
        else:
            self._failing = False


def open_storage(url: str, heartbeat_interval: int = 10, grace_period: int = 30,
                 waits_out_outages: bool = False) -> RDBStorage:
    """An RDB storage whose running trials beat: a process killed mid-trial stops beating, and after the grace
    period the next run (or another worker) marks its trial FAILED and the retry callback queues the plan again.

    SQLite runs in WAL mode with synchronous=NORMAL, every transaction takes the write lock as it begins, and a
    connection waits up to a minute for that lock instead of failing with "database is locked": several workers
    on one machine share one file safely, each transaction sees the rows it changes as it read them, and a
    commit costs no fsync. A killed process loses nothing committed; only an OS crash or power cut can lose the
    last commits, never corrupt the file.

    Args:
        url: an SQLAlchemy database URL; a missing SQLite file (and its folder) is created.
        heartbeat_interval: seconds between a running trial's heartbeats.
        grace_period: seconds without a heartbeat after which a running trial counts as dead.
        waits_out_outages: a running trial's reads and writes wait for a database that stopped answering
            (SteadyHeartbeatStorage), as a service's worker does; else they raise.
    Returns:
        Optuna's RDBStorage on that database.
    Raises:
        StorageError: the URL does not parse, its driver is missing, or the database cannot be used.
    """
    with storage_errors(url):
        _parsed(url)
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    # A server's connections may be closed under the pool (a restart, a failover, an idle timeout): each is
    # checked as it is taken from the pool, and a dead one replaced, instead of failing the next query.
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    with warnings.catch_warnings(), storage_errors(url):
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                storage = SteadyHeartbeatStorage(
                    url, engine_kwargs=engine_kwargs, heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                    heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3))
                break
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError, sqlalchemy.exc.OperationalError
                    ) as exc:
                # Several processes created the schema of an empty database at once; one of them won (SQLite
                # says so with "table ... already exists", an OperationalError like any other of its failures).
                raced = not isinstance(exc, sqlalchemy.exc.OperationalError) or "already exists" in str(exc.orig)
                if not raced or attempt == SCHEMA_ATTEMPTS - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))
    storage.waits_out_outages = waits_out_outages
    if url.startswith("sqlite"):
        sqlalchemy.event.listen(storage.engine, "connect", _sqlite_wal)
        sqlalchemy.event.listen(storage.engine, "begin", _begin_immediate)
        storage.engine.dispose()   # connections opened while creating the schema lack the pragmas
    return storage


class NotAPort(ValueError):
    """A storage URL's port is no number."""


def _parsed(url: str) -> None:
    """Raises ArgumentError, or NotAPort, where `url` is no database URL; StorageError where it is an in-memory
    SQLite database (`sqlite://`), which keeps nothing, or holds a password with a raw "@"."""
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except ValueError as exc:   # SQLAlchemy's int() of the port ("host:1:2"); its ArgumentError is no ValueError
        raise NotAPort(str(exc)) from None
    if unencoded_at(url):   # refused before connecting: the driver's error would name the password's tail as a host
        raise StorageError(f"cannot use the study storage {shown(url)}{UNENCODED_AT}")
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise StorageError(f"{url!r} is an in-memory SQLite database, which keeps no study: each connection gets "
                           "an empty one of its own; name a file, e.g. sqlite:///studies/autotune.db")
    if (path := sqlite_path(url)) is not None and path.is_dir():
        raise StorageError(f"{url!r} names a folder, not a database file: name a file in it, e.g. "
                           f"sqlite:///{path / 'autotune.db'}")


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
