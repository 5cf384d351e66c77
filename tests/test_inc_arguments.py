"""INC's call, `autotune(model, tune_config, eval_fn, eval_args=..., run_fn=..., run_args=...)`, works as there:
eval_fn takes its arguments after the model, and run_fn's batches are the ones calibrated and timed on."""
import optuna
import pytest
import torch
from conftest import HalfCostMeasurer
from torch import nn

from autotune import ConfigError, EvalFunctionError, MixedPrecisionConfig, TuningConfig, autotune
from autotune.tuner import start_runner

NAMES = ["0", "2"]
EVAL_BATCHES = [torch.randn(16, 32) for _ in range(3)]
CALIBRATION = [torch.randn(5, 32) for _ in range(10)]


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def config(storage, **fields):
    return TuningConfig(**{"storage": storage, "study_name": "inc", "engines": ["eager"], "max_trials": 3, "repeats": 3,
                           **fields})


class RecordingInputs(HalfCostMeasurer):
    """Half cost per lowered module; keeps the batch size of every input it is asked to time."""

    def __init__(self):
        super().__init__(NAMES)
        self.batch_sizes = set()

    def module_latency(self, fp32, candidates, inputs, calibration):
        self.batch_sizes.add(inputs[0][0].shape[0])
        return super().module_latency(fp32, candidates, inputs, calibration)

    def latency(self, models, inputs, repeats, warmup=None):
        self.batch_sizes.add(inputs[0][0].shape[0])
        return super().latency(models, inputs, repeats, warmup)


def agreement(model, batches, reference):
    """INC-style eval_fn: the data comes as an argument."""
    with torch.no_grad():
        return sum(float((model(x).argmax(1) == reference(x).argmax(1)).float().mean()) for x in batches) / len(batches)


def test_eval_args_and_run_fn_are_passed_as_inc_passes_them(storage):
    reference = small_model()
    started, finished, run_calls, calibrated = [], [], [], []

    def eval_fn(model, batches, ref):
        started.append(len(batches))
        score = agreement(model, batches, ref)
        finished.append(score)
        return score

    def run_fn(model, batches):
        run_calls.append(1)
        for x in batches:
            calibrated.append(x.shape[0])
            model(x)

    measurer = RecordingInputs()
    result = autotune(small_model(), config(storage), eval_fn, eval_args=(EVAL_BATCHES, reference), run_fn=run_fn,
                      run_args=[CALIBRATION], measurer=measurer)
    assert started and set(started) == {len(EVAL_BATCHES)}
    # run_fn ran once and was abandoned at its fourth batch; no eval_fn call was cut short to capture inputs.
    assert run_calls == [1] and calibrated == [5] * 4
    assert len(finished) == len(started) == result.eval_calls
    assert measurer.batch_sizes == {5}


def test_example_inputs_come_first_then_run_fn_batches(storage):
    runner = start_runner(small_model(), config(storage), lambda m: float(m(CALIBRATION[0]).isfinite().all()),
                          torch.randn(7, 32), HalfCostMeasurer(NAMES),
                          run_fn=lambda m: [m(x) for x in CALIBRATION])
    assert [args[0].shape[0] for args, _ in runner.batches] == [7, 5, 5, 5]
    assert runner.inputs[0][0].shape[0] == 7


@pytest.mark.parametrize("arguments,message", [
    ({"eval_args": iter(EVAL_BATCHES)}, "eval_args must be a tuple of what eval_fn takes after the model; got "
                                        "list_iterator; one argument goes in a tuple of one"),
    ({"run_fn": "calibrate"}, "run_fn must be callable as run_fn\\(model\\); got str"),
    ({"run_args": (CALIBRATION,)}, "run_args were given without run_fn"),
    ({"run_fn": lambda m: None}, "run_fn never called the model it was given"),
    ({"run_fn": lambda m, data: m(data[0]), "run_args": ([],)}, "run_fn failed on the fp32 model: IndexError"),
    ({"example_inputs": "a sentence"}, "example_inputs must be a tensor, tuple, dict or \\(args, kwargs\\); got str"),
])
def test_bad_inc_arguments_stop_before_anything_runs(storage, arguments, message):
    evaluated = []

    def eval_fn(model, *args):
        evaluated.append(1)
        return agreement(model, EVAL_BATCHES, small_model())
    error = ConfigError if "example_inputs" in arguments else EvalFunctionError
    with pytest.raises(error, match=message):
        autotune(small_model(), config(storage), eval_fn, measurer=HalfCostMeasurer(NAMES), **arguments)
    assert evaluated == []
    assert all(summary.n_trials == 0 for summary in optuna.get_all_study_summaries(storage))


def calibrate_on(batch: int):
    """A YAML calibration factory: run_fn(model) feeding batches of `batch` rows."""
    def run_fn(model):
        for _ in range(10):
            model(torch.randn(batch, 32))
    return run_fn


def calibration_rows():
    """What a factory should not return for calibration.run_fn: the data instead of the function."""
    return CALIBRATION


def scored():
    """A YAML eval_fn factory."""
    return lambda model: agreement(model, EVAL_BATCHES, small_model())


def test_a_yaml_calibration_run_fn_is_what_apply_calibrates_on_as_the_tuning_did():
    from autotune.cli.study_commands import tuning_batches
    from autotune.config.file import parse_config

    config = parse_config({"model": {"factory": "test_inc_arguments:small_model"},
                           "evaluation": {"eval_fn": "test_inc_arguments:scored"},
                           "calibration": {"run_fn": "test_inc_arguments:calibrate_on", "kwargs": {"batch": 5}}})
    assert [args[0].shape[0] for args, _ in tuning_batches(config, small_model(), "compiled")[1]] == [5, 5, 5, 5]
    without = parse_config({"model": {"factory": "test_inc_arguments:small_model"},
                            "evaluation": {"eval_fn": "test_inc_arguments:scored"}})
    assert [args[0].shape[0] for args, _ in tuning_batches(without, small_model(), "compiled")[1]] == [16, 16, 16]
    example = parse_config({"model": {"factory": "test_inc_arguments:small_model"},
                            "evaluation": {"eval_fn": "test_inc_arguments:scored"},
                            "example_inputs": {"factory": "test_inc_arguments:example_rows"}})
    # Static ranges take eval_fn's batches after the example, as the tuning did; the eager engine's need none.
    timed, calibrating = tuning_batches(example, small_model(), "compiled")
    assert [args[0].shape[0] for args, _ in calibrating] == [7, 16, 16, 16]
    assert [args[0].shape[0] for args, _ in timed] == [7]
    assert [args[0].shape[0] for args, _ in tuning_batches(example, small_model(), "eager")[1]] == [7]


def example_rows():
    return torch.randn(7, 32)


# What eval_fn feeds after example_inputs of 7 rows: a call of other dimensions among them, and more batches than
# calibration keeps.
FED = [torch.randn(16, 32), torch.randn(3, 4, 32), torch.randn(16, 32), torch.randn(9, 32), torch.randn(16, 32),
       torch.randn(16, 32)]


def test_example_inputs_alone_calibrate_static_ranges_with_eval_fns_first_batches_called_alike(storage):
    """Ranges calibrated on example_inputs alone clipped what other batches held (a YOLOS in int8: 95 % agreement
    with fp32 where eval_fn's first four batches made it 98 %). Every process takes the same batches: the first from
    its baseline's call, one joining from its rescoring, and one that scored no fp32 model from a call cut short."""
    reference, calls = small_model(), []

    def eval_fn(model):
        calls.append(0)
        if len(calls) == 1:
            raise RuntimeError("data not ready")     # the first process stops with the signals stored, no baseline
        with torch.no_grad():
            for x in FED:
                calls[-1] += 1
                model(x)
        return agreement(model, [FED[0]], reference)

    def runner():
        return start_runner(small_model(), config(storage, engines=["eager", "compiled"]), eval_fn,
                            example_rows(), HalfCostMeasurer(NAMES))

    def sizes(batches):
        return [args[0].shape[0] for args, _ in batches]

    with pytest.raises(EvalFunctionError, match="data not ready"):
        runner()
    scoring, joined_before = runner(), runner()     # neither scores the fp32 model as it starts: the study has no score
    assert scoring.baseline == joined_before.baseline and calls == [0, 6]   # one scores it, the other reads it
    assert sizes(scoring.calibration_batches) == [7, 16, 16, 9] and sizes(scoring.batches) == [7]
    assert scoring.eval_calls == 1 and len(calls) == 2
    assert sizes(joined_before.calibration_batches) == [7, 16, 16, 9]
    assert joined_before.eval_calls == 1 and calls[-1] == 4        # eval_fn started and abandoned at the 4th batch
    joined_after = runner()                                      # rescores the stored baseline: no call more
    assert sizes(joined_after.calibration_batches) == [7, 16, 16, 9] and joined_after.eval_calls == 1
    assert all(torch.equal(a[0][0], b[0][0])
               for a, b in zip(scoring.calibration_batches, joined_after.calibration_batches))
    eager = start_runner(small_model(), config(storage, study_name="eager-only"), eval_fn, example_rows(),
                         HalfCostMeasurer(NAMES))
    assert eager.calibration_batches is eager.batches and eager.eval_calls == 1


def test_batches_called_otherwise_than_the_example_calibrate_nothing():
    from autotune.capture import with_fed_batches
    from autotune.model_call import ModelCall

    def sizes(example, fed):
        return [tuple(args[0].shape) for args, _ in with_fed_batches([example], fed)[1:]]

    images = ((torch.randn(2, 3, 8, 8),), {})
    assert sizes(images, [((torch.randn(4, 3, 8, 8),), {}), ((torch.randn(4, 3, 16, 16),), {}),
                          ((torch.randn(4, 3, 8, 8).double(),), {}), ((torch.randn(4, 3, 8, 8),), {"flag": True}),
                          ModelCall(((torch.randn(4, 3, 8, 8),), {}), [("encoder", ((), {}))])]) == [(4, 3, 8, 8)]
    one_row = ((torch.randn(1, 32),), {})   # export fixes a size of 1
    assert sizes(one_row, [((torch.randn(16, 32),), {}), ((torch.randn(1, 32),), {})]) == [(1, 32)]
    tokens = ((torch.randint(0, 9, (4, 12)),), {})   # lengths and batch sizes stay free in a sequence
    assert sizes(tokens, [((torch.randint(0, 9, (8, 30)),), {})] * 5) == [(8, 30)] * 3
    assert sizes(tokens, [tokens, ((tokens[0][0] + 1,), {})]) == [(4, 12)]    # the example fed again: once
    copied = with_fed_batches([ModelCall(tokens, changes_inputs=True)], [((tokens[0][0] + 1,), {})])
    assert len(copied) == 2 and all(batch.changes_inputs for batch in copied)


def test_a_yaml_calibration_that_builds_no_run_fn_and_a_refused_one_say_so():
    from autotune.config.file import parse_config
    from autotune.service.worker import JobRefused, check_allowed

    config = parse_config({"model": {"factory": "test_inc_arguments:small_model"},
                           "evaluation": {"eval_fn": "test_inc_arguments:scored"},
                           "calibration": {"run_fn": "test_inc_arguments:calibration_rows"}})
    with pytest.raises(ConfigError, match="calibration.run_fn: test_inc_arguments:calibration_rows returned list, "
                                          "not a run_fn"):
        config.build_run_fn()
    with pytest.raises(JobRefused, match="calibration.run_fn: os:system"):
        check_allowed({"model": {"factory": "autotune.workloads.mnist:model"},
                       "calibration": {"run_fn": "os:system"}}, ("autotune.workloads.*",))


@pytest.mark.parametrize(("field", "instead"), [("sampler", "the search chooses its own plans"),
                                                ("strategy", "the search chooses its own plans"),
                                                ("diagnosis", "leave it out: `autotune show` and `autotune report`"),
                                                ("accuracy_criterion", "write tolerable_loss, loss_kind"),
                                                ("tuning_criterion", "write max_trials, timeout")])
def test_an_inc_field_with_no_place_here_says_what_to_write_instead(field, instead):
    with pytest.raises(ConfigError, match=rf"{field}: Extra inputs are not permitted; {instead}"):
        TuningConfig(**{field: "default"})
    with pytest.raises(ConfigError, match=rf"{field}: Extra inputs are not permitted; {instead}"):
        TuningConfig.from_mapping({field: {}})


def test_the_result_called_as_inc_users_call_their_model_says_where_the_model_is(storage):
    """INC's autotune returns the tuned model; `q_model(x)` on ours said only "'TuningResult' object is not
    callable"."""
    model = small_model()
    result = autotune(model, config(storage), lambda m: 1.0, EVAL_BATCHES[0], measurer=HalfCostMeasurer(NAMES))
    with pytest.raises(TypeError, match=r"call result.model \(INC's autotune returns the tuned model itself\)"):
        result(EVAL_BATCHES[0])
    assert result.model(EVAL_BATCHES[0]).shape == (16, 4)


@pytest.mark.parametrize(("field", "instead"), [("white_list", "write module_types"), ("black_list", "write exclude"),
                                                ("precisions", "write dtype"), ("op_name_dict", "write include"),
                                                ("op_type_dict", "write module_types"), ("backend", "engines"),
                                                ("device", "belongs to TuningConfig"),
                                                ("tolerable_loss", "belongs to TuningConfig")])
def test_inc_mixed_precision_fields_say_what_to_write_here(field, instead):
    """INC 2.x and 3.x MixedPrecisionConfig arguments were refused with "Extra inputs are not permitted" alone."""
    with pytest.raises(ConfigError, match=rf"MixedPrecisionConfig: {field}: Extra inputs are not permitted; .*"
                                          rf"{instead}"):
        MixedPrecisionConfig(**{field: "x"})


def test_a_timeout_of_zero_inc_s_no_limit_says_how_to_write_no_limit():
    with pytest.raises(ConfigError, match=r"timeout: 0 seconds leaves no time; for no limit \(INC's 0\) leave timeout "
                                          "out or give null"):
        TuningConfig(timeout=0)


def test_an_eval_fn_wanting_inc_eval_args_given_fourth_is_told_to_pass_them_by_keyword(storage):
    """INC takes eval_args fourth; here the fourth is example_inputs, and a tensor there the model takes: the user
    saw Python's "missing 1 required positional argument" alone."""
    def eval_fn(model, batches):
        return agreement(model, batches, small_model())

    with pytest.raises(EvalFunctionError, match=r"eval_fn cannot be called with the model alone \(.*missing 1 "
                       r"required positional argument: 'batches'\): what it takes after the model goes in "
                       r"eval_args=\(\.\.\.\), by keyword"):
        autotune(small_model(), config(storage), eval_fn, EVAL_BATCHES[0], measurer=HalfCostMeasurer(NAMES))

    def raises_inside(model):    # a TypeError of its own is eval_fn's failure, as any other
        return sorted([model, model])

    with pytest.raises(EvalFunctionError) as raised:
        autotune(small_model(), config(storage), raises_inside, EVAL_BATCHES[0], measurer=HalfCostMeasurer(NAMES))
    assert "cannot be called with the model alone" not in str(raised.value)
