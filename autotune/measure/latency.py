"""Latency. Latencies are medians after warm-up, and variants compared are measured interleaved
in one run, so drift on a shared machine hits all of them alike."""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import call

CPU = torch.device("cpu")


@dataclass(frozen=True)
class LatencyStats:
    median_ms: float
    spread_ms: float  # interquartile range
    repeats: int

    def to_dict(self) -> dict:
        return asdict(self)


@contextmanager
def fixed_threads(num_threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (from /proc/cpuinfo on Linux), else the machine type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stats(samples_s: list[float]) -> LatencyStats:
    ms = sorted(s * 1e3 for s in samples_s)
    quartiles = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [ms[0]] * 3
    return LatencyStats(statistics.median(ms), quartiles[2] - quartiles[0], len(ms))


def measure_latency(models: dict[str, nn.Module], inputs: CallInputs | dict[str, CallInputs], *,
                    warmup: int = 3, repeats: int = 15, num_threads: int | None = None,
                    device: torch.device = CPU) -> dict[str, LatencyStats]:
    """Times every model on its inputs (one shared input, or one per model), rounds interleaved."""
    per_model = inputs if isinstance(inputs, dict) else {name: inputs for name in models}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in models}
    with fixed_threads(num_threads), torch.inference_mode():
        for name, model in models.items():
            for _ in range(warmup):
                call(model, per_model[name])
        for round_index in range(repeats):
            names = list(models)
            names = names[round_index % len(names):] + names[:round_index % len(names)]
            for name in names:
                sync()
                start = time.perf_counter()
                call(models[name], per_model[name])
                sync()
                samples[name].append(time.perf_counter() - start)
    return {name: _stats(times) for name, times in samples.items()}
