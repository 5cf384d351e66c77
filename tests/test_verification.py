"""The winner is verified: the best passing plans, and always the best passing uniform plan, are re-timed
interleaved with fp32, and the fastest there is returned (trial timings on a noisy host can rank them wrong)."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure import LatencyStats
from autotune.plan import plan_key, plan_of

NAMES = ["0", "1", "2"]
UNIFORM = {name: "int8" for name in NAMES}
FP32_MS = 10.0
# Every lowered plan passes. In their trials the uniform plan times slowest, so it is not among the three
# fastest trials; re-timed for verification it is the fastest.
PLANS = [dict(zip(NAMES, dtypes)) for dtypes in itertools.product(["int8", "fp32"], repeat=3)][:-1]  # not fp32
TRIAL_RATIO = {plan_key({name: "fp32" for name in NAMES}): 1.0,
               **{plan_key(p): 0.9 if p == UNIFORM else 0.5 + 0.05 * i for i, p in enumerate(PLANS)}}
VERIFY_RATIO = {**TRIAL_RATIO, plan_key(UNIFORM): 0.5}


class ScriptedMeasurer:
    """Module "2" measured slower in int8 alone but kept (its cost equals fp32's, as the whole-model check
    leaves it), so the fastest predicted plan keeps it fp32 and the uniform plan differs from it."""

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return {name: {"int8": 0.01, "fp32": 0.0} for name in candidates}

    def module_latency(self, fp32, candidates, inputs, calibration):
        return {"0": {"int8": 0.5, "fp32": 1.0}, "1": {"int8": 0.5, "fp32": 1.0}, "2": {"int8": 1.0, "fp32": 1.0}}

    def latency(self, models, inputs, repeats, warmup=None):
        ratios = TRIAL_RATIO if len(models) == 2 else VERIFY_RATIO   # a trial times its plan against fp32 alone
        return {name: LatencyStats(FP32_MS * ratios[plan_key(plan_of(model, NAMES))], 0.0, repeats)
                for name, model in models.items()}


def test_the_best_passing_uniform_plan_is_a_finalist_and_wins_when_it_is_fastest_re_timed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in NAMES)).eval()
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.5,
                          max_trials=20, storage=f"sqlite:///{tmp_path}/v.db", study_name="v")
    inputs = torch.randn(2, 8)
    result = autotune(model, config, lambda m: float(m(inputs).isfinite().all()), measurer=ScriptedMeasurer())
    trial_ratios = sorted(t.values[0] for t in result.study.trials if t.values)
    # the uniform plan is the slowest in its trial
    assert trial_ratios[:3] == pytest.approx([0.55, 0.6, 0.65]) and max(trial_ratios) == pytest.approx(0.9)
    assert result.plan == UNIFORM
    assert result.best.latency.median_ms == pytest.approx(FP32_MS * 0.5)
