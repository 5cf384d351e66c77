"""How much other work the machine's CPUs did while models were timed.

Threads of a kernel that share cores with other processes wait on one another: on a 2-core host with another
process busy, a model timed on 2 threads ran 100x its quiet time (328 ms where it runs in 3.3 ms), steadily, so its
spread looked fine while the ratios between variants were far off (a plan timed 1.46x fp32 ran 0.48x alone).
Linux only (/proc/stat); elsewhere unknown.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user, nice, system, irq, softirq, steal (another VM's use of these CPUs)
SPARE = 0.5     # CPUs' worth of other work beyond the cores the timing left free that is judged contention


def _busy_s() -> float | None:
    """Seconds all CPUs have been busy since boot; None where the system does not say."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
        return sum(int(fields[i]) for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def other_work() -> Iterator[list[float]]:
    """Yields a list that holds, after the block, the CPUs' worth of work other processes did during it (the
    machine's busy time less this process's, over the wall time); left empty where that cannot be told."""
    measured: list[float] = []
    busy, own, wall = _busy_s(), time.process_time(), time.monotonic()
    yield measured
    after, elapsed = _busy_s(), time.monotonic() - wall
    if busy is not None and after is not None and elapsed > 0:
        measured.append(max(0.0, (after - busy - (time.process_time() - own)) / elapsed))


def contended(others_cpus: float | None, threads: int) -> bool:
    """Whether other work needed more of the CPUs than a timing on `threads` threads left free."""
    return others_cpus is not None and others_cpus > (os.cpu_count() or 1) - threads + SPARE
