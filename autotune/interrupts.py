"""What a Ctrl-C (or a SIGTERM: `docker stop`, a scheduler ending a job) does to an `autotune` command: it stops
the command, keeps every finished trial, and says so in one line, once, from the process the user started (the
helper processes of `tune --workers N` say nothing); the exit code is 128 + the signal's number.

- Before a command's own handler is installed (the command line imports torch first: seconds on a busy host) and
  after it is given back, `stop_at_once` ends the process: there is nothing to keep then, and Python's own
  handler printed a traceback through whatever it broke.
- While a command runs, `Interrupts.handle` raises KeyboardInterrupt so its clean-up runs (a trial marked as
  stopped, leases given back), and arms a deadline: a clean-up still running CLEAN_UP_S later is cut short.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

INTERRUPTED = 130     # 128 + SIGINT, as a shell reports a process a Ctrl-C ended
STOPPED = 143         # 128 + SIGTERM
INTERRUPTED_LINE = "Error: interrupted; every finished trial is kept: run the same command again to resume"
STOPPED_LINE = "Error: stopped by SIGTERM; every finished trial is kept: run the same command again to resume"
SIGNALS = (signal.SIGINT, signal.SIGTERM)
HELPER_FLAG = "--as-helper"    # `tune`'s hidden flag for the processes `--workers` starts: their starter speaks
CLEAN_UP_S = 20      # after a Ctrl-C, the longest its clean-up may take before the process ends without it


class Interrupts:
    """Ctrl-C raises KeyboardInterrupt, as Python's own handler does, and is remembered: Python drops an exception
    raised in a finalizer or a weakref callback (printing its traceback), and a tune whose Ctrl-C landed in one
    (while the interpreter collected compiled code) ran on to the end and exited 0. `stop_if_received` raises it
    again at a safe point; `unraisable` keeps the dropped one's traceback from the user."""

    def __init__(self) -> None:
        self.received = False
        self.said = False
        self.signum = signal.SIGINT
        self.deadline: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        return STOPPED if self.signum == signal.SIGTERM else INTERRUPTED

    def handle(self, signum: int, _frame: Any) -> None:
        if not self.received:
            self.signum = signum
            self._arm_deadline()
        self.received = True
        raise KeyboardInterrupt

    def _arm_deadline(self) -> None:
        """`tune --workers 3` on SQLite once took over two minutes to stop after a Ctrl-C (a lease's renewal waited
        out SQLite's 60 s lock timeout, and more of the clean-up writes to the study), where a user presses Ctrl-C
        to stop now. What is committed stays; a trial left running fails when the study resumes, as one of a
        killed run does."""
        def end_now() -> None:
            what = "SIGTERM" if self.signum == signal.SIGTERM else "Ctrl-C"
            self.say(f"the clean-up after {what} ran past {CLEAN_UP_S} s and was cut short: a trial it left running "
                     "fails when the study resumes", raw=True)
            os._exit(self.exit_code)

        self.deadline = threading.Timer(CLEAN_UP_S, end_now)
        self.deadline.daemon = True
        self.deadline.start()

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def unraisable(self, previous_hook: Callable[[Any], None], unraisable: Any) -> None:
        """A `sys.unraisablehook`: a dropped KeyboardInterrupt is a Ctrl-C received; anything else goes on."""
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self.received = True
        else:
            previous_hook(unraisable)

    def stop_if_received(self, *_trial: Any) -> None:
        """Raises KeyboardInterrupt if Ctrl-C came; an Optuna trial callback (called after every trial) too."""
        if self.received:
            raise KeyboardInterrupt

    def say(self, *notes: str, raw: bool = False) -> None:
        """Writes `notes` and the interrupted line to stderr, unless said already or in a helper process. `raw`
        writes to the file descriptor, taking no lock a thread stuck in its clean-up may hold."""
        if self.said or HELPER_FLAG in sys.argv[1:]:
            return
        self.said = True
        text = "".join(f"{line}\n" for line in (*notes, STOPPED_LINE if self.signum == signal.SIGTERM
                                                   else INTERRUPTED_LINE))
        if raw:
            os.write(sys.stderr.fileno(), text.encode())
        else:
            sys.stderr.write(text)
            sys.stderr.flush()


interrupts = Interrupts()


@contextmanager
def library_errors_hidden_once_interrupted() -> Iterator[None]:
    """SQLAlchemy closes a connection whose query a KeyboardInterrupt broke, then fails to close its cursor and logs
    that with a traceback: `tune --workers 3` printed it above its one interrupted line. Within this, SQLAlchemy's
    error logs reach stderr as before, as Python's last-resort handler writes them, until a Ctrl-C comes."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.addFilter(lambda _record: not interrupts.received)
    logger = logging.getLogger("sqlalchemy")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def stop_at_once(signum: int, _frame: Any) -> None:
    """A handler for a process with nothing to clean up: it says the line and exits."""
    try:
        sys.stdout.flush()     # a summary printed into a pipe, not yet written
    except Exception:  # the interrupted code was writing it: nothing more to save
        pass
    if not interrupts.said:
        interrupts.signum = signum
    interrupts.say(raw=True)
    os._exit(interrupts.exit_code)


def install() -> None:
    for number in SIGNALS:
        signal.signal(number, stop_at_once)
