"""The memory this process may still take, and what building a model took of it.

Building a compiled finalist (export, calibration, compilation) holds several times the model's weights at its
peak, and every finalist built stays alive until the race: a 12-layer d768 encoder (327 MiB of weights) went from
2.4 to 4.2 GiB while seven finalists built. One build too many and the kernel's OOM killer ends the run, with no
tuned model returned; `BuildMemory` says when no further build would fit.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
STATM = Path("/proc/self/statm")
CGROUPS = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# A cgroup's (limit, usage) files: v2 (one hierarchy), then v1 (the memory controller's own). A container's or a
# service's limit is not in MemAvailable, which speaks of the whole host.
V2_FILES, V1_FILES = ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
UNLIMITED = 1 << 60   # cgroup v1 writes "no limit" as a number near 2**63


def available_bytes() -> int | None:
    """What the kernel says can still be allocated without swapping (MemAvailable), or what the cgroup's limit
    leaves where that is less; None where neither can be read (not Linux)."""
    known = [left for left in (_meminfo_available(), _cgroup_left()) if left is not None]
    return min(known) if known else None


def rss_bytes() -> int | None:
    """This process's resident memory; None where /proc cannot be read."""
    try:
        return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _meminfo_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024    # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """The least any memory cgroup this process is in leaves, from its own up to the root (a limit set on a parent,
    a Kubernetes pod's, binds too); None where none sets one."""
    left = [max(limit - usage, 0) for limit, usage in map(_limit_and_usage, _cgroup_dirs()) if limit is not None]
    return min(left) if left else None


def _cgroup_dirs() -> list[tuple[Path, tuple[str, str]]]:
    """(folder, its limit and usage file names) for this process's memory cgroup and each above it. Inside a
    container with its own cgroup namespace, /proc/self/cgroup names "/" and the root folder is the container's."""
    try:
        lines = CGROUPS.read_text().splitlines()
    except OSError:
        lines = []
    found = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = CGROUP_ROOT, V2_FILES
        elif "memory" in controllers.split(","):
            base, files = CGROUP_ROOT / "memory", V1_FILES
        else:
            continue
        parts = [part for part in path.split("/") if part not in ("", ".", "..")]   # ".." : above its namespace
        found += [(base.joinpath(*parts[:depth]), files) for depth in range(len(parts), -1, -1)]
    return found


def _limit_and_usage(where: tuple[Path, tuple[str, str]]) -> tuple[int | None, int]:
    """A cgroup's limit (None: it sets none, or cannot be read), and its usage less the file cache the kernel would
    drop before it killed anything (inactive files, as `docker stats` counts them)."""
    folder, (limit_name, usage_name) = where
    try:
        written, usage = (folder / limit_name).read_text().strip(), int((folder / usage_name).read_text().strip())
        limit = None if written == "max" or int(written) >= UNLIMITED else int(written)
    except (OSError, ValueError):
        return None, 0
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
        usage -= int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        pass
    return limit, max(usage, 0)


def in_words(size: int) -> str:
    """Bytes as GiB, or MiB below one."""
    return f"{size / 2 ** 30:.1f} GiB" if size >= 2 ** 30 else f"{size / 2 ** 20:.1f} MiB"


@dataclass
class BuildMemory:
    """Whether one more build fits in what is left, with `weights` (the model's) kept beside it for what follows
    the builds: the race and the winner's checks grew the encoder's process by 1.3x its weights. A build is taken
    to need the most any build so far grew the process by (`measuring`), and at least twice the weights before
    one has shown what it takes."""
    weights: int
    available: Callable[[], int | None] = field(default=lambda: available_bytes())   # looked up at each call
    largest: int = 0      # bytes: the most a build measured so far grew the resident memory by

    @property
    def build(self) -> int:
        return max(2 * self.weights, self.largest)

    def too_little(self) -> str | None:
        """Why the memory available is too little for a build and the reserve, in words; None where they fit, or
        it is not known."""
        left = self.available()
        if left is None or left >= self.build + self.weights:
            return None
        taken = f"a finalist's build took up to {in_words(self.largest)}" if self.largest >= 2 * self.weights else \
            f"a finalist's build may take twice the model's weights, {in_words(2 * self.weights)}"
        return f"only {in_words(left)} of memory is left, {taken}, and the race after needs about the weights again"

    @contextmanager
    def measuring(self) -> Iterator[None]:
        before = rss_bytes()
        try:
            yield
        finally:
            after = rss_bytes()
            if before is not None and after is not None:
                self.largest = max(self.largest, after - before)
