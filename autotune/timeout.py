"""A per-trial time limit on the user's eval_fn.

In the main thread SIGALRM interrupts the call (Python code and between torch ops; one long native kernel
finishes first). Elsewhere the call runs in a daemon thread that is abandoned when time is up: its result is
never used, and the model it holds is a private copy.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from autotune.errors import EvalTimeoutError


def call_with_timeout(fn: Callable[[Any], Any], arg: Any, seconds: float | None) -> Any:
    if seconds is None:
        return fn(arg)
    message = f"eval_fn ran past the per-trial timeout of {seconds:g} s"
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum, frame):
            raise EvalTimeoutError(message)

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn(arg)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
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
