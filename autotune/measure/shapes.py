"""The input shapes latency is measured at (`TuningConfig.latency_inputs`), and how their ratios combine.

A plan tuned at one shape is tuned for that shape only: dynamic int8 pays its activation quantisation per call,
so it can win at batch 64 and lose at batch 1. Each shape's latency ratio to fp32 is measured; the objective is
their weighted mean, and every per-shape ratio is kept on the trial.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import as_call_inputs, failure_of, to_device
from autotune.config.file import call_factory
from autotune.config.tuning import LatencyInput, TuningConfig
from autotune.errors import ConfigError
from autotune.measure.latency import measure_latency
from autotune.model_call import holds_state
from autotune.tree import map_tensors, tensors

PerModule = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Shape:
    name: str
    inputs: CallInputs
    weight: float


def batch_size(inputs: CallInputs) -> int | None:
    """The first dimension most tensors share (the earliest on a tie), taken as the batch: an nn.EmbeddingBag's
    flat indices, first of (indices, offsets, dense features), have another."""
    sizes: list[int] = []
    map_tensors(inputs, lambda t: sizes.append(t.shape[0]) if t.dim() else None)
    return Counter(sizes).most_common(1)[0][0] if sizes else None   # ties: the earliest counted


def resize_batch(inputs: CallInputs, batch: int) -> CallInputs:
    """`inputs` with every tensor whose first dimension is the batch cut to `batch` rows, or its rows repeated."""
    size = batch_size(inputs)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if not t.dim() or t.shape[0] != size:
            return t
        return t.repeat(math.ceil(batch / size), *([1] * (t.dim() - 1)))[:batch].contiguous()
    return map_tensors(inputs, resize)


def _shape(entry: LatencyInput, index: int, recorded: list[CallInputs], device: torch.device) -> Shape:
    field = f"latency_inputs.{index}"
    if entry.factory is not None:
        made = call_factory(entry.factory, entry.kwargs, f"{field}.factory")
        inputs = to_device(as_call_inputs(made, f"{field}.factory"), device)
        default = entry.factory if isinstance(entry.factory, str) else getattr(entry.factory, "__name__", "factory")
        return Shape(entry.name or default.rpartition(":")[2], inputs, entry.weight)
    if (entry.call or 0) >= len(recorded):
        raise ConfigError(f"{field}.call: the model's calls recorded are {len(recorded)} (calls 0 to "
                          f"{len(recorded) - 1}), so call {entry.call} cannot be timed",
                          [(f"{field}.call", "not among the recorded calls")])
    captured = recorded[entry.call or 0]
    if entry.batch is not None and batch_size(captured) is None:
        raise ConfigError(f"{field}.batch: the captured inputs have no batch dimension to resize; give a factory",
                          [(f"{field}.batch", "no batch dimension")])
    inputs = captured if entry.batch is None else resize_batch(captured, entry.batch)
    size = batch_size(inputs)
    default = f"batch {size}" if size is not None else "example"
    return Shape(entry.name or (default if entry.call is None else f"call {entry.call}, {default}"), inputs,
                 entry.weight)


def latency_shapes(config: TuningConfig, recorded: list[CallInputs], device: torch.device,
                   fp32: nn.Module | None = None, calls: list[LatencyInput] | None = None) -> list[Shape]:
    """The configured shapes, built from the recorded calls (the first by default) or the factories; where none
    are configured, the recorded `calls` chosen for the study (a generation's first call and its steps), else the
    first recorded call. Each configured one is run on `fp32` once, where given.

    Raises:
        ConfigError: a factory failed, a batch cannot be resized, two shapes share a name, or the model fails on
            a shape's inputs.
    """
    entries = config.latency_inputs or calls or [LatencyInput()]
    shapes = [_shape(entry, index, recorded, device) for index, entry in enumerate(entries)]
    names = [shape.name for shape in shapes]
    if len(set(names)) != len(names):
        raise ConfigError(f"latency_inputs: two shapes are named alike ({names}); give each a name",
                          [("latency_inputs", "duplicate names")])
    for index, shape in enumerate(shapes if config.latency_inputs and fp32 is not None else []):
        if reason := failure_of(fp32, shape.inputs):
            resized = entries[index].factory is None and entries[index].batch is not None
            raise ConfigError(
                f"latency_inputs.{index}: the fp32 model fails on the inputs of shape {shape.name!r}: {reason}"
                + ("; a batch is resized by cutting or repeating every input tensor whose first dimension is the "
                   f"captured batch ({batch_size(recorded[entries[index].call or 0])}), so give a factory for this "
                   "shape" if resized else ""),
                [(f"latency_inputs.{index}", "the model fails on these inputs")])
    return shapes


def time_weighted(calls: list[LatencyInput], recorded: list[CallInputs], fp32: nn.Module,
                  num_threads: int | None) -> tuple[list[LatencyInput], float] | None:
    """A generation's chosen calls, its first and a later one (capture.HowCalled.calls_to_time: the later weighted by
    how many follow each first), with the later's weight multiplied by its fp32 time as a share of the first's, so
    that the weighted mean of their latency ratios is the ratio of the whole generation's time. Returns them and that
    share; None where the later call does the first's work (tensors of the same shapes and no state: more batches
    of one shape, as sentence-transformers' encode feeds), so the first stands for all."""
    first, later = calls
    same_shapes = [t.shape for t in tensors(recorded[first.call])] == [t.shape for t in tensors(recorded[later.call])]
    if same_shapes and not holds_state(recorded[later.call]):
        return None
    timed = measure_latency({"first": fp32, "later": fp32},
                            {"first": recorded[first.call], "later": recorded[later.call]},
                            warmup=2, repeats=5, num_threads=num_threads)
    share = timed["later"].ratio_to(timed["first"])   # round by round: a load spike moves one round alone
    return [first, later.model_copy(update={"weight": round(later.weight * share, 3)})], share


def weighted_ratio(ratios: dict[str, float], shapes: list[Shape]) -> float:
    """The objective: each shape's latency ratio to fp32, weighted."""
    return sum(shape.weight * ratios[shape.name] for shape in shapes) / sum(shape.weight for shape in shapes)


def combine_module_latency(per_shape: list[PerModule], shapes: list[Shape]) -> PerModule:
    """Per-module costs for the weighted objective: each shape's costs as shares of its fp32 model, weighted,
    in the first shape's milliseconds (so one shape gives its own costs back). Sums over a plan then predict its
    weighted ratio, as a plan's module costs predict its latency at one shape."""
    totals = [sum(costs["fp32"] for costs in latency.values()) or 1.0 for latency in per_shape]
    weight = sum(shape.weight for shape in shapes)
    return {name: {dtype: sum(shape.weight * latency[name][dtype] * totals[0] / total
                              for shape, latency, total in zip(shapes, per_shape, totals)) / weight
                   for dtype in costs}
            for name, costs in per_shape[0].items()}
