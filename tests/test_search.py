import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from parallel_search import graded_space, replay  # noqa: E402

from autotune.plan import plan_key
from autotune.search.space import SearchSpace


def space(n, sensitive=()):
    """n modules; int8 halves each module's time; modules in `sensitive` carry large output error."""
    candidates = {f"m{i}": ["int8", "bf16", "fp16", "fp32"] for i in range(n)}
    latency = {name: {"fp32": 1.0, "int8": 0.5, "bf16": 0.7, "fp16": 4.0} for name in candidates}
    sensitivity = {name: {"fp32": 0.0, "bf16": 0.001, "fp16": 0.0001,
                          "int8": 0.5 if name in sensitive else 0.01} for name in candidates}
    return SearchSpace.build(candidates, sensitivity, latency)


def test_dtypes_slower_than_fp32_are_pruned_and_choices_sorted_fastest_first():
    s = space(3)
    assert s.choices["m0"] == ["int8", "bf16", "fp32"]
    assert s.size == 27
    assert s.fastest_plan() == {"m0": "int8", "m1": "int8", "m2": "int8"}


def test_knapsack_plan_is_the_fastest_plan_within_each_noise_budget():
    candidates = {f"m{i}": ["int8", "bf16", "fp32"] for i in range(4)}
    latency = {f"m{i}": {"fp32": 1.0 + i, "int8": 0.3 + 0.2 * i, "bf16": 0.6 + 0.5 * i} for i in range(4)}
    sensitivity = {f"m{i}": {"fp32": 0.0, "int8": 0.05 * (4 - i), "bf16": 0.004 * (i + 1)} for i in range(4)}
    s = SearchSpace.build(candidates, sensitivity, latency)
    plans = list(s.all_plans())
    for budget in (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1):
        plan = s.knapsack_plan(budget)
        assert s.predicted_noise(plan) <= budget
        # The integer knapsack rounds weights up: it may miss plans within a hair of the budget, no more.
        best = min(s.predicted_ms(p) for p in plans if s.predicted_noise(p) <= budget * 0.99)
        assert s.predicted_ms(plan) <= best + 1e-9


def test_uniform_plans_put_every_unit_in_one_dtype_where_allowed():
    s = space(3)
    plans = s.uniform_plans()
    assert [sorted(set(p.values())) for p in plans] == [["int8"], ["bf16"]]     # fp16 was pruned as slower


def test_groups_make_one_unit_that_shares_a_dtype():
    candidates = {name: ["int8", "fp32"] for name in ("attn.query", "attn.key", "attn.value", "out")}
    latency = {name: {"fp32": 1.0, "int8": 0.5} for name in candidates}
    sensitivity = {name: {"fp32": 0.0, "int8": 0.03} for name in candidates}
    s = SearchSpace.build(candidates, sensitivity, latency, [["attn.query", "attn.key", "attn.value"]])
    assert list(s.choices) == ["attn.{query,key,value}", "out"]
    assert s.size == 4
    assert s.latency_ms["attn.{query,key,value}"] == {"int8": 1.5, "fp32": 3.0}
    assert math.isclose(s.sensitivity["attn.{query,key,value}"]["int8"], 0.03 * math.sqrt(3))
    assert s.expand({"attn.{query,key,value}": "int8", "out": "fp32"}) == {
        "attn.query": "int8", "attn.key": "int8", "attn.value": "int8", "out": "fp32"}


def test_a_group_naming_an_unknown_or_doubly_grouped_module_is_a_config_error():
    from autotune.errors import ConfigError
    candidates = {"a": ["int8", "fp32"], "b": ["int8", "fp32"]}
    signals = {n: {"fp32": 0.0, "int8": 0.1} for n in candidates}
    with pytest.raises(ConfigError, match="groups.0: 'c' is not a tunable module"):
        SearchSpace.build(candidates, signals, signals, [["a", "c"]])
    with pytest.raises(ConfigError, match="groups.1: 'a' is already in group 0"):
        SearchSpace.build(candidates, signals, signals, [["a", "b"], ["a"]])


def test_qkv_siblings_are_found_per_attention_block():
    from autotune.discovery import qkv_groups
    names = ["l0.attn.query", "l0.attn.key", "l0.attn.value", "l0.out", "l1.attn.q_proj", "l1.attn.k_proj",
             "l1.attn.v_proj", "l2.attn.query", "l2.attn.key", "l3.attention.q_lin", "l3.attention.k_lin",
             "l3.attention.v_lin", "l3.attention.out_lin"]
    assert qkv_groups({n: ["fp32"] for n in names}) == [
        ["l0.attn.query", "l0.attn.key", "l0.attn.value"], ["l1.attn.q_proj", "l1.attn.k_proj", "l1.attn.v_proj"],
        ["l3.attention.q_lin", "l3.attention.k_lin", "l3.attention.v_lin"]]


def run_guided(s, passes, workers=1, loss=None):
    """The plans the guided search takes as `workers` workers run it (each evaluation one time unit), and the
    time the last one ended."""
    evaluations = replay(s, passes, workers, loss)
    return [plan for _, plan in evaluations], max((end for end, _ in evaluations), default=0)


def test_bisection_finds_the_passing_boundary_in_logarithmic_evaluations():
    n = 200
    s = space(n, sensitive={f"m{i}" for i in range(0, n, 10)})
    # Passes once every sensitive module has left int8.
    passes = lambda plan: all(plan[f"m{i}"] != "int8" for i in range(0, n, 10))
    evaluated, _ = run_guided(s, passes)
    assert passes(evaluated[-1]) or any(passes(p) for p in evaluated)
    best = min((p for p in evaluated if passes(p)), key=lambda p: sum(v != "int8" for v in p.values()))
    assert sum(v == "int8" for v in best.values()) == n - n // 10      # only the sensitive ones moved
    assert len(evaluated) <= 2 * math.log2(n) + 8


def test_workers_share_one_bisection_each_taking_a_plan_no_one_has_and_reach_the_boundary_sooner():
    n = 200
    s = space(n, sensitive={f"m{i}" for i in range(0, n, 10)})
    passes = lambda plan: all(plan[f"m{i}"] != "int8" for i in range(0, n, 10))

    def fastest_passing_ms(plans):
        return min(s.predicted_ms(p) for p in plans if passes(p))

    alone, alone_time = run_guided(s, passes)
    for workers in (2, 4):
        shared, shared_time = run_guided(s, passes, workers)
        assert len({plan_key(p) for p in shared}) == len(shared)      # no plan taken twice
        assert fastest_passing_ms(shared) <= fastest_passing_ms(alone)
        assert shared_time <= alone_time * {2: 0.85, 4: 0.5}[workers], (workers, shared_time, alone_time)
        assert len(shared) <= 2 * len(alone)         # speculation on outcomes still to come costs, boundedly


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("power", [1.0, 3.0, 0.4], ids=["linear", "convex", "concave"])
def test_measured_losses_place_the_budgets_reaching_as_fast_a_plan_in_fewer_evaluations(seed, power):
    from autotune.search.guided import LATENCY_RESOLUTION
    s = graded_space(120, seed)
    limit = s.predicted_noise(s.fastest_plan()) / 4          # the fastest plan loses 4 tolerances-worth or so
    loss = lambda plan: (s.predicted_noise(plan) / limit) ** power
    passes = lambda plan: loss(plan) <= 1
    bisected, _ = run_guided(s, passes)
    guided, _ = run_guided(s, passes, loss=loss)
    best_ms = lambda plans: min(s.predicted_ms(p) for p in plans if passes(p))
    assert best_ms(guided) <= best_ms(bisected) * (1 + 2 * LATENCY_RESOLUTION)
    assert len(guided) < len(bisected), (len(guided), len(bisected))


def test_the_search_stops_once_the_plans_left_differ_by_less_than_a_timing_could_tell(monkeypatch):
    from autotune.search import guided
    s = graded_space(200, 0)
    limit = s.predicted_noise(s.fastest_plan()) / 4
    passes = lambda plan: s.predicted_noise(plan) <= limit
    best_ms = lambda plans: min(s.predicted_ms(p) for p in plans if passes(p))
    stopped, _ = run_guided(s, passes)
    resolution = guided.LATENCY_RESOLUTION
    monkeypatch.setattr(guided, "LATENCY_RESOLUTION", 0.0)       # split down to the budget resolution alone
    exhaustive, _ = run_guided(s, passes)
    assert len(stopped) < len(exhaustive)
    # What the stop leaves on the table is within the resolution of the predicted time.
    assert best_ms(exhaustive) <= best_ms(stopped) <= best_ms(exhaustive) * (1 + resolution)


def test_guided_search_stops_at_once_when_the_fastest_plan_passes():
    assert len(run_guided(space(50), lambda plan: True)[0]) == 1


def test_a_uniform_plan_predicted_no_slower_is_tried_even_when_the_fastest_passes():
    candidates = {f"m{i}": ["int8", "fp32"] for i in range(3)}
    # m2's int8 was kept by the whole-model check: it costs what fp32 does, so the fastest plan leaves m2 fp32.
    latency = {"m0": {"fp32": 1.0, "int8": 0.5}, "m1": {"fp32": 1.0, "int8": 0.5}, "m2": {"fp32": 1.0, "int8": 1.0}}
    sensitivity = {name: {"fp32": 0.0, "int8": 0.01} for name in candidates}
    s = SearchSpace.build(candidates, sensitivity, latency)
    tried, _ = run_guided(s, lambda plan: True)
    assert tried == [{"m0": "int8", "m1": "int8", "m2": "fp32"}, {"m0": "int8", "m1": "int8", "m2": "int8"}]


def test_exhaustive_order_lists_every_plan_once_fastest_predicted_first():
    from autotune.search.guided import exhaustive_order
    s = space(3)
    plans = exhaustive_order(s)
    assert len({plan_key(p) for p in plans}) == len(plans) == s.size - 1     # all-fp32 is the baseline
    assert plans[0] == s.fastest_plan()
    assert all(any(d != "fp32" for d in p.values()) for p in plans)


def test_a_plan_holding_every_lowering_of_a_plan_that_missed_is_found():
    from autotune.search.guided import holds_a_missed_plan
    missed = [{"m0": "int8", "m1": "fp32", "m2": "bf16"}]
    assert holds_a_missed_plan({"m0": "int8", "m1": "int8", "m2": "bf16"}, missed)
    assert holds_a_missed_plan({"m0": "int8", "m1": "fp32", "m2": "bf16"}, missed)
    assert not holds_a_missed_plan({"m0": "int8", "m1": "int8", "m2": "int8"}, missed)    # m2 in another dtype
    assert not holds_a_missed_plan({"m0": "int8", "m1": "fp32", "m2": "fp32"}, missed)    # less lowered
    assert not holds_a_missed_plan({"m0": "int8", "m1": "int8", "m2": "bf16"}, [])


def test_min_cost_choice_matches_brute_force_on_random_instances():
    import itertools
    import random

    from autotune.search.knapsack import min_cost_choice
    rng = random.Random(0)
    for _ in range(30):
        items = rng.randint(1, 5)
        costs = [[rng.choice([1.0, 2.0, rng.random() * 3]) for _ in range(3)] for _ in range(items)]
        weights = [[0] + [rng.randint(0, 12) for _ in range(2)] for _ in range(items)]
        capacity = rng.randint(0, 15)
        picks = min_cost_choice(costs, weights, capacity)
        assert sum(w[p] for w, p in zip(weights, picks)) <= capacity
        best = min(sum(c[p] for c, p in zip(costs, choice)) for choice in itertools.product(range(3), repeat=items)
                   if sum(w[p] for w, p in zip(weights, choice)) <= capacity)
        assert math.isclose(sum(c[p] for c, p in zip(costs, picks)), best)


def test_min_cost_choice_takes_the_first_of_options_that_tie():
    from autotune.search.knapsack import min_cost_choice
    assert min_cost_choice([[1.0, 1.0]], [[0, 0]], 4) == [0]
    assert min_cost_choice([[2.0, 1.0, 1.0], [1.0, 1.0]], [[0, 1, 1], [0, 0]], 1) == [1, 0]
    assert min_cost_choice([[2.0, 1.0]], [[0, 5]], 4) == [0]       # the cheaper option does not fit


def test_no_trial_starts_that_the_longest_trial_so_far_says_would_end_past_the_deadline():
    """A BERT-base trial started 5 s before the search's share of the timeout ended 88 s past it, in the quarter
    kept for the compiling engines, which then built nothing."""
    import datetime
    import time
    from types import SimpleNamespace

    import optuna
    from optuna.trial import FrozenTrial, TrialState

    from autotune.search.driver import TIMEOUT_REACHED, Budget
    from autotune.storage.study import view_trials

    study, now = optuna.create_study(), datetime.datetime.now()
    for number, seconds in enumerate([8.0, 30.0, 10.0, 2.0]):   # the third a failed evaluation: it took time too
        study.add_trial(FrozenTrial(
            number, TrialState.FAIL if number == 2 else TrialState.COMPLETE, None if number == 2 else 1.0,
            now - datetime.timedelta(seconds=seconds), now, {}, {}, {"evaluated": True, "fail_reason": "missed"},
            {}, {}, number))
    assert view_trials(study).longest_trial_s == pytest.approx(30.0)
    budget = Budget(max_trials=100, deadline=time.monotonic() + 20)
    assert budget.spent(SimpleNamespace(evaluated=4, in_flight=0, trial_s=9.0)) is None
    assert budget.spent(SimpleNamespace(evaluated=4, in_flight=0, trial_s=25.0)) == TIMEOUT_REACHED


def test_trials_under_way_count_against_max_trials():
    """Counted only once ended, four workers each started one more trial at the budget's last step, and a dead
    worker's plan, queued again, ran after the stop: 9 evaluated of max_trials 8."""
    import time
    from types import SimpleNamespace

    from autotune.search.driver import Budget

    budget = Budget(max_trials=8, deadline=time.monotonic() + 60)
    assert budget.spent(SimpleNamespace(evaluated=7, in_flight=0, trial_s=0.0)) is None
    assert budget.spent(SimpleNamespace(evaluated=7, in_flight=1, trial_s=0.0)) == \
        "max_trials (8) evaluated trials reached"
    assert budget.spent(SimpleNamespace(evaluated=5, in_flight=3, trial_s=0.0)) is not None
    # A study of 10 resumed with max_trials 6 said "max_trials (6) evaluated trials reached" beside "10 evaluated".
    assert budget.spent(SimpleNamespace(evaluated=10, in_flight=0, trial_s=0.0)) == \
        "the study holds 10 evaluated trials, past max_trials (8)"


def test_before_any_trial_the_baselines_eval_fn_call_says_how_long_a_trial_takes(tmp_path):
    """The first trial had no other to go by, and one begun just before the search's deadline ran on past it."""
    import time

    import torch
    from torch import nn

    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.tuner import start_runner

    def slow_eval(model):
        time.sleep(0.3)
        return 1.0

    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          storage=f"sqlite:///{tmp_path}/b.db", study_name="b")
    runner = start_runner(nn.Sequential(nn.Linear(4, 4)).eval(), config, slow_eval, torch.randn(2, 4))
    runner.refresh()
    assert runner.longest_trial_s == 0.0 and runner.trial_s >= 0.3
    assert runner.study.user_attrs["autotune.baseline_eval_s"] >= 0.3
