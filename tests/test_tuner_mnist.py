"""The ccexam MNISTNet on real MNIST digits: the workload the README's demo tunes."""
import optuna
from conftest import RecordedEval, assert_one_call_per_trial, assert_state_equal, state_snapshot
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.plan import plan_key, uniform_plan
from autotune.search import SearchSpace
from autotune.storage.study import evaluated_trials, trial_plan
from autotune.workloads.mnist import accuracy_eval

MODULES = {"features.0", "features.3", "classifier.0", "classifier.2"}


def mnist_config(storage, max_trials):
    return TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp16", "fp32"]),
                        tolerable_loss=0.01, max_trials=max_trials, repeats=8, storage=storage, study_name="mnist")


def plans_in(study):
    return [plan_key(trial_plan(t)) for t in evaluated_trials(study)]


def assert_measured_dtypes_only(study, plans):
    """The pruning rule, read from what the study stored: a dtype whose module latency there is above fp32's for a
    module is never given to that module. (A dtype the whole-model check kept for a module despite a slower
    module timing is stored at exactly the module's fp32 cost, so it may be chosen: module_latency.confirm_in_context
    and SearchSpace.build.) Which dtypes that prunes depends on the host: none is assumed."""
    latency = study.user_attrs["autotune.module_latency_ms"]
    for plan in plans:
        for name, dtype in plan.items():
            assert latency[name][dtype] <= latency[name]["fp32"], \
                f"{name} in {dtype} although the study measured it slower than fp32: {latency[name]}"


def test_tuned_mnist_is_within_tolerance_faster_than_fp32_and_the_model_is_untouched(mnist_model, mnist_digits,
                                                                                      storage):
    before = state_snapshot(mnist_model)
    eval_fn = RecordedEval(accuracy_eval(*mnist_digits), MODULES)
    config = mnist_config(storage, max_trials=6)
    result = autotune(mnist_model, config, eval_fn)
    stored = optuna.load_study(study_name="mnist", storage=storage)   # plain Optuna reads it back
    trials = evaluated_trials(stored)
    # The winner may be a uniform finalist, which every engine gets over the dtypes timed however its modules timed
    # alone (ed3be31: the race times the whole model); any other winner keeps to the rule.
    timed = {name: list(costs) for name, costs in stored.user_attrs["autotune.module_latency_ms"].items()}
    uniform = {plan_key(uniform_plan(timed, dtype)) for dtype in ("int8", "bf16", "fp16")}
    winner = [] if plan_key(result.plan) in uniform else [result.plan]
    assert_measured_dtypes_only(stored, [*winner, *(trial_plan(t) for t in trials)])

    assert set(result.plan) == MODULES
    assert set(result.plan.values()) != {"fp32"}     # which dtypes are fastest depends on the host's CPU
    assert config.passes(result.baseline.accuracy, result.best.accuracy)
    assert config.passes(result.baseline.accuracy, eval_fn.eval_fn(result.model))   # independently re-checked
    assert result.speedup > 1.0                        # fp32 and tuned timed interleaved in one run
    assert result.best.weight_bytes < result.baseline.weight_bytes
    assert isinstance(result.model, nn.Module) and result.model is not mnist_model
    assert_state_equal(mnist_model, before)
    assert result.trials_evaluated <= 6

    assert len(trials) == result.trials_evaluated
    assert len(set(plans_in(stored))) == len(trials)  # no plan evaluated twice
    assert_one_call_per_trial(eval_fn, 0, result, trials)   # counted from eval_fn's own calls
    for trial in trials:
        assert set(trial.params) == MODULES
        assert {"accuracy", "latency_ms", "fp32_latency_ms", "passed", "weight_bytes"} <= set(trial.user_attrs)
        assert "accuracy" in trial.constraints
    assert stored.user_attrs["autotune.best"]["plan"] == result.plan


def test_calling_again_continues_the_study_without_evaluating_finished_plans(mnist_model, mnist_digits, storage):
    eval_fn = RecordedEval(accuracy_eval(*mnist_digits), MODULES)
    first = autotune(mnist_model, mnist_config(storage, max_trials=2), eval_fn)
    first_trials = evaluated_trials(first.study)
    assert len(first_trials) == 2
    assert_one_call_per_trial(eval_fn, 0, first, first_trials)
    first_calls = len(eval_fn.plans)
    kept = {t.number: (t.params, t.values) for t in first_trials}

    second = autotune(mnist_model, mnist_config(storage, max_trials=5), eval_fn)
    study = optuna.load_study(study_name="mnist", storage=storage)
    trials = evaluated_trials(study)
    attrs = study.user_attrs   # the pruned space is a measurement, so its size is read back, not assumed
    space = SearchSpace.build(attrs["autotune.candidates"], attrs["autotune.sensitivity"],
                              attrs["autotune.module_latency_ms"])
    assert len(trials) == min(5, space.size - 1)  # all-fp32 is the baseline, never a trial
    assert {t.number: (t.params, t.values) for t in trials if t.number in kept} == kept
    assert len(set(plans_in(study))) == len(trials)
    # The second run's calls: one baseline call (abandoned after its first batch), one per new trial, the winner's
    # re-check; none of them a plan the first run's trials evaluated.
    new = [t for t in trials if t.number not in kept]
    assert_one_call_per_trial(eval_fn, first_calls, second, new)
    assert not set(eval_fn.keys(first_calls + 1)[:len(new)]) & set(eval_fn.keys(1)[:len(first_trials)])
