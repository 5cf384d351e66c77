"""Where the tuner's numbers come from, behind one small interface.

A `Measurer` gives the cheap per-module signals (output error and latency per dtype) and times whole models
against each other. `DeviceMeasurer` measures on the configured device; a simulator or a replay of recorded
timings can stand in for it. The signals are kept on the study, so a resumed run or another worker reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import optuna
import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.config.tuning import TuningConfig
from autotune.measure.latency import LatencyStats, measure_latency
from autotune.measure.module_latency import confirm_in_context, module_latency
from autotune.measure.sensitivity import module_sensitivity
from autotune.storage import study as studies

PerModule = dict[str, dict[str, float]]


class Measurer(Protocol):
    def module_signals(self, fp32: nn.Module, candidates: dict[str, list[str]], inputs: CallInputs,
                       calibration: dict[str, CallInputs]) -> tuple[PerModule, PerModule]:
        """({module: {dtype: output error}}, {module: {dtype: latency ms}}) with one module lowered at a time."""

    def latency(self, models: dict[str, nn.Module], inputs: CallInputs, repeats: int) -> dict[str, LatencyStats]:
        """Each model's latency, all timed in one interleaved run so they compare as ratios."""


@dataclass(frozen=True)
class DeviceMeasurer:
    config: TuningConfig

    def module_signals(self, fp32, candidates, inputs, calibration):
        sensitivity = module_sensitivity(fp32, candidates, inputs, calibration)
        timing = dict(repeats=self.config.repeats, num_threads=self.config.num_threads,
                      device=torch.device(self.config.device))
        latency = module_latency(fp32, candidates, calibration, **timing)
        return sensitivity, confirm_in_context(fp32, candidates, latency, inputs, calibration,
                                               warmup=self.config.warmup, **timing)

    def latency(self, models, inputs, repeats):
        return measure_latency(models, inputs, warmup=self.config.warmup, repeats=repeats,
                               num_threads=self.config.num_threads, device=torch.device(self.config.device))


def cached_signals(study: optuna.Study, measurer: Measurer, fp32: nn.Module, candidates: dict[str, list[str]],
                   inputs: CallInputs, calibration: dict[str, CallInputs]) -> tuple[PerModule, PerModule]:
    """The study's per-module signals, measured and stored on first use."""
    sensitivity = studies.get_attr(study, "sensitivity")
    latency = studies.get_attr(study, "module_latency_ms")
    if sensitivity is None or latency is None:
        sensitivity, latency = measurer.module_signals(fp32, candidates, inputs, calibration)
        studies.set_attr(study, "sensitivity", sensitivity)
        studies.set_attr(study, "module_latency_ms", latency)
    return sensitivity, latency
