"""The benchmark simulator (benchmarks/simulator.py): its oracle is exact, and autotune gets close to it cheaply."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from simulator import SimWorkload, brute_force, plan_of  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_oracle_finds_the_brute_forced_optimum_and_its_bound_holds(seed):
    sim = SimWorkload(8, seed=seed, eval_cost_s=0)
    best_plan, best_speedup = brute_force(sim)          # all 3^8 plans
    oracle = sim.oracle()
    assert sim.passes(oracle.plan)
    assert oracle.speedup == pytest.approx(best_speedup, rel=1e-12)   # it passes, so it cannot beat the optimum
    assert not sim.passes(sim.uniform("int8"))          # the optimum is a real mix, not all-int8
    # With the losses integerised coarsely, the oracle's plan (losses rounded up) still passes and the bound (the
    # same DP with losses rounded down) is still no lower than the optimum: they sandwich it.
    coarse = sim.oracle(bins=50)
    assert sim.passes(coarse.plan) and coarse.speedup <= best_speedup + 1e-12
    assert coarse.upper_bound >= best_speedup - 1e-12


def test_plan_of_reads_the_dtypes_back_from_lowered_modules():
    from autotune.plan import apply_plan
    sim = SimWorkload(3, eval_cost_s=0)
    plan = {"0": "int8", "1": "bf16", "2": "fp32"}
    assert plan_of(apply_plan(sim.model(), plan)) == plan
    assert sim.eval_fn(apply_plan(sim.model(), plan)) == pytest.approx(sim.accuracy(plan))


def test_autotune_with_the_sim_measurer_reaches_95_percent_of_the_oracle_within_2log2n_plus_8_calls(tmp_path):
    from autotune import MixedPrecisionConfig, TuningConfig, autotune
    from autotune.plan import plan_key
    from autotune.storage.study import evaluated_trials, trial_plan

    sim = SimWorkload(50, eval_cost_s=0)
    seen = []

    def eval_fn(model):
        seen.append(plan_of(model))
        return sim.eval_fn(model)

    budget = math.floor(2 * math.log2(50) + 8)              # 19 eval_fn calls: the baseline + 18 trials
    # The tuner may spend up to twice that: the claim is about what the first `budget` calls found.
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=2 * budget, storage=f"sqlite:///{tmp_path}/sim.db", study_name="sim50")
    result = autotune(sim.model(), config, eval_fn, sim.example_inputs(), measurer=sim.measurer())
    oracle = sim.oracle()

    trials = evaluated_trials(result.study)
    assert len(seen) == result.eval_calls
    assert [plan_key(plan) for plan in seen[1:1 + len(trials)]] == [plan_key(trial_plan(t)) for t in trials]
    early = max((sim.speedup(plan) for plan in seen[:budget] if sim.passes(plan)), default=1.0)
    assert early >= 0.95 * oracle.speedup, f"first {budget} calls: {early / oracle.speedup:.3f} of the oracle"
    share = sim.speedup(result.plan) / oracle.speedup
    assert sim.passes(result.plan)
    assert share >= 0.95, f"{share:.3f} of the oracle's {oracle.speedup:.3f}x"


def test_a_queued_plan_waits_holding_its_params_and_runs_as_exactly_that_plan(tmp_path):
    from optuna.trial import TrialState

    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.storage.study import trial_plan
    from autotune.tuner import start_runner
    sim = SimWorkload(12, eval_cost_s=0)
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          storage=f"sqlite:///{tmp_path}/sim.db", study_name="queued")
    runner = start_runner(sim.model(), config, sim.eval_fn, sim.example_inputs(), sim.measurer())
    plan = {unit: options[index % len(options)] for index, (unit, options) in enumerate(runner.space.choices.items())}
    runner.queue(plan, "guided")
    # Other workers read a waiting plan from its params: it is stored whole, before any worker runs it.
    assert [t.params for t in runner.study.get_trials(states=(TrialState.WAITING,))] == [plan]
    trial = runner.run_once()
    assert trial.state == TrialState.COMPLETE and trial.params == plan and trial.user_attrs["source"] == "guided"
    assert trial_plan(trial) == runner.space.expand(plan)


def test_a_worker_holds_the_turn_from_its_budget_read_until_its_trial_exists(tmp_path):
    """Two workers read the study at once, each saw one trial of budget left and started it: 13 trials of 12."""
    import threading
    import time

    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.search.driver import Budget
    from autotune.storage.study import evaluated_trials
    from autotune.tuner import start_runner
    sim = SimWorkload(12, eval_cost_s=0)
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          tolerable_loss=0.01, storage=f"sqlite:///{tmp_path}/sim.db", study_name="budget")
    first, second = (start_runner(sim.model(), config, sim.eval_fn, sim.example_inputs(), sim.measurer())
                     for _ in range(2))    # two workers of one study
    budget = Budget(max_trials=1, deadline=math.inf)
    reading, started = threading.Event(), []

    def slow_read() -> bool:      # the first worker is still deciding when the second asks
        reading.set()
        time.sleep(0.5)
        return budget.left(first)

    thread = threading.Thread(target=lambda: started.append(first.start_next(slow_read)))
    thread.start()
    assert reading.wait(30)
    late = second.start_next(lambda: budget.left(second))
    thread.join()
    assert started[0] is not None and late is None
    assert len(evaluated_trials(first.study)) == 1


def test_the_search_benchmark_rewrites_its_own_section_of_the_results_and_keeps_the_others(tmp_path):
    from harness import write_search_section
    results = tmp_path / "results.md"
    results.write_text("# Search-strategy benchmark\n\nold table\n\n## Workers\n\nkept\n\n## Deployment\n\nkept too\n")
    write_search_section(results, "# Search-strategy benchmark\n\nnew table\n")
    text = results.read_text()
    assert "new table" in text and "old table" not in text
    assert text.index("new table") < text.index("## Workers\n\nkept\n") < text.index("## Deployment\n\nkept too")
    first = tmp_path / "first.md"
    write_search_section(first, "# Search-strategy benchmark\n")      # no file yet: just the section
    assert first.read_text() == "# Search-strategy benchmark\n\n"


@pytest.mark.parametrize("phase", ["exhaustive", "sampler"])
@pytest.mark.parametrize("trial_timing", ["predicted", "measured"])
def test_the_search_past_its_guided_plans_stops_once_another_worker_passed_the_fastest_predicted_plan(
        tmp_path, phase, trial_timing):
    """A worker whose guided phase ended while another ran the fastest predicted plan saw it running and went on to
    `patience` trials; ranked by predicted latency, none of them could rank ahead of it once it passed. Timed trials
    may still find a plan running faster in the whole model, so there the trials go on."""
    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.search.driver import FASTEST_PASSED, Budget, Patience, run_exhaustive, run_sampler
    from autotune.storage.study import evaluated_trials
    from autotune.tuner import start_runner
    sim = SimWorkload(5, eval_cost_s=0)
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          tolerable_loss=0.5, patience=3, trial_timing=trial_timing,
                          storage=f"sqlite:///{tmp_path}/sim.db", study_name="fastest")
    first, second = (start_runner(sim.model(), config, sim.eval_fn, sim.example_inputs(), sim.measurer())
                     for _ in range(2))    # two workers of one study
    first.queue(first.space.fastest_plan(), "guided")
    assert first.run_once().user_attrs["passed"]
    patience = Patience(config.patience, second, ranked_by_prediction=trial_timing == "predicted")
    run = run_exhaustive if phase == "exhaustive" else run_sampler
    stopped = run(second, Budget(max_trials=40, deadline=math.inf), patience)
    later = len(evaluated_trials(second.study)) - 1
    if trial_timing == "predicted":
        assert (stopped, later) == (FASTEST_PASSED, 0)
    else:
        assert stopped.startswith("patience") and later >= config.patience, (stopped, later)
