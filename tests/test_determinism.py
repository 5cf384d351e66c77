"""Determinism: the same seed, model and eval give the same sequence of trial plans.

On a real device the only thing that varies between two runs is measured latency (signals and trial timings);
the simulator's measurer is seeded, so two fresh studies must agree trial by trial, through the guided phase
and Optuna's TPE phase alike.
"""
import sys
from pathlib import Path

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.storage.study import trial_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from simulator import SimWorkload  # noqa: E402


def trial_sequence(storage: str, study_name: str, seed: int) -> list[tuple]:
    sim = SimWorkload(30, eval_cost_s=0)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=24, patience=100, repeats=3, seed=seed, storage=storage, study_name=study_name)
    result = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())
    return [(t.user_attrs.get("source", "sampler"), tuple(sorted(trial_plan(t).items())))
            for t in result.study.trials]


def test_same_seed_same_trial_plans(storage):
    first = trial_sequence(storage, "first", seed=7)
    second = trial_sequence(storage, "second", seed=7)
    assert [source for source, _ in first].count("sampler") >= 5, "the TPE phase should have run too"
    assert first == second
