"""Steady memory allocation, so a model's latency does not depend on what the process allocated before.

glibc's malloc maps large blocks afresh and hands freed memory back to the OS past a threshold it moves with the
process's history. A model whose activations are tens of MB then faults them in page by page on some calls and
not on others: MNIST's fp32 forward at batch 250 read 16 ms or 35 ms in one process (18 000 minor page faults a
call in the slow state), and MiniLM's 340 ms or 394 ms. Fixed thresholds keep freed activations in the heap for
the next call, as jemalloc or tcmalloc do, so every model is timed as it runs in a steady server process and a
comparison does not flip with allocation history.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's largest on 64-bit: blocks up to it come from the heap, reused call after call
TRIM_THRESHOLD = 1 << 30    # free memory the heap keeps at its top rather than handing back

_done: str | None = None


def steady_allocation() -> str:
    """Fixes glibc malloc's mmap and trim thresholds for this whole process (once; not undone: fixing them also
    ends glibc's own adjustment). Returns what was done, or why nothing was (not glibc)."""
    global _done
    if _done is None:
        _done = _fix_thresholds()
    return _done


def allocation_while_timing(steady: bool) -> str:
    """What a run that times models does to the allocator: `steady_allocation()` if `steady` (the config's
    `steady_allocation`), else nothing; returns what was done, as the study's settings record it."""
    return steady_allocation() if steady else "allocator not fixed by this run (steady_allocation: false)"


def _fix_thresholds() -> str:
    if platform.libc_ver()[0] != "glibc":
        return f"allocator left as is: not glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'})"
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "allocator left as is: glibc refused mallopt"
    return (f"glibc malloc thresholds fixed (M_MMAP_THRESHOLD {MMAP_THRESHOLD >> 20} MiB, "
            f"M_TRIM_THRESHOLD {TRIM_THRESHOLD >> 20} MiB)")
