"""Trial-level behaviour on a model whose int8 layers are measurably faster than fp32."""
import copy
import logging
import re
import time

import pytest
import torch
from click.testing import CliRunner
from conftest import assert_state_equal, state_snapshot
from optuna.trial import TrialState
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.backends.int8_linear import DynamicInt8Linear
from autotune.errors import EvalFunctionError

INPUTS = torch.randn(512, 1024)


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(3)])


def fidelity_eval(reference_model):
    with torch.inference_mode():
        reference = reference_model(INPUTS)

    def eval_fn(model):
        with torch.inference_mode():
            return nn.functional.cosine_similarity(model(INPUTS), reference, dim=1).mean().item()
    return eval_fn


def test_a_trial_whose_eval_fn_raises_is_failed_with_its_reason_and_never_wins(storage, caplog):
    model = wide_model()
    before = state_snapshot(model)
    score = fidelity_eval(model)

    def eval_fn(net):
        if isinstance(net[1][0], DynamicInt8Linear):
            raise RuntimeError("kernel crashed on layer 1\nwhile running the graph:\n  %3 = quantized_linear(...)")
        return score(net)

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          max_trials=8, repeats=5, storage=storage, study_name="failing")
    result = autotune(model, config, eval_fn, example_inputs=INPUTS)

    failed = [t for t in result.study.trials if t.state == TrialState.FAIL]
    assert failed, "the plan with int8 on layer 1 should have been tried first (it is the fastest)"
    # The study keeps the whole message; the log says it in one line per failed trial.
    assert all(t.user_attrs["fail_reason"].startswith("RuntimeError: kernel crashed on layer 1\nwhile running the")
               for t in failed)
    warned = [r.getMessage() for r in caplog.records if " failed: " in r.getMessage()]
    assert len(warned) == len(failed) and all(m.endswith("failed: RuntimeError: kernel crashed on layer 1")
                                              for m in warned)
    assert all(t.params["1.0"] == "int8" for t in failed)
    assert result.plan["1.0"] == "fp32"
    assert any(t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated") for t in result.study.trials)
    assert_state_equal(model, before)
    # The summary and `show` say why: a study whose every trial failed read as a search that found nothing faster.
    said = f"{len(failed)} failed: RuntimeError: kernel crashed on layer 1"
    assert f"evaluated trials ({said}); " in result.summary()
    from optuna.trial import create_trial

    from autotune.cli.study_commands import show
    result.study.add_trial(create_trial(state=TrialState.FAIL))    # its process died mid-trial: no reason
    shown = CliRunner().invoke(show, ["failing", "--storage", storage])
    numbers = ", ".join(str(t.number) for t in failed)
    assert f"trial{'s' if len(failed) > 1 else ''} {numbers} failed: RuntimeError: kernel crashed on layer 1\n" \
        in shown.output, shown.output
    assert shown.output.count(" stopped\n") == 1 and "stopped: its process was interrupted or died" in shown.output
    # An error is told from a plan that missed the tolerance (FAIL) otherwise than by case, as the report does.
    assert shown.output.count(" error\n") == len(failed) and " fail\n" not in shown.output


def test_the_users_model_is_untouched_when_tuning_raises(storage):
    model = wide_model()
    before = state_snapshot(model)

    def eval_fn(net):
        net(INPUTS)
        net[0][0].weight.data.zero_()   # an eval_fn that tampers with what it is given
        raise ValueError("boom")

    with pytest.raises(EvalFunctionError, match="the fp32 baseline evaluation failed.*ValueError: boom"):
        autotune(model, TuningConfig(storage=storage, repeats=3), eval_fn)
    assert_state_equal(model, before)


def test_a_model_in_training_mode_is_tuned_in_eval_mode_and_the_user_is_told(storage, caplog):
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.5), nn.ReLU(), nn.Linear(1024, 16)).train()
    before = state_snapshot(model)
    modes: list[bool] = []
    score = fidelity_eval(copy.deepcopy(model).eval())

    def eval_fn(net):
        modes.append(net.training)
        return score(net)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(model, TuningConfig(storage=storage, engines=["eager"], max_trials=3, repeats=3), eval_fn,
                          example_inputs=INPUTS[:64])
    assert "the model is in training mode (dropout on):" in caplog.text and "returned in eval mode" in caplog.text
    assert modes and not any(modes)   # every evaluation saw the model in eval mode
    assert not result.model.training and model.training   # the user's model keeps its mode and weights
    assert_state_equal(model, before)


@pytest.mark.parametrize("case, warned", [("quantized part", False), ("one dropout training", True)])
def test_only_a_module_whose_mode_changes_what_it_computes_makes_an_eval_model_said_in_training(storage, caplog,
                                                                                                  case, warned):
    """A model in eval mode with one Linear replaced by the user through quantize_dynamic (which leaves that module
    in training mode, computing alike in both) was said to be "in training mode"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8)).eval()
    if case == "quantized part":
        model[3] = torch.ao.quantization.quantize_dynamic(nn.Sequential(model[3]), {nn.Linear})[0]
        assert model[3].training and not model.training
    else:
        model[1].train()
    x = torch.randn(16, 64)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        autotune(model, TuningConfig(storage=storage, engines=["eager"], max_trials=2, repeats=3),
                 lambda net: net(x).abs().mean().item(), example_inputs=x)
    assert ("the model is in training mode" in caplog.text) is warned, caplog.text


class Branches(nn.Module):
    """Takes branch `a` or `b` by the sign of its batch's sum: eval_fn's first batch reaches `a` alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b = (nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(2))
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(self.a(x) if x.sum() > 0 else self.b(x))


def test_modules_holding_much_of_the_model_that_the_captured_batch_never_reached_are_warned_of(storage, caplog):
    """A branch reached only by eval_fn's later batches held half the weights: it stayed fp32, left out of the
    plan, said at INFO only."""
    torch.manual_seed(0)
    batches = [torch.randn(16, 64).abs() * sign for sign in (1, -1, 1, -1)]

    def eval_fn(net):
        return sum(net(x).abs().mean().item() for x in batches)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(Branches().eval(), TuningConfig(storage=storage, engines=["eager"], max_trials=2,
                                                          repeats=3), eval_fn)
    assert not any(name.startswith("b.") for name in result.plan)
    assert re.search(r"2 tunable modules \(\d+ % of the weights\) are never called by the forward on the captured "
                     r"batch .*give example_inputs that do.*: b\.0, b\.2", caplog.text), caplog.text


SLEEPS = {"started": 0, "finished": 0}


def _sleep_past_timeout(net):
    SLEEPS["started"] += 1
    time.sleep(30)
    SLEEPS["finished"] += 1


@pytest.mark.parametrize("failure,reason", [
    (lambda net: float("nan"), "EvalFunctionError: eval_fn returned nan, not a finite number"),
    (lambda net: float("inf"), "EvalFunctionError: eval_fn returned inf, not a finite number"),
    (lambda net: None, "EvalFunctionError: eval_fn must return a number; it returned NoneType"),
    (lambda net: "0.99", "EvalFunctionError: eval_fn must return a number; it returned str"),
    (_sleep_past_timeout, "EvalTimeoutError: eval_fn ran past the per-trial timeout of 1 s"),
])
def test_a_trial_whose_eval_fn_gives_no_number_or_runs_too_long_fails_with_the_reason(storage, failure, reason):
    model = wide_model()
    score = fidelity_eval(model)

    def eval_fn(net):
        return failure(net) if isinstance(net[1][0], DynamicInt8Linear) else score(net)

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          max_trials=8, repeats=3, trial_timeout=1, storage=storage, study_name="bad-returns")
    SLEEPS.update(started=0, finished=0)
    result = autotune(model, config, eval_fn, example_inputs=INPUTS)

    failed = [t for t in result.study.trials if t.state == TrialState.FAIL]
    assert failed and all(t.user_attrs["fail_reason"].startswith(reason) for t in failed)
    assert any(t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated") for t in result.study.trials)
    assert result.plan["1.0"] == "fp32"
    # The sleeping eval_fn was cut off, not waited for: every sleep it began was interrupted (counted, not timed).
    assert SLEEPS["finished"] == 0 and SLEEPS["started"] == (len(failed) if failure is _sleep_past_timeout else 0)


def test_the_collector_threshold_is_raised_during_tuning_and_restored_after_even_on_error(storage):
    import gc
    before = gc.get_threshold()
    seen = []

    def eval_fn(net):
        seen.append(gc.get_threshold()[0])
        raise KeyboardInterrupt   # not an eval_fn failure: it ends the run

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          max_trials=4, repeats=3, storage=storage, study_name="gc")
    with pytest.raises(KeyboardInterrupt):
        autotune(nn.Sequential(nn.Linear(8, 8)), config, eval_fn, example_inputs=torch.randn(2, 8))
    assert seen and all(threshold >= 20_000 for threshold in seen)
    assert gc.get_threshold() == before


def layer1_int8_misses(net):
    """An eval_fn: the model misses the tolerance where layer 1 is in int8."""
    with torch.inference_mode():
        net(INPUTS[:4])
    return 0.5 if isinstance(net[1][0], DynamicInt8Linear) else 1.0


def test_a_plan_that_misses_the_tolerance_is_not_timed_and_its_ratio_is_predicted(storage):
    from conftest import HalfCostMeasurer

    from autotune.plan import plan_of
    from autotune.storage.study import evaluated_trials

    names = ["0.0", "1.0", "2.0"]
    timed_plans = []

    class Recording(HalfCostMeasurer):
        def latency(self, models, inputs, repeats, warmup=None):
            timed_plans.extend(plan_of(m, self.names)["1.0"] for name, m in models.items() if name != "fp32")
            return super().latency(models, inputs, repeats)

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.01,
                          max_trials=8, storage=storage)
    result = autotune(wide_model(), config, layer1_int8_misses, INPUTS, measurer=Recording(names))
    trials = evaluated_trials(result.study)
    failing = [t for t in trials if not t.user_attrs["passed"]]
    assert failing and all(t.user_attrs["latency_measured"] is False for t in failing)
    for trial in failing:   # HalfCostMeasurer's module costs: 1 per fp32 module, 0.5 per int8 one
        lowered = sum(d == "int8" for d in trial.user_attrs["plan"].values())
        assert trial.values[0] == pytest.approx((3 - 0.5 * lowered) / 3)
        assert trial.user_attrs["latency_by_shape"] is None
    assert "int8" not in timed_plans     # no failing plan's model was ever timed
    assert all(t.user_attrs["latency_measured"] for t in trials if t.user_attrs["passed"])
    assert result.plan["1.0"] == "fp32" and result.plan["0.0"] == result.plan["2.0"] == "int8"


def test_with_predicted_trial_timing_only_the_finalists_are_timed_and_the_same_plan_wins(storage):
    from conftest import HalfCostMeasurer

    from autotune.storage.study import evaluated_trials

    class Counting(HalfCostMeasurer):
        def __init__(self):
            super().__init__(["0.0", "1.0", "2.0"])
            self.timed = []

        def latency(self, models, inputs, repeats, warmup=None):
            self.timed.extend(name for name in models if name != "fp32")
            return super().latency(models, inputs, repeats)

    runs = {}
    for timing in ("measured", "predicted"):
        config = TuningConfig(engines=["eager"],
                              config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.01,
                              max_trials=8, storage=storage, study_name=timing, trial_timing=timing)
        measurer = Counting()
        runs[timing] = autotune(wide_model(), config, layer1_int8_misses, INPUTS, measurer=measurer), measurer.timed
    measured, predicted = runs["measured"][0], runs["predicted"][0]
    trials = evaluated_trials(predicted.study)
    passing = [t for t in trials if t.user_attrs["passed"]]
    assert passing and not any(t.user_attrs["latency_measured"] for t in trials)
    for trial in passing:   # HalfCostMeasurer's module costs: 1 per fp32 module, 0.5 per int8 one
        lowered = sum(d == "int8" for d in trial.user_attrs["plan"].values())
        assert trial.values[0] == pytest.approx((3 - 0.5 * lowered) / 3)
    assert len(runs["predicted"][1]) < len(runs["measured"][1])     # what the trials timed, the finalists did not
    assert len(runs["predicted"][1]) <= len(runs["measured"][1]) - len(passing)
    assert predicted.plan == measured.plan and predicted.plan["1.0"] == "fp32"
    assert predicted.speedup == pytest.approx(measured.speedup)      # the winner itself is timed either way


def test_trial_timing_takes_measured_or_predicted_only():
    with pytest.raises(ValueError, match="trial_timing"):
        TuningConfig(trial_timing="sometimes")


def test_a_run_started_again_after_its_search_stopped_on_patience_spends_no_more_trials(storage, caplog):
    """Patience counts the study's trials, not one run's: a run killed while verifying its winner, started again,
    goes back to the verification instead of searching `patience` more plans."""
    caplog.set_level(logging.INFO, logger="autotune")
    model = wide_model()
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.5, max_trials=20, patience=1, repeats=3, storage=storage,
                          study_name="patient")
    first = autotune(model, config, fidelity_eval(model), example_inputs=INPUTS)
    evaluated = [t.number for t in first.study.trials if t.user_attrs.get("evaluated")]
    assert len(evaluated) < 2 ** 3 - 1, "the search should stop on patience, with plans of the space left"
    assert any("search stopped: patience" in r.getMessage() for r in caplog.records)
    caplog.clear()

    again = autotune(model, config, fidelity_eval(model), example_inputs=INPUTS)
    assert [t.number for t in again.study.trials if t.user_attrs.get("evaluated")] == evaluated
    assert any("search stopped: patience" in r.getMessage() for r in caplog.records)
    assert again.eval_calls <= 1      # the winner's re-evaluation: the baseline is the study's


def test_a_model_handed_over_compiled_or_holding_compiled_blocks_is_tuned_as_the_modules_they_compile(storage,
                                                                                                    caplog):
    """Trials run eagerly and the engines compile the finalists; handed torch.compile wrappers, dynamo traced the
    signals' hooked calls and the run grew past 6 GB of memory within a minute."""
    model = wide_model()
    model[1] = torch.compile(model[1])    # a block the user compiled
    names = [name for name, _ in model.named_modules()]
    with caplog.at_level(logging.INFO, logger="autotune"):
        result = autotune(torch.compile(model), TuningConfig(storage=storage, engines=["eager"], max_trials=2,
                                                             repeats=3),
                          fidelity_eval(model), example_inputs=INPUTS[:64])
    assert "the model holds torch.compile wrappers: the modules they compile are tuned" in caplog.text
    assert set(result.plan) == {"0.0", "1.0", "2.0"}          # module names without the wrappers' _orig_mod
    assert result.study.study_name.startswith("Sequential-")
    assert [name for name, _ in model.named_modules()] == names   # the user's model keeps its wrappers


def test_the_users_forward_hooks_still_run_in_the_tuned_model_on_modules_it_lowered(storage, caplog):
    class Collect:     # a hook object, as features are usually taken: the tuned model runs this one, not a copy
        def __init__(self):
            self.shapes = []

        def __call__(self, module, args, out):
            self.shapes.append(out.shape)

    model, hook = wide_model(), Collect()
    collected = hook.shapes
    model[1][0].register_forward_hook(hook)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          max_trials=4, storage=storage, engines=["eager", "compiled"])
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(model, config, fidelity_eval(model))
    assert result.plan["1.0"] == "int8" and isinstance(result.model[1][0], DynamicInt8Linear)
    # An exported graph would run the hook's arithmetic but not its side effects: that engine is left out.
    assert "the compiled engine is not used: forward hooks are registered on 1.0, which this engine's exported " \
           "graph would not call" in caplog.text
    collected.clear()
    with torch.inference_mode():
        result.model(INPUTS)
    assert collected == [(512, 1024)]


def test_a_timeout_spent_before_the_search_began_is_said_as_a_warning(storage, caplog):
    """The baseline and the per-module timings are not cut short by `timeout`: where they take all of it, the run
    tried no plan, and said so only as "search stopped: timeout reached" at INFO (a ConvBERT under load: 251 s of
    signals, timeout 240, 0 trials)."""
    model = wide_model()
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=8, repeats=3, timeout=0.01, storage=storage)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(model, config, fidelity_eval(model), example_inputs=INPUTS)
    assert not [t for t in result.study.trials if t.user_attrs.get("evaluated")]
    said = [r.getMessage() for r in caplog.records if "passed before it began" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("the search's part of the run's timeout (0.01 of 0.01 s) passed "
                                                 "before it began: the baseline and the per-module timings took ")


def test_a_timeout_that_leaves_no_time_for_a_trial_is_said_as_a_warning(storage, caplog):
    """A trial as long as the baseline's eval_fn call would end past the search's part of the timeout: none
    starts, and the run says why."""
    def slow_eval(model):
        time.sleep(3.0)
        return 1.0

    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          max_trials=8, repeats=3, timeout=5.0, storage=storage)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(nn.Sequential(nn.Linear(4, 4)).eval(), config, slow_eval, example_inputs=torch.randn(2, 4))
    assert not [t for t in result.study.trials if t.user_attrs.get("evaluated")]
    assert "the search's part of the run's timeout (5 of 5 s) leaves no time for a trial: the baseline and the " \
           "per-module timings took 3 s, and a trial takes about 3 s, so this run tries no plan" in caplog.text


@pytest.mark.parametrize("engines, part", [(["eager"], 1.0), (["eager", "inductor"], 0.75)])
def test_with_a_compiling_engine_the_search_leaves_a_quarter_of_the_timeout_to_the_finalists(engines, part, storage,
                                                                                             monkeypatch):
    """A search spending the whole timeout left no engine compiled: a KAN returned eager int8 at 0.75x where
    torch.compile ran it 3x faster or more."""
    from autotune import tuner
    left = []

    def deadline_seen(runner, config, deadline, should_stop=None):
        left.append(deadline - time.monotonic())
        return "timeout reached"

    monkeypatch.setattr(tuner, "run_search", deadline_seen)
    model = wide_model()
    config = TuningConfig(engines=engines, config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=8, repeats=3, timeout=1000, storage=storage)
    stopped = tuner.search(tuner.start_runner(model, config, fidelity_eval(model), INPUTS), time.monotonic())
    assert len(left) == 1 and 1000 * part - 60 < left[0] <= 1000 * part
    assert stopped == ("timeout reached" if part == 1.0 else
                       "its part of the timeout reached (750 of 1000 s; the rest is the finalists')")


class TrainingModeSeen:
    """HalfCostMeasurer's figures, noting whether any model it timed had a module in training mode."""

    def __init__(self, names):
        from conftest import HalfCostMeasurer
        self.costs, self.timed_in_training = HalfCostMeasurer(names), []

    def sensitivity(self, *args):
        return self.costs.sensitivity(*args)

    def module_latency(self, *args):
        return self.costs.module_latency(*args)

    def latency(self, models, inputs, repeats, warmup=None):
        self.timed_in_training += [any(m.training for m in model.modules()) for model in models.values()]
        return self.costs.latency(models, inputs, repeats, warmup)


def test_an_eval_fn_that_ends_with_model_train_leaves_the_model_timed_and_returned_in_eval_mode(tmp_path):
    """A training loop's evaluate() switches the model back to training: the tuned model came back with dropout
    on, its outputs random."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)

    def evaluate(net):
        net.eval()
        with torch.no_grad():
            score = float(torch.isfinite(net(x)).all())
        net.train()
        return score

    measurer = TrainingModeSeen(["0", "2"])
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.5, max_trials=4, storage=f"sqlite:///{tmp_path}/t.db", study_name="t")
    result = autotune(model, config, evaluate, x, measurer=measurer)
    assert set(result.plan.values()) == {"int8"}
    assert not any(m.training for m in result.model.modules()) and not any(measurer.timed_in_training)
    with torch.no_grad():
        assert torch.equal(result.model(x), result.model(x))


@pytest.mark.parametrize("max_trials", [1, 2])
def test_the_guided_phase_stops_at_max_trials(tmp_path, max_trials):
    """max_trials is an evaluation budget (INC's): 1 ran two seeds, the count read before the last trial ended."""
    from conftest import HalfCostMeasurer, fidelity

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval(), \
        torch.randn(4, 8)
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          tolerable_loss=1e-9, max_trials=max_trials, storage=f"sqlite:///{tmp_path}/m.db")
    result = autotune(model, config, fidelity(model, x), x, measurer=HalfCostMeasurer(["0", "2", "4"]))
    assert result.trials_evaluated == max_trials


def test_a_search_left_nothing_but_fp32_says_why_in_the_summary(storage):
    """Every lower dtype slower than fp32 in every module: the run evaluated 0 of its max_trials, and the Python
    API's summary said only "0 evaluated trials"; the search's own reason, "every plan of the space was tried",
    said nothing of the pruning."""
    from conftest import HalfCostMeasurer

    class LoweredIsSlower(HalfCostMeasurer):
        def module_latency(self, fp32, candidates, inputs, calibration):
            return {name: {d: 1.0 if d == "fp32" else 3.0 for d in dtypes} for name, dtypes in candidates.items()}

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), engines=["eager"], max_trials=8,
                          storage=storage)
    result = autotune(model, config, lambda m: 1.0, x, measurer=LoweredIsSlower(["0", "2"]))
    assert result.trials_evaluated == 0 and result.stopped.startswith("no plan to try but fp32: every module's")
    assert f"search stopped: {result.stopped}" in result.summary()
    # Two plans left of max_trials 8 read as a bug where the pruning went unnamed.
    some = autotune(model, config.model_copy(update={"study_name": "some"}), lambda m: 1.0, x,
                    measurer=HalfCostMeasurer(["0", "2"]))
    assert some.stopped == ("every plan of the space was tried (4 in all: the dtypes left to each module once the "
                            "signals pruned those slower than fp32 or losing too much alone; `autotune show` lists "
                            "them)"), some.stopped


@pytest.mark.parametrize("misses", [True, False])
def test_the_exhaustive_search_spends_no_call_on_a_plan_holding_every_lowering_of_one_that_missed(storage, misses):
    """Lowering more modules only adds error: in a space of 8 plans, where int8 in the first Linear (the least
    sensitive by the signals) misses alone, the two plans adding int8 elsewhere to it are left out, not run. A
    trial that raised says nothing of accuracy: there they are run."""
    from conftest import HalfCostMeasurer

    from autotune.plan import plan_of

    class FirstLooksSafest(HalfCostMeasurer):
        def sensitivity(self, fp32, candidates, inputs, calibration):
            return {name: {d: 0.0 if d == "fp32" else 1e-4 if name == "0" else 1e-2 for d in dtypes}
                    for name, dtypes in candidates.items()}

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    names, seen = ["0", "2", "4"], []

    def eval_fn(net):
        seen.append(plan_of(net, names))
        if seen[-1]["0"] == "int8" and not misses and len(seen) > 2:   # the fastest plan, the second call, misses
            raise RuntimeError("out of memory")
        return 0.0 if seen[-1]["0"] == "int8" else 1.0

    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), max_trials=20,
                          storage=storage)
    result = autotune(model, config, eval_fn, torch.randn(4, 8), measurer=FirstLooksSafest(names))
    lowered = [{name for name, dtype in plan.items() if dtype == "int8"} for plan in seen]
    assert {"0"} in lowered, "the guided search should have tried int8 in the first Linear alone"
    assert set(result.plan.values()) == {"fp32", "int8"} and result.plan["0"] == "fp32"
    if misses:
        assert {"0", "2"} not in lowered and {"0", "4"} not in lowered, lowered
        assert result.stopped.endswith("; 2 left out, each holding every lowering of a plan that missed)")
        assert result.trials_evaluated == 5       # of the 7 plans but fp32
    else:
        assert {"0", "2"} in lowered and {"0", "4"} in lowered, lowered
        assert result.stopped.startswith("every plan of the space was tried (")


def test_a_trial_another_process_failed_as_stale_while_it_ran_is_dropped_and_the_run_goes_on(storage, caplog):
    """A worker paused mid-trial (SIGSTOP, a VM paused) or cut off from its database stops beating its trial's
    heartbeat; another worker fails that trial as stale and queues its plan again. The first, resumed, wrote its
    result into a finished trial and failed its whole job: `ValueError: Cannot tell a FAIL trial.`"""
    import optuna

    model = wide_model()
    score, failed = fidelity_eval(model), []

    def eval_fn(net):
        study = optuna.load_study(study_name="lost", storage=storage)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if running and not failed:    # as another worker's stale-trial check does, mid-evaluation
            failed.append(running[0].number)
            study.tell(running[0].number, state=TrialState.FAIL)
        return score(net)

    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), engines=["eager"], max_trials=3,
                          patience=10, repeats=3, storage=storage, study_name="lost")
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = autotune(model, config, eval_fn, INPUTS[:64])
    lost = result.study.trials[failed[0]]
    assert lost.state == TrialState.FAIL
    assert f"trial {failed[0]} was failed by another process while this one ran it" in caplog.text
    assert result.trials_evaluated == 3 and lost.number not in {t.number for t in result.study.trials
                                                                if t.state == TrialState.COMPLETE}


class TiedCells(nn.Module):
    """Six Linear cells tied to one weight and bias, unrolled, as a small recurrent model writes them."""

    def __init__(self):
        super().__init__()
        self.cells = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        for cell in self.cells[1:]:
            cell.weight, cell.bias = self.cells[0].weight, self.cells[0].bias
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        for cell in self.cells:
            x = torch.tanh(cell(x))
        return self.out(x)


def test_modules_tied_to_one_weight_take_one_dtype_and_stay_one_module_when_lowered(storage):
    """Each of six tied cells was tuned alone: each int8 one held its own copy of the weight (the model grew from
    1.15 to 1.60 MiB, past fp32's size), the tie was gone, and a plan could give the cells different dtypes."""
    from conftest import HalfCostMeasurer, fidelity

    from autotune.discovery import tied_groups

    torch.manual_seed(0)
    model, x = TiedCells().eval(), torch.randn(32, 64)
    names = [f"cells.{index}" for index in range(6)] + ["out"]
    assert tied_groups(model, dict.fromkeys(names, ["int8", "fp32"])) == [names[:6]]
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.5, max_trials=4, storage=storage)
    result = autotune(model, config, fidelity(model, x), x, measurer=HalfCostMeasurer(names))
    assert len({result.plan[name] for name in names[:6]}) == 1 and result.plan["cells.0"] == "int8", result.plan
    cells = result.model.cells
    assert all(cell is cells[0] for cell in cells) and isinstance(cells[0], DynamicInt8Linear)
    assert result.best.weight_bytes < result.baseline.weight_bytes
    for trial in result.study.trials:    # every plan the search tried kept the tie
        assert len({trial.user_attrs["plan"][name] for name in names[:6]}) == 1


@pytest.mark.parametrize("trial_timing", ["predicted", "measured"])
def test_a_search_ranking_by_predicted_latency_ends_once_the_fastest_predicted_plan_passes(storage, trial_timing,
                                                                                            caplog):
    """Ranked by predicted latency, no plan can rank ahead of the fastest predicted: once it passed, the `patience`
    trials after it were eval_fn calls that could not win. Timed trials may still find a plan the predictions
    ranked slower running faster, so the search goes on there, and says how to end it instead."""
    caplog.set_level(logging.INFO, logger="autotune")
    model = wide_model()
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.5, max_trials=20, patience=2, repeats=3, storage=storage,
                          trial_timing=trial_timing)
    from autotune.storage.study import evaluated_trials
    result = autotune(model, config, fidelity_eval(model), example_inputs=INPUTS)
    evaluated = evaluated_trials(result.study)
    assert evaluated[0].user_attrs["plan"] == {"0.0": "int8", "1.0": "int8", "2.0": "int8"}
    assert evaluated[0].user_attrs["passed"]
    if trial_timing == "predicted":
        assert len(evaluated) == 1, [t.user_attrs["plan"] for t in evaluated]
        assert result.stopped.startswith("the fastest predicted plan passed: with trial_timing: predicted")
        assert result.plan == {"0.0": "int8", "1.0": "int8", "2.0": "int8"}
    else:
        assert len(evaluated) > 1 and result.stopped.startswith("patience"), result.stopped
        assert ("the fastest predicted plan passed: the search goes on until 2 trials (patience) find no plan running "
                "faster timed in the whole model; trial_timing: predicted would end it here") in caplog.text
