"""The `autotune` command's entry point (and `python -m autotune`'s): Ctrl-C is taken over (autotune.interrupts)
before the command line, and torch with it, is loaded."""
from __future__ import annotations

import os
import sys

from autotune import interrupts


def main() -> None:
    interrupts.install()
    from autotune.cli import main as command_line
    try:
        command_line(prog_name="autotune")
    except SystemExit as done:
        if done.code not in (interrupts.INTERRUPTED, interrupts.STOPPED):
            raise
        # Stopped, and said so: shutting the interpreter down takes seconds with torch loaded, and Python gives
        # Ctrl-C back to the system meanwhile, so a second one ended the process by the signal.
        sys.stdout.flush()
        os._exit(done.code)
