"""Latency, timed with `torch.utils.benchmark.Timer` (explicit thread count, accelerator synchronisation).

Variants compared are timed interleaved, one sample each per round in rotating order, so drift on a shared
machine hits all of them alike. A sample is one `Timer.blocked_autorange`: a call that warms the variant up again
after the others ran, then one timed call, or for a call shorter than BLOCK_S a block of ten or more timed as one
(so the timer's own overhead stays small). A call of LONG_CALL_S or more is sampled as that one call alone: the
caches another variant left behind are a small share of so long a call (re-reading even a few MB of weights takes
a fraction of a millisecond), and the warm-up call doubled the cost of every sample. Rounds stop once the
comparison is settled (see `settled`) or after `repeats` rounds.
"""
from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils import benchmark

from autotune.backends.base import CallInputs
from autotune.measure.host_load import contended, other_work
from autotune.model_call import call, copied_for_each_call, entries_of

MIN_ROUNDS = 3
PRECISION = 0.03      # a ratio known to ±3 % (median notch) needs no more rounds
UNCERTAIN_RATIO = 0.1   # a ratio known to no better than ±10 %: the machine was busy while it was timed
BLOCK_S = 1e-4        # seconds: calls shorter than this are timed in blocks
LONG_CALL_S = 0.01    # seconds: calls this long are sampled without a warm-up call before each
FAR_SLOWER = 2.0      # a variant whose faster sample took this many times the fastest's slower one is out at once


@dataclass(frozen=True)
class LatencyStats:
    median_ms: float
    spread_ms: float  # interquartile range
    repeats: int      # samples taken
    samples_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)
    others_cpus: float | None = field(default=None, repr=False, compare=False)   # see host_load.other_work
    threads: int = field(default=0, repr=False, compare=False)    # timed on

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("samples_ms", "others_cpus", "threads")}

    @property
    def contended(self) -> bool:
        """Whether other processes needed more CPUs than the timing left free while it ran (host_load)."""
        return contended(self.others_cpus, self.threads)

    def ratio_to(self, reference: LatencyStats) -> float:
        """This latency / `reference`'s: the median of their per-round ratios over the rounds both were timed in,
        as the race judged them. A variant the race stopped timing early is so compared with the reference's same
        rounds, not with rounds timed later under another load. The ratio of medians where no samples are kept."""
        if not self.samples_ms or not reference.samples_ms:
            return self.median_ms / reference.median_ms
        return statistics.median(mine / theirs for mine, theirs in zip(self.samples_ms, reference.samples_ms))

    def ratio_uncertainty(self, reference: LatencyStats) -> float:
        """How far `ratio_to(reference)` may be off, as a share of it: half its median notch (1.57 IQR / √rounds of
        the per-round ratios). 0 where no samples are kept."""
        ratios = [mine / theirs for mine, theirs in zip(self.samples_ms, reference.samples_ms)]
        if len(ratios) < 2:
            return 0.0
        low, median, high = _notch(ratios)
        return (high - low) / 2 / median

    def measurement(self, label: str, sub_label: str, description: str, num_threads: int) -> benchmark.Measurement:
        """These samples as torch.utils.benchmark's Measurement, for its `Compare` tables."""
        spec = benchmark.TaskSpec(stmt="model(*args, **kwargs)", setup="pass", label=label, sub_label=sub_label,
                                  description=description, num_threads=num_threads)
        return benchmark.Measurement(number_per_run=1, raw_times=[s / 1e3 for s in self.samples_ms], task_spec=spec)


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


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def _stats(samples_s: list[float], others_cpus: float | None = None, threads: int = 0) -> LatencyStats:
    ms = [s * 1e3 for s in samples_s]
    q1, median, q3 = _quartiles(ms)
    return LatencyStats(median, q3 - q1, len(ms), tuple(ms), others_cpus, threads)


def _notches(samples: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """(low, median, high) of each variant's per-round ratio to the first variant: the median notch, median ±
    1.57 IQR / √rounds; the first variant's is exactly 1. A single variant's is of its samples over their median."""
    names = list(samples)
    rounds = len(samples[names[0]])
    reference = samples[names[0]] if len(names) > 1 else [statistics.median(samples[names[0]])] * rounds
    notches = {name: _notch([a / b for a, b in zip(samples[name], reference)]) for name in names[1:] or names}
    notches.setdefault(names[0], (1.0, 1.0, 1.0))
    return notches


def _notch(ratios: list[float]) -> tuple[float, float, float]:
    """(low, median, high): the median notch of per-round ratios, median ± 1.57 IQR / √rounds."""
    q1, median, q3 = _quartiles(ratios)
    half = 1.57 * (q3 - q1) / math.sqrt(len(ratios))
    return median - half, median, median + half


def settled(samples: dict[str, list[float]], precision: float = PRECISION) -> bool:
    """Whether more rounds could change the comparison: each variant's ratio to the first variant has a median
    notch narrower than ±precision, or one that overlaps no other variant's (the first variant's is exactly 1)."""
    if len(next(iter(samples.values()))) < MIN_ROUNDS:
        return False
    notches = _notches(samples)
    return all(high - low <= 2 * precision * median
               or all(high < low_o or low > high_o for other, (low_o, _, high_o) in notches.items() if other != name)
               for name, (low, median, high) in notches.items())


def still_racing(samples: dict[str, list[float]], precision: float = PRECISION) -> list[str]:
    """The variants worth more rounds: the first (every ratio is to it), the fastest, and each other whose ratio
    notch still reaches more than `precision` below the fastest's median. One clearly slower than the fastest
    can no longer come first; one known to be within `precision` of it (a near-tie) would win by too little to
    matter, and settling which of the two is faster is what took most rounds.

    Before MIN_ROUNDS, from two rounds on, only one far slower is out: each of its samples FAR_SLOWER times the
    slowest sample of the variant whose slowest is lowest (so one slow spell drops nothing it should not; a
    race of twenty finalists spent most of its time on third samples of ones 2-4x the fastest)."""
    names = list(samples)
    rounds = len(samples[names[0]])
    if len(names) <= 2 or rounds < 2:
        return names
    if rounds < MIN_ROUNDS:
        bar = FAR_SLOWER * min(max(samples[name]) for name in names[1:])
        return [names[0], *(name for name in names[1:] if min(samples[name]) < bar)]
    notches = _notches(samples)
    fastest = min(names[1:], key=lambda name: notches[name][1])
    bar = min(notches[fastest][2], notches[fastest][1] * (1 - precision))
    return [names[0], *(name for name in names[1:] if name == fastest or notches[name][0] < bar)]


def _timers(models: dict[str, nn.Module], per_model: dict[str, CallInputs], threads: int) -> dict[str, benchmark.Timer]:
    return {name: _timer(model, per_model[name], threads, name) for name, model in models.items()}


def _timer(model: nn.Module, inputs: CallInputs, threads: int, name: str) -> benchmark.Timer:
    """Calls on the inputs as they are, or through `call`, which gives each call its own copy of the state in them
    (a KV cache the model appends to: timed on a cache grown by every earlier call, a model ran slower each call)
    and of the tensors a model changes in place, and makes the submodule calls recorded before it (generate's
    encoder run, autotune.model_call)."""
    if copied_for_each_call(inputs) or entries_of(inputs):
        return benchmark.Timer("call(model, inputs)", num_threads=threads, description=name,
                               globals={"call": call, "model": model, "inputs": inputs})
    return benchmark.Timer("model(*args, **kwargs)", num_threads=threads, description=name,
                           globals={"model": model, "args": inputs[0], "kwargs": inputs[1]})


def _no_autograd() -> AbstractContextManager:
    """torch.inference_mode, unless the caller runs without autograd already (capture.without_autograd: under
    eval_fn's torch.no_grad, where a compiled model's graphs for it were made)."""
    return torch.inference_mode() if torch.is_grad_enabled() else nullcontext()


def _clock() -> float:
    """Seconds, after the accelerator's queued work (as Timer's own clock)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def _timed_call_s(model: nn.Module, inputs: CallInputs) -> float:
    started = _clock()
    call(model, inputs)
    return _clock() - started


def timed_call_ms(model: nn.Module, inputs: CallInputs, num_threads: int | None = None) -> float:
    """ms of one call of `model`: a one-sample look (a model's first call includes its one-time costs), for
    telling apart variants an order of magnitude apart before timing the rest in rounds."""
    with fixed_threads(num_threads or torch.get_num_threads()), _no_autograd():
        return _timed_call_s(model, inputs) * 1e3


def measure_latency(models: dict[str, nn.Module], inputs: CallInputs | dict[str, CallInputs], *,
                    warmup: int = 3, repeats: int = 15, num_threads: int | None = None,
                    precision: float = PRECISION) -> dict[str, LatencyStats]:
    """Times every model on its inputs (one shared input, or one per model): at least MIN_ROUNDS and at most
    `repeats` interleaved rounds, fewer once `settled`; a model clearly slower than the fastest stops being
    timed (`still_racing`), the first one never. Returns per-call statistics of each model's samples.
    Each model gets `warmup` calls first, the last timed to tell long calls apart; with warmup=0 (models already
    called at these inputs) none, and each model's first sample is one call, which tells them apart.
    Timer synchronises the accelerator (CUDA) around every block, and so does the clock of long calls, so
    device work is timed to its end."""
    per_model = inputs if isinstance(inputs, dict) else {name: inputs for name in models}
    threads = num_threads or torch.get_num_threads()
    timers = _timers(models, per_model, threads)
    names = list(models)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with fixed_threads(threads), _no_autograd():
        long_calls: set[str] = set()
        untold = set() if warmup else set(names)   # long or not, told by their first sample
        for name in names if warmup else ():   # what a first call needs (compilation, lazy initialisation, caches)
            for _ in range(warmup - 1):
                call(models[name], per_model[name])
            if _timed_call_s(models[name], per_model[name]) >= LONG_CALL_S:   # the last warm-up call, timed
                long_calls.add(name)
        with other_work() as others:
            _rounds(models, per_model, timers, samples, long_calls, untold, repeats, precision)
    return {name: _stats(times, others[0] if others else None, threads) for name, times in samples.items()}


def _rounds(models: dict[str, nn.Module], per_model: dict[str, CallInputs], timers: dict[str, benchmark.Timer],
            samples: dict[str, list[float]], long_calls: set[str], untold: set[str], repeats: int,
            precision: float) -> None:
    """measure_latency's interleaved rounds, adding to `samples`."""
    racing = list(models)
    for round_index in range(max(repeats, MIN_ROUNDS)):
        shift = round_index % len(racing)
        for name in racing[shift:] + racing[:shift]:
            if name in long_calls or name in untold:   # an untold model's first sample is one call
                samples[name].append(_timed_call_s(models[name], per_model[name]))
                if name in untold and samples[name][-1] >= LONG_CALL_S:
                    long_calls.add(name)
                untold.discard(name)
            else:
                samples[name].append(timers[name].blocked_autorange(min_run_time=BLOCK_S).median)
        timed = {name: samples[name] for name in racing}
        if settled(timed, precision):
            break
        racing = still_racing(timed, precision)
