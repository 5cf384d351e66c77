"""The command line's shared parts: the group with its one error path, storage options, output checks."""
from __future__ import annotations

import functools
import os
import signal
import sqlite3
import sys
import threading
from contextlib import closing
from pathlib import Path
from typing import Any

import click
import optuna
from optuna.storages import RDBStorage

from autotune.config import DEFAULT_STORAGE
from autotune.errors import AutotuneError
from autotune.interrupts import SIGNALS, interrupts, library_errors_hidden_once_interrupted
from autotune.storage.rdb import (
    cannot_write,
    database_error,
    database_says,
    open_storage,
    shown,
    sqlite_path,
    tables_differ,
)


def resolve_storage(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str:
    """--storage, else $AUTOTUNE_STORAGE (click reads it), else the URL in the file $AUTOTUNE_STORAGE_FILE names,
    else the default: a password need never appear on a command line."""
    if value:
        return value
    if os.environ.get("AUTOTUNE_STORAGE_FILE"):
        return _url_in_file(Path(os.environ["AUTOTUNE_STORAGE_FILE"]))
    return DEFAULT_STORAGE


def _url_in_file(path: Path) -> str:
    """The one line of `path` that is neither blank nor a `#` comment."""
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except OSError as exc:
        raise CliError(f"AUTOTUNE_STORAGE_FILE names {path}, which cannot be read: {exc.strerror}") from None
    urls = [line for line in lines if line and not line.startswith("#")]
    if len(urls) != 1:
        raise CliError(f"AUTOTUNE_STORAGE_FILE names {path}, which holds {len(urls)} lines besides blank and `#` "
                       "ones; it should hold the storage URL alone")
    return urls[0]


storage_option = click.option("--storage", envvar="AUTOTUNE_STORAGE", default=None, callback=resolve_storage,
                              help=f"Optuna storage URL [default: $AUTOTUNE_STORAGE, the URL in the file "
                                   f"$AUTOTUNE_STORAGE_FILE names, else {DEFAULT_STORAGE}]")


INPUT_ERROR, UNEXPECTED = 2, 1     # exit codes (README, "YAML files and the CLI"); interrupts has the others
BROKEN_PIPE = 141   # 128 + SIGPIPE, as a shell reports a filter its reader left


class CliError(click.ClickException):
    exit_code = INPUT_ERROR


class _Group(click.Group):
    """One error path for every command: a failure the user can cause is one `Error: ...` line and exit code 2,
    Ctrl-C one line and 130 (SIGTERM 143), anything else one line and 1; a traceback only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        interrupts.received = interrupts.said = False
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {number: signal.signal(number, interrupts.handle) for number in SIGNALS} if main_thread else {}
        previous_hook, sys.unraisablehook = sys.unraisablehook, functools.partial(interrupts.unraisable,
                                                                                 sys.unraisablehook)
        try:
            with library_errors_hidden_once_interrupted():   # what a Ctrl-C breaks in them is logged in the command
                result = super().invoke(ctx)
            interrupts.stop_if_received()
            return result
        except click.exceptions.Exit:
            raise
        except (click.ClickException, click.exceptions.Abort):
            raise
        except BrokenPipeError:   # the reader went away (`autotune show ... | head`): as any filter, stop quietly
            # Python flushes stdout again at exit, which would fail once more: point it where writing cannot.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(BROKEN_PIPE)
        except Exception as exc:
            if ctx.params.get("debug"):
                raise
            if interrupts.received:    # what the Ctrl-C broke on its way (optuna's trial clean-up: UnboundLocalError)
                _interrupted(ctx)
            raise _as_cli_error(exc) from None
        except KeyboardInterrupt:
            if ctx.params.get("debug"):
                raise
            _interrupted(ctx)
        finally:
            interrupts.disarm()
            sys.unraisablehook = previous_hook
            for number, handler in previous.items():
                signal.signal(number, handler)


def _interrupted(ctx: click.Context) -> None:
    interrupts.say()
    ctx.exit(interrupts.exit_code)


RECORD_GONE = "Record does not exist."   # what Optuna's RDBStorage raises (KeyError) of a study or trial deleted


def _as_cli_error(exc: Exception) -> click.ClickException:
    if isinstance(exc, AutotuneError):
        return CliError(str(exc))
    if (error := database_error(exc)) is not None and tables_differ(error):   # SQLAlchemy's, or Optuna's from it
        return CliError(f"the study storage refused a statement: {database_says(error)}; where its tables were "
                        "changed by hand or by another version, they no longer match what this one writes")
    if error is not None and (what_to_do := cannot_write(error)):
        return CliError(f"the study storage cannot be written: {database_says(error)}; {what_to_do}")
    if error is not None:
        return CliError(f"the study storage failed: {database_says(error)}; once it answers, run the command "
                        "again (a tuning run resumes from its finished trials)")
    if isinstance(exc, OSError) and exc.filename:
        return CliError(f"cannot write or read {exc.filename}: {exc.strerror}")
    if isinstance(exc, KeyError) and exc.args == (RECORD_GONE,):
        return CliError("the study's records are gone from its storage: it was deleted while this command ran "
                        "(`autotune delete`, optuna-dashboard); run the command again to start it afresh")
    error = click.ClickException(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)")
    error.exit_code = UNEXPECTED
    return error


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="show the traceback of an error instead of one line")
def main(debug: bool) -> None:
    """Accuracy-driven mixed-precision autotuning for PyTorch."""
    # A config names its model and eval_fn by import path: modules beside it in the working directory import,
    # as they do with `python -m autotune`.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    optuna.logging.set_verbosity(optuna.logging.ERROR)   # the tuner logs failed trials itself, in one line


def writable(out: str) -> str:
    """`out`, once its folder is known to exist and be writable: checked before any work starts."""
    folder = Path(out).resolve().parent
    if not folder.is_dir():
        raise CliError(f"cannot write {out}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise CliError(f"cannot write {out}: the folder {folder} is not writable")
    return out


def load_study(name: str, storage: str, rdb: RDBStorage | None = None) -> optuna.Study:
    """Study `name` in the storage at URL `storage` (opened as `rdb` already, where given)."""
    try:
        return optuna.load_study(study_name=name, storage=rdb or open_existing_storage(storage))
    except KeyError:
        raise CliError(f"no study named {name!r} in {shown(storage)}; `autotune list` with the same storage "
                       "lists the studies there") from None


def missing_sqlite(url: str) -> bool:
    path = sqlite_path(url)
    return path is not None and not path.exists()     # a folder: open_storage says what to name instead


def open_existing_storage(url: str):
    # open_storage creates a missing SQLite file; reading commands must not leave an empty one behind.
    if missing_sqlite(url):
        raise CliError(f"no study storage at {shown(url)}: nothing was tuned or submitted there yet (`autotune tune "
                       "CONFIG` or `autotune submit CONFIG` makes it); --storage, or AUTOTUNE_STORAGE, names another")
    if _foreign_sqlite(url):   # opening it would add Optuna's tables and switch it to WAL for good
        raise CliError(f"{shown(url)} is an SQLite database that holds no study storage (no Optuna tables): it was "
                       "left as it is; --storage, or AUTOTUNE_STORAGE, names another")
    return open_storage(url)


def _foreign_sqlite(url: str) -> bool:
    """Whether `url` names an SQLite database file without Optuna's tables (another application's), read only. A
    file that is no database is not: open_storage says so, as it does of any."""
    path = sqlite_path(url)
    if path is None or not path.is_file():
        return False
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as connection:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError:
        return False
    return bool(tables) and "studies" not in tables    # an empty one: a run that died before writing its tables


