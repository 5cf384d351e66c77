"""Where the tuner's numbers come from, behind one small interface.

A `Measurer` gives the cheap per-module signals (output error and latency per dtype) and times whole models
against each other. `DeviceMeasurer` measures on the configured device; a simulator or a replay of recorded
timings can stand in for it. The signals are kept on the study, so a resumed run or another worker reuses them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Protocol

import optuna
import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import module_calls, record_module_inputs
from autotune.config.tuning import TuningConfig
from autotune.discovery import module_groups
from autotune.measure import module_latency as per_module
from autotune.measure.host_load import contended, other_work
from autotune.measure.latency import LatencyStats, measure_latency
from autotune.measure.sensitivity import module_sensitivity
from autotune.measure.shapes import PerModule, Shape, combine_module_latency
from autotune.storage import study as studies

log = logging.getLogger("autotune")
SIGNALS_CONTENDED = ("other processes kept the CPUs busy (%.1f CPUs' worth) while each module was timed alone: the "
                     "dtypes pruned from the search, and its predictions, rest on those timings; tune on a quiet "
                     "machine, or set num_threads to leave cores free")


class Measurer(Protocol):
    def sensitivity(self, fp32: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
                    calibration: dict[str, CallInputs]) -> PerModule:
        """{module: {dtype: output error}} with one module (or group of modules sharing a dtype) lowered at a
        time, on the calibration inputs."""

    def module_latency(self, fp32: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
                       calibration: dict[str, CallInputs]) -> PerModule:
        """{module: {dtype: latency ms}} with one module lowered at a time, at the shape of `inputs` (each
        module called with what it sees in `calibration`, recorded from them)."""

    def latency(self, models: dict[str, nn.Module], inputs: CallInputs, repeats: int,
                warmup: int | None = None) -> dict[str, LatencyStats]:
        """Each model's latency, all timed in one interleaved run so they compare as ratios, after `warmup` calls
        each (None: the configured warm-up; fewer for models already called at these inputs)."""


@dataclass(frozen=True)
class DeviceMeasurer:
    config: TuningConfig
    said: set[str] = field(default_factory=set, compare=False)   # warnings given once a run, not once a shape

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return module_sensitivity(fp32, candidates, inputs, calibration,
                                  module_groups(candidates, self.config, fp32))

    def module_latency(self, fp32, candidates, inputs, calibration):
        timing = dict(repeats=self.config.repeats, num_threads=self.config.num_threads)
        with other_work() as others:
            latency = per_module.module_latency(fp32, candidates, calibration, **timing)
            confirmed = per_module.confirm_in_context(fp32, candidates, latency, inputs, calibration,
                                                      warmup=self.config.warmup, **timing)
        threads = self.config.num_threads or torch.get_num_threads()
        if (torch.device(self.config.device).type == "cpu" and others and contended(others[0], threads)
                and SIGNALS_CONTENDED not in self.said):
            self.said.add(SIGNALS_CONTENDED)
            log.warning(SIGNALS_CONTENDED, others[0])
        return confirmed

    def latency(self, models, inputs, repeats, warmup=None):
        return measure_latency(models, inputs, warmup=self.config.warmup if warmup is None else warmup,
                               repeats=repeats, num_threads=self.config.num_threads)


def _without_lost(sensitivity: PerModule, latency: PerModule) -> PerModule:
    """`latency` without the dtypes that lose a module's output (an inf error: nan / inf outputs, or a model that
    fails to run with it): no plan with one can pass, so none is tried, uniform finalists included."""
    kept = {}
    for name, costs in latency.items():
        lost = [d for d, error in sensitivity.get(name, {}).items() if not math.isfinite(error)]
        if lost:
            log.info("%s stays out of %s: its output is lost there (nan / inf, or the model fails with it)",
                     name, ", ".join(lost))
        kept[name] = {d: ms for d, ms in costs.items() if d not in lost}
    return kept


def latency_by_shape(measurer: Measurer, models: dict[str, nn.Module], shapes: list[Shape],
                     repeats: int, warmup: int | None = None) -> dict[str, dict[str, LatencyStats]]:
    """{shape: {model: latency}}: the models timed against each other at each shape in turn."""
    return {shape.name: measurer.latency(models, shape.inputs, repeats, warmup) for shape in shapes}


def ratios_to_fp32(by_shape: dict[str, dict[str, LatencyStats]], name: str) -> dict[str, float]:
    """{shape: latency of model `name` / latency of "fp32"}, from `latency_by_shape`'s timings, round by round."""
    return {shape: timing[name].ratio_to(timing["fp32"]) for shape, timing in by_shape.items()}


def _module_latency_at(measurer: Measurer, fp32: nn.Module, candidates: dict[str, list[str]],
                       shape: Shape) -> PerModule:
    """Module latency at a shape other than the captured inputs. A module its call does not reach costs nothing
    there: a generation's steps reuse the cross-attention keys and values its first call computed."""
    calibration = record_module_inputs(fp32, list(candidates), shape.inputs)
    reached = {name: dtypes for name, dtypes in candidates.items() if name in calibration}
    timed = measurer.module_latency(fp32, reached, shape.inputs, calibration) if reached else {}
    return {name: timed.get(name) or dict.fromkeys(dtypes, 0.0) for name, dtypes in candidates.items()}


def _per_forward(fp32: nn.Module, inputs: CallInputs, latency: PerModule) -> PerModule:
    """Each module's cost per forward on `inputs`: one call's time (module_latency, on its first call's inputs)
    times the calls the forward makes of it, at least one."""
    calls = module_calls(fp32, list(latency), inputs)
    return {name: {dtype: ms * max(calls[name], 1) for dtype, ms in costs.items()} for name, costs in latency.items()}


def cached_signals(study: optuna.Study, measurer: Measurer, fp32: nn.Module, candidates: dict[str, list[str]],
                   inputs: CallInputs, calibration: dict[str, CallInputs],
                   shapes: list[Shape]) -> tuple[PerModule, PerModule]:
    """The study's per-module signals, measured and stored on first use: latency at each shape (combined for the
    weighted objective; each shape's kept too), then sensitivity on the captured inputs.

    Sensitivity is measured only for the dtypes a module may keep: one timed slower than fp32 on it is pruned from
    the search whatever its error, so its error is not measured and is absent (SearchSpace.build prunes a dtype
    without one). On a CPU that emulates bf16 / fp16 those are the slowest calls of all (each runs the model)."""
    sensitivity = studies.get_attr(study, "sensitivity")
    latency = studies.get_attr(study, "module_latency_ms")
    if sensitivity is None or latency is None:
        per_shape = [_per_forward(fp32, shape.inputs,
                                  measurer.module_latency(fp32, candidates, inputs, calibration)
                                  if shape.inputs is inputs else _module_latency_at(measurer, fp32, candidates, shape))
                     for shape in shapes]
        latency = combine_module_latency(per_shape, shapes)
        kept = {name: [d for d in dtypes if latency[name][d] <= latency[name]["fp32"]]
                for name, dtypes in candidates.items()}
        sensitivity = measurer.sensitivity(fp32, kept, inputs, calibration)
        latency = _without_lost(sensitivity, latency)
        if len(shapes) > 1:
            studies.set_attr(study, "module_latency_ms_by_shape",
                             {shape.name: costs for shape, costs in zip(shapes, per_shape)})
        studies.set_attr(study, "sensitivity", sensitivity)
        studies.set_attr(study, "module_latency_ms", latency)
    return sensitivity, latency
