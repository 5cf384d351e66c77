"""Time limits: on the user's eval_fn per trial, and on the tuner's own long steps (compiling a finalist).

In the main thread SIGALRM interrupts the call (Python code and between torch ops; one long native kernel
finishes first). Elsewhere an eval_fn call runs in a daemon thread that is abandoned when time is up: its result is
never used, and the model it holds is a private copy; the tuner's own steps are not limited there.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from autotune.errors import EvalTimeoutError


def can_interrupt() -> bool:
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextmanager
def interrupted_after(seconds: float, error: Callable[[], BaseException]) -> Iterator[None]:
    """Raises `error()` in the block once it has run `seconds` (in the main thread; elsewhere it runs unlimited)."""
    if not can_interrupt():
        yield
        return

    def on_alarm(signum, frame):
        raise error()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def said_while_running(every_s: float, say: Callable[[float], None]) -> Iterator[None]:
    """Calls `say(seconds so far)` every `every_s` while the block runs, from a daemon thread: a long step that
    prints nothing of its own (a compile of minutes) is told from a hang."""
    stop, started = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every_s):
            say(time.monotonic() - started)

    threading.Thread(target=beat, name="autotune-progress", daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def call_with_timeout(fn: Callable[[Any], Any], arg: Any, seconds: float | None) -> Any:
    if seconds is None:
        return fn(arg)
    message = f"eval_fn ran past the per-trial timeout of {seconds:g} s"
    if can_interrupt():
        with interrupted_after(seconds, lambda: EvalTimeoutError(message)):
            return fn(arg)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(arg)
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="autotune-eval", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise EvalTimeoutError(message)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
