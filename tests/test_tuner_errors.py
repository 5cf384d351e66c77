import dataclasses
import functools
import logging
import math
import re

import numpy as np
import optuna
import pytest
import torch
from test_tuner_trials import INPUTS as WIDE_INPUTS
from test_tuner_trials import fidelity_eval, wide_model
from torch import nn

from autotune import ConfigError, EvalFunctionError, MixedPrecisionConfig, NoTunableModulesError, TuningConfig, autotune
from autotune.backends.int8_linear import DynamicInt8Linear

INPUTS = torch.randn(16, 32)


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def config(storage, **fields):
    return TuningConfig(storage=storage, study_name="errors", max_trials=2, repeats=3, **fields)


@pytest.mark.parametrize("kind", ["cuda", "mps"])
def test_a_device_this_process_cannot_use_is_a_config_error(storage, kind):
    """torch's own was an AssertionError from deep in Module.to ("Torch not compiled with CUDA enabled"), or for
    mps a RuntimeError, shown by the CLI as an unexpected error after the study had been opened."""
    if kind == "mps" and torch.backends.mps.is_available():
        pytest.skip("this torch runs on mps")
    device = kind if kind == "mps" else f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ConfigError, match=f"device '{device}' cannot be used here: ") as raised:
        autotune(small_model(), config(storage, device=device), lambda m: 1.0)
    assert raised.value.errors[0][0] == "tuning.device"


def test_eval_fn_that_is_not_callable(storage):
    with pytest.raises(EvalFunctionError, match="eval_fn must be callable"):
        autotune(small_model(), config(storage), "accuracy")


@pytest.mark.parametrize("returned,message", [("0.9", "must return a number; it returned str"),
                                              (None, "must return a number; it returned NoneType"),
                                              (True, "must return a number; it returned bool"),
                                              (math.nan, "returned nan, not a finite number"),
                                              (torch.tensor([0.1, 0.2]), "must return a number"),
                                              # a long one was shown as its repr, over several lines
                                              (torch.randn(64, 10), r"it returned a Tensor of shape \(64, 10\): "
                                                                    r"reduce it to one number$")])
def test_eval_fn_returning_a_non_number_stops_before_any_trial(storage, returned, message):
    def eval_fn(model):
        model(INPUTS)
        return returned
    with pytest.raises(EvalFunctionError, match=f"fp32 baseline evaluation failed.*{message}"):
        autotune(small_model(), config(storage), eval_fn)
    assert optuna.load_study(study_name="errors", storage=storage).trials == []


@pytest.mark.parametrize("wrapped", [torch.tensor, lambda score: torch.tensor([[score]]), np.float32,
                                     lambda score: np.array([score])])
def test_eval_fn_returning_one_number_in_a_tensor_or_array_is_scored_by_it(storage, wrapped):
    """`np.array([0.97])`, as `metric.compute()` often returns, was refused: "must return a number"."""
    def eval_fn(model):
        return wrapped(1.0 - float((model(INPUTS) - reference).pow(2).mean()))
    reference = small_model()(INPUTS).detach()
    result = autotune(small_model(), config(storage), eval_fn)
    assert result.baseline.accuracy == pytest.approx(1.0)


def test_a_model_returning_its_own_dataclass_is_tuned_and_returns_it(storage):
    """Its output was refused as holding no tensor ("the model returned no tensor to compare (a Out)"), where
    dicts and namedtuples of tensors were walked."""
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        steps: int = 1

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = small_model()

        def forward(self, x):
            return Out(self.body(x))

    model = Model().eval()
    reference = model(INPUTS).logits.detach()

    def eval_fn(m):
        return 1.0 - float((m(INPUTS).logits - reference).pow(2).mean())
    result = autotune(model, config(storage, config_set=MixedPrecisionConfig(dtype=["bf16", "fp32"]),
                                    engines=["eager"]), eval_fn)
    assert result.baseline.accuracy == pytest.approx(1.0)
    assert "body.0" in result.study.user_attrs["autotune.sensitivity"]
    assert isinstance(result.model(INPUTS), Out)


def test_eval_fn_raising_on_the_baseline_says_so(storage):
    def eval_fn(model):
        raise RuntimeError("dataset missing")
    with pytest.raises(EvalFunctionError, match="fp32 baseline evaluation failed.*RuntimeError: dataset missing"):
        autotune(small_model(), config(storage), eval_fn)


def scaled_after_scoring(model):
    with torch.no_grad():
        score = model(INPUTS).abs().mean().item()
        for parameter in model.parameters():
            parameter.mul_(1.5)
    return score


def first_replaced_after_scoring(model):
    with torch.no_grad():
        score = model(INPUTS).abs().mean().item()
    model[0] = nn.Identity()
    return score


@pytest.mark.parametrize("eval_fn, changed", [(scaled_after_scoring, "0.weight's values changed; 0.bias's values "
                                                                     "changed; 2.weight's values changed; and 1 more"),
                                              (first_replaced_after_scoring, "0.weight is no longer in it; 0.bias is "
                                                                             "no longer in it")])
def test_an_eval_fn_that_changes_the_model_it_scores_is_stopped_at_the_baseline(storage, eval_fn, changed):
    """The model eval_fn scored is timed and handed back: one whose weights it scaled after scoring was handed back
    scoring 0.853 where 0.9435 was reported, and one whose Linear it replaced made the winner's timing raise."""
    model = small_model()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(EvalFunctionError, match=re.escape(
            f"the fp32 baseline evaluation failed, so no trial was run: eval_fn changed the model it was given "
            f"({changed}): the model it scores is the one timed and handed back, so it must leave it as it found it")):
        autotune(model, config(storage), eval_fn, example_inputs=INPUTS)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_a_plan_whose_model_eval_fn_changed_fails_and_its_finalist_is_not_handed_back(storage):
    """An eval_fn changing only some models (here each int8 one after the first two) fails the trial or finalist it
    changed, with the reason, and what is handed back scores as reported."""
    model = wide_model()
    fidelity = fidelity_eval(model)
    int8_calls = []

    def eval_fn(net):
        score = fidelity(net)
        if any(isinstance(module, DynamicInt8Linear) for module in net.modules()):
            int8_calls.append(net)
            if len(int8_calls) > 2:
                with torch.no_grad():
                    for parameter in net.parameters():
                        parameter.mul_(1.5)
        return score
    tuning = config(storage, engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                    tolerable_loss=0.05)
    result = autotune(model, tuning, eval_fn, example_inputs=WIDE_INPUTS)
    outcomes = result.study.user_attrs["autotune.finalist_evaluated"]
    assert len(int8_calls) > 2 and any("eval_fn changed the model it was given" in said for said in outcomes.values())
    assert fidelity(result.model) == pytest.approx(result.best.accuracy)


def test_a_worker_joining_a_study_whose_baseline_failed_stops_at_its_first_trial(storage):
    """A worker that finds the signals stored runs trials before the baseline is known (another worker's, coming):
    where eval_fn fails on every model, its first failed trial asks for the baseline, which fails too, and the
    run ends there instead of spending its budget on failing trials."""
    calls = []

    def eval_fn(model):
        calls.append(model)
        raise RuntimeError("dataset missing")
    tuning = config(storage, engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"])
                    ).model_copy(update={"max_trials": 20})
    with pytest.raises(EvalFunctionError, match="fp32 baseline evaluation failed"):
        autotune(wide_model(), tuning, eval_fn, example_inputs=WIDE_INPUTS)   # the signals are stored first
    calls.clear()
    with pytest.raises(EvalFunctionError, match="fp32 baseline evaluation failed.*RuntimeError: dataset missing"):
        autotune(wide_model(), tuning, eval_fn, example_inputs=WIDE_INPUTS)
    # one trial (its plan lowered), then the baseline (fp32)
    assert [any(isinstance(m, DynamicInt8Linear) for m in model.modules()) for model in calls] == [True, False]


def test_eval_fn_that_never_calls_the_model_without_example_inputs(storage):
    with pytest.raises(EvalFunctionError, match="never called the model"):
        autotune(small_model(), config(storage), lambda model: 1.0)


def returns_as_given(method):
    """transformers' `can_return_tuple`: a decorator whose wrapper takes `self` too."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return method(self, *args, **kwargs)
    return wrapper


class TwoTowers(nn.Module):
    """CLIP's shape: eval_fn scores features its methods compute with the towers, never calling the forward."""

    def __init__(self):
        super().__init__()
        self.text, self.image = nn.Linear(8, 16), nn.Linear(12, 16)

    def forward(self, text, image):
        return self.text_features(text) @ self.image_features(image).T

    @returns_as_given
    def text_features(self, text):
        return self.text(text)

    def image_features(self, image):
        return self.image(image)


def test_eval_fn_scoring_through_methods_that_call_submodules_alone_is_told_what_to_do(storage, caplog):
    model, text, image = TwoTowers().eval(), torch.randn(4, 8), torch.randn(4, 12)

    def similarity(model):
        with torch.no_grad():
            return torch.cosine_similarity(model.text_features(text), model.image_features(image)).mean().item()
    with pytest.raises(EvalFunctionError, match=r"never called the model's forward, only its submodules image, text, "
                                                r"through TwoTowers.image_features, TwoTowers.text_features: .* pass "
                                                r"example_inputs for the forward .* itself \(autotune\(model.image, "):
        autotune(model, config(storage), similarity)
    with caplog.at_level(logging.INFO, logger="autotune"):
        result = autotune(model, config(storage), similarity, example_inputs=(text, image))
    assert set(result.plan) == {"text", "image"}     # as the error says: tuned on the forward, scored by eval_fn
    assert "only its first call is timed" not in caplog.text   # no steps here to time


def test_unknown_dtype_name_in_a_dict_config(storage):
    with pytest.raises(ConfigError, match=r"config_set.0.dtype.0: Input should be 'fp32', 'bf16', 'fp16' or 'int8' "
                                          r"\(got 'int4'\)$"):
        autotune(small_model(), {"config_set": {"dtype": ["int4"]}, "storage": storage}, lambda m: 1.0)


def test_one_bad_field_is_one_line_naming_the_value_given_and_several_are_a_line_each():
    with pytest.raises(ConfigError) as one:
        MixedPrecisionConfig(dtype=["int4"])
    assert str(one.value) == ("invalid MixedPrecisionConfig: dtype.0: Input should be 'fp32', 'bf16', 'fp16' or "
                              "'int8' (got 'int4')")
    with pytest.raises(ConfigError) as several:
        TuningConfig(max_trials=0, surprise=1)
    assert str(several.value).splitlines() == [
        "invalid TuningConfig:", "  max_trials: Input should be greater than or equal to 1 (got 0)",
        "  surprise: Extra inputs are not permitted"]


def test_model_with_no_tunable_modules(storage):
    with pytest.raises(NoTunableModulesError):
        autotune(nn.Sequential(nn.ReLU()), config(storage), lambda m: 1.0, example_inputs=INPUTS)


def test_include_pattern_matching_nothing(storage):
    bad = config(storage, config_set=MixedPrecisionConfig(include=["encoder.*"]))
    with pytest.raises(ConfigError, match="pattern 'encoder.\\*' matches no module of Sequential"):
        autotune(small_model(), bad, lambda m: 1.0, example_inputs=INPUTS)


@pytest.mark.parametrize("model,message", [
    (lambda x: x, r"tunes a torch.nn.Module; got function$"),
    (small_model().state_dict(), r"tunes a torch.nn.Module; got OrderedDict \(a state_dict: load it into its model")])
def test_a_model_that_is_not_a_module_says_so(storage, model, message):
    with pytest.raises(NoTunableModulesError, match=message):
        autotune(model, config(storage), lambda m: 1.0, example_inputs=INPUTS)


def test_a_relative_loss_against_a_baseline_of_zero_is_refused_before_any_trial(storage):
    model = small_model()
    with torch.no_grad():
        reference = model(INPUTS)

    def negative_error(net):       # 0 for the fp32 model itself: a loss relative to it is infinite
        return -((net(INPUTS) - reference) ** 2).mean().item()
    with pytest.raises(ConfigError, match="scored exactly 0.*set loss_kind: absolute"):
        autotune(model, config(storage), negative_error)
    assert optuna.load_study(study_name="errors", storage=storage).trials == []
    absolute = TuningConfig(storage=storage, study_name="absolute", max_trials=2, repeats=3, loss_kind="absolute",
                            tolerable_loss=1e-3)
    result = autotune(model, absolute, negative_error)
    assert result.baseline.accuracy == 0.0


def test_a_reason_is_one_line_with_the_line_its_first_announces_and_no_traceback():
    from autotune.errors import describe
    saving = RuntimeError("Serialization of parametrized modules is only supported through state_dict(). See:\n"
                          "https://pytorch.org/tutorials/beginner/saving_loading_models.html")
    assert describe(saving) == ("RuntimeError: Serialization of parametrized modules is only supported through "
                                "state_dict(). See: https://pytorch.org/tutorials/beginner/saving_loading_models.html")
    crashed = RuntimeError("kernel crashed\nwhile running the graph:\n  %3 = quantized_linear(...)")
    assert describe(crashed) == "RuntimeError: kernel crashed" and len(describe(crashed, limit=6)) == 20


@pytest.mark.parametrize("given", [torch.randn(4, 17), ([(INPUTS, torch.zeros(16))],)],
                         ids=["wrong width", "INC's eval_args"])
def test_example_inputs_the_model_fails_on_are_named_as_the_cause(storage, given):
    """The model's own error alone ("mat1 and mat2 shapes cannot be multiplied") named nothing the user passed; an
    INC user's eval_args, INC's fourth positional argument, land in example_inputs here."""
    def eval_fn(model, loader=None):
        return 1.0

    with pytest.raises(ConfigError, match=r"the model fails on example_inputs: \w+Error: .* eval_args=\.\.\.\)$"):
        autotune(small_model(), config(storage), eval_fn, given)


def test_a_model_on_the_meta_device_is_told_to_load_its_weights(storage):
    """torch's own error advised to_empty(), which leaves the weights uninitialised."""
    with torch.device("meta"):
        model = small_model()
    with pytest.raises(ConfigError, match="the model's weights are on the meta device, never loaded: load them first"):
        autotune(model, config(storage), lambda m: 1.0, INPUTS)
