"""Determinism: the same seed, model and eval give the same sequence of trial plans.

On a real device the only thing that varies between two runs is measured latency (signals and trial timings);
the simulator's measurer is seeded, so two fresh studies must agree trial by trial, through the guided phase
and Optuna's TPE phase alike.
"""
import sys
from pathlib import Path

import optuna
import torch
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.search import EXHAUSTIVE_LIMIT, SearchSpace
from autotune.storage.study import trial_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from simulator import SimWorkload  # noqa: E402


def trial_sequence(storage: str, study_name: str, seed: int) -> list[tuple]:
    sim = SimWorkload(30, eval_cost_s=0)
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=24, patience=100, repeats=3, seed=seed, storage=storage, study_name=study_name)
    result = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())
    return [(t.user_attrs.get("source", "sampler"), tuple(sorted(trial_plan(t).items())))
            for t in result.study.trials]


def test_same_seed_same_trial_plans(storage):
    first = trial_sequence(storage, "first", seed=7)
    second = trial_sequence(storage, "second", seed=7)
    assert [source for source, _ in first].count("sampler") >= 5, "the TPE phase should have run too"
    assert first == second


def linear_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)]).eval()


def test_same_stored_signals_same_trial_plans_with_the_real_device_measurer(storage):
    """On a real device (the CPU here, with DeviceMeasurer timing every trial), what is deterministic: with the
    same seed, model, eval and the same per-module signals, which the study keeps once measured, the guided and
    exhaustive phases run the same plans in the same order, whatever the trials' timings. (Patience and Optuna's
    TPE read the measured trial latencies, so this run sets patience out of reach and keeps to a space of at most
    256 plans.)"""
    inputs = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = linear_stack()(inputs)

    def eval_fn(net):
        with torch.inference_mode():
            return nn.functional.cosine_similarity(net(inputs), reference, dim=1).mean().item()

    def run(study_name: str) -> list[tuple]:
        config = TuningConfig(engines=["eager"],
                              config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=1e-4,
                              max_trials=12, patience=1000, warmup=1, repeats=3, seed=3, storage=storage,
                              study_name=study_name)
        result = autotune(linear_stack(), config, eval_fn, example_inputs=inputs)
        assert result.study.user_attrs["autotune.candidates"] and SearchSpace.build(
            result.study.user_attrs["autotune.candidates"], result.study.user_attrs["autotune.sensitivity"],
            result.study.user_attrs["autotune.module_latency_ms"]).size <= EXHAUSTIVE_LIMIT
        return [(t.user_attrs.get("source", "sampler"), tuple(sorted(trial_plan(t).items())))
                for t in result.study.trials]

    # The per-module signals are stored ahead, as a resumed run or another worker reads them back: what is
    # timed is each trial's model. (Signals measured here would, on a loaded host, sometimes time int8 slower
    # than fp32 for every module and leave no plan to search.)
    for name in ("first", "second"):
        study = optuna.create_study(study_name=name, storage=storage)
        study.set_user_attr("autotune.sensitivity", {f"{i}.0": {"fp32": 0.0, "int8": 0.004 * (i + 1), "bf16": 1e-4}
                                                     for i in range(4)})
        study.set_user_attr("autotune.module_latency_ms", {f"{i}.0": {"fp32": 1.0, "int8": 0.5 + 0.1 * i,
                                                                      "bf16": 3.0} for i in range(4)})
    first, second = run("first"), run("second")
    assert "guided" in {source for source, _ in first} and len(first) > 1
    assert first == second
