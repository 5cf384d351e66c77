"""Which quantized engine runs a dynamic int8 Linear here, measured on the module's own weight and inputs.

FBGEMM and oneDNN quantise alike (per-channel int8 weights, activations per call): a Linear's relative output
error was the same to three digits in both, though a whole model's rounding differs in places (MiniLM's sentiment
accuracy over 200 sentences, 0.795 and 0.780, fp32 0.765). Their speed depends on the CPU: on a 2-core Xeon with
AMX, oneDNN ran a 128x384 -> 1536 Linear at 0.24 of fp32's time where FBGEMM took 0.43, and MiniLM at batch 64 in
int8 at 0.53 where FBGEMM alone gave 0.63. So each kind of Linear (its weight's shape, bias, the rows it is called
with, the activation bits) is timed once per process in both, and oneDNN is taken only where it is clearly faster:
a near-tie keeps FBGEMM, so processes of one study on one host build a plan alike.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from autotune.backends.quantized import per_channel_qweight, quantized_engine

DEFAULT_ENGINE = "fbgemm"
CANDIDATES = ("fbgemm", "onednn")
MAX_ROWS = 1024        # rows timed at most: an LM head called on a whole batch costs seconds a call
ROUNDS = 7             # each engine's best of these: a call the host preempted says nothing of the kernel
MARGIN = 0.9           # oneDNN is taken below this share of FBGEMM's time: a near-tie keeps the default

_chosen: dict[tuple, str] = {}


def dynamic_linear_engine(linear: nn.Linear, x: object, reduce_range: bool,
                          clock: Callable[[], float] | None = None) -> str:
    """The engine to pack a dynamic int8 Linear's weight for: FBGEMM, or oneDNN where it ran `x` (the module's
    input as recorded) clearly faster. FBGEMM where `x` is no floating tensor, or an empty one, or where only
    FBGEMM is built in."""
    engines = [e for e in CANDIDATES if e in torch.backends.quantized.supported_engines]
    rows = _row_count(x)
    if len(engines) < 2 or not rows:
        return DEFAULT_ENGINE
    key = (tuple(linear.weight.shape), linear.bias is not None, rows, reduce_range)
    if key not in _chosen:    # the inputs are copied only here: a lowering of a kind timed before reads the key
        bias = None if linear.bias is None else linear.bias.detach().float()
        _chosen[key] = _faster(per_channel_qweight(linear.weight), bias, timed_rows(x).float(), reduce_range,
                               engines, clock or time.perf_counter)
    return _chosen[key]


def timed_rows(x: object) -> object:
    """What of a Linear's recorded input the choice reads: a copy of its first MAX_ROWS rows, as rows of one
    matrix (the same key and the same rows timed as the whole input); anything without rows of floats as it is."""
    return x.detach().reshape(-1, x.shape[-1])[:MAX_ROWS].clone() if _row_count(x) else x


def _row_count(x: object) -> int:
    """The rows of `x` the choice times; 0 where it is no floating tensor, or holds none."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return 0
    return min(x.numel() // x.shape[-1], MAX_ROWS)


def _faster(qweight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor, reduce_range: bool,
            engines: list[str], clock: Callable[[], float]) -> str:
    calls = {}
    for engine in engines:
        with quantized_engine(engine):
            packed = torch.ops.quantized.linear_prepack(qweight, bias)
        calls[engine] = lambda packed=packed: torch.ops.quantized.linear_dynamic(rows, packed, reduce_range)
    times: dict[str, list[float]] = {engine: [] for engine in engines}
    with torch.inference_mode():
        try:
            for call in calls.values():
                call()         # first calls set kernels up
        except RuntimeError:   # an engine refusing these inputs
            return DEFAULT_ENGINE
        for _ in range(ROUNDS):     # interleaved: the host's load falls on both alike
            for engine, call in calls.items():
                start = clock()
                call()
                times[engine].append(clock() - start)
    best = {engine: min(spent) for engine, spent in times.items()}
    fastest = min(engines, key=best.__getitem__)
    return fastest if best[fastest] < MARGIN * best[DEFAULT_ENGINE] else DEFAULT_ENGINE
