"""The benchmark simulator (benchmarks/simulator.py): its oracle is exact, and autotune gets close to it cheaply."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from simulator import SimWorkload, brute_force, plan_of  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_oracle_beats_or_equals_every_plan_of_a_brute_forced_instance(seed):
    sim = SimWorkload(8, seed=seed, eval_cost_s=0)
    best_plan, best_speedup = brute_force(sim)          # all 3^8 plans
    oracle = sim.oracle()
    assert sim.passes(oracle.plan)
    assert oracle.speedup >= best_speedup - 1e-12
    assert oracle.upper_bound >= oracle.speedup
    assert not sim.passes(sim.uniform("int8"))          # the optimum is a real mix, not all-int8


def test_plan_of_reads_the_dtypes_back_from_lowered_modules():
    from autotune.plan import apply_plan
    sim = SimWorkload(3, eval_cost_s=0)
    plan = {"0": "int8", "1": "bf16", "2": "fp32"}
    assert plan_of(apply_plan(sim.model(), plan)) == plan
    assert sim.eval_fn(apply_plan(sim.model(), plan)) == pytest.approx(sim.accuracy(plan))


def test_autotune_with_the_sim_measurer_reaches_95_percent_of_the_oracle_within_2log2n_plus_8_calls(tmp_path):
    from autotune import MixedPrecisionConfig, TuningConfig, autotune
    from autotune.plan import plan_key

    sim = SimWorkload(50, eval_cost_s=0)
    seen = []

    def eval_fn(model):
        seen.append(plan_key(plan_of(model)))
        return sim.eval_fn(model)

    budget = math.floor(2 * math.log2(50) + 8)              # 19 eval_fn calls: the baseline + 18 trials
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=budget - 1, storage=f"sqlite:///{tmp_path}/sim.db", study_name="sim50")
    result = autotune(sim.model(), config, eval_fn, sim.example_inputs(), measurer=sim.measurer())
    oracle = sim.oracle()
    reached_at = seen.index(plan_key(result.plan)) + 1      # eval_fn calls, the baseline being call 1
    share = sim.speedup(result.plan) / oracle.speedup
    assert sim.passes(result.plan)
    assert share >= 0.95, f"{share:.3f} of the oracle's {oracle.speedup:.3f}x"
    assert reached_at <= budget, f"final plan first evaluated at call {reached_at}"
