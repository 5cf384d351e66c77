"""Models whose forward reads attributes of the modules the tuner lowers, as many Hugging Face models do."""
import logging

import torch
from conftest import HalfCostMeasurer
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure.sensitivity import module_sensitivity

X = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))


class ReadsWeightDtype(nn.Module):
    """T5's feed-forward: the hidden state is cast to the output projection's weight dtype before it."""

    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        hidden = torch.relu(self.wi(x))
        return self.wo(hidden.to(self.wo.weight.dtype))


class ReadsOwnAttribute(nn.Module):
    """A parent reading an attribute set on its child that only the child knows (a LoRA-style scale)."""

    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(64, 128), nn.Linear(128, 64)
        self.wo.scale = 0.5

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x))) * self.wo.scale


class RealErrors(HalfCostMeasurer):
    """Scripted costs (each lowered module half its fp32 time), but output errors measured on the model."""

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return module_sensitivity(fp32, candidates, inputs, calibration)


def tune(model, storage, dtypes):
    torch.manual_seed(0)
    model = model.eval()
    with torch.no_grad():
        reference = model(X)

    def fidelity(net):
        with torch.no_grad():
            return 1 - ((net(X) - reference).norm() / reference.norm()).item()
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=dtypes), tolerable_loss=0.05, max_trials=6,
                          repeats=3, storage=storage)
    return autotune(model, config, fidelity, example_inputs=X, measurer=RealErrors(["wi", "wo"])), fidelity


def test_a_parent_reading_its_childs_weight_dtype_is_tuned(storage):
    result, fidelity = tune(ReadsWeightDtype(), storage, ["int8", "bf16", "fp32"])
    assert result.plan["wo"] != "fp32" and fidelity(result.model) >= 0.95


def test_a_dtype_the_model_fails_with_stays_out_of_that_module_alone(storage, caplog):
    with caplog.at_level(logging.INFO, logger="autotune"):
        result, fidelity = tune(ReadsOwnAttribute(), storage, ["int8", "bf16", "fp32"])
    # int8 lacks the child's own attribute, a cast module reads it from the module it wraps.
    assert "wo in int8: the model fails with it (AttributeError" in caplog.text
    assert result.plan["wo"] == "bf16" and result.plan["wi"] != "fp32"
    tried = [t.user_attrs["plan"] for t in result.study.trials if "plan" in t.user_attrs]
    assert any(plan["wi"] == "int8" for plan in tried) and not any(plan["wo"] == "int8" for plan in tried)
    assert fidelity(result.model) >= 0.95


class WithScriptedBlock(nn.Module):
    """A submodule compiled with torch.jit.script: no Python hooks can be set on it or on what it holds."""

    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(64, 128)
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(128, 128), nn.ReLU()))
        self.wo = nn.Linear(128, 64)

    def forward(self, x):
        return self.wo(self.inner(torch.relu(self.wi(x))))


def test_a_scripted_submodule_is_run_as_it_is_and_the_modules_around_it_are_tuned(storage):
    model = WithScriptedBlock()
    result, fidelity = tune(model, storage, ["int8", "fp32"])
    assert set(result.plan) == {"wi", "wo"} and "int8" in result.plan.values()
    assert isinstance(result.model.inner, torch.jit.ScriptModule) and fidelity(result.model) >= 0.95


class AutocastsABlock(nn.Module):
    """Runs its middle block under torch.autocast: that block's second Linear is given bf16 inputs."""

    def __init__(self):
        super().__init__()
        self.wi, self.mid, self.wo = nn.Linear(64, 128), nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128)), \
            nn.Linear(128, 64)

    def forward(self, x):
        x = torch.relu(self.wi(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.mid(x)
        return self.wo(x.float())


def test_modules_the_forward_runs_under_autocast_stay_as_they_are_and_the_others_are_tuned(storage, caplog):
    model = AutocastsABlock()
    with caplog.at_level(logging.INFO, logger="autotune"):
        result, fidelity = tune(model, storage, ["int8", "fp32"])
    assert "fail when called alone on their inputs" in caplog.text and "mid.1" in caplog.text
    assert "mid.1" not in result.plan and {"wi", "wo"} <= set(result.plan) and "int8" in result.plan.values()
    assert fidelity(result.model) >= 0.95
    timed = autotune(model, TuningConfig(engines=["eager"], max_trials=2, repeats=3, storage=storage,
                                         study_name="timed"), fidelity, example_inputs=X)
    assert "mid.1" not in timed.plan    # the signals time each module alone: it failed there, ending the run


class CastsToItsWeights(nn.Module):
    """A model handed over in bf16 that casts its input to its weights' dtype and returns fp32."""

    def __init__(self):
        super().__init__()
        self.wi, self.wo = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x.to(self.wi.weight.dtype)))).float()


def test_a_model_handed_over_in_bf16_is_summarised_and_shown_in_bf16(storage):
    """Its plan's "fp32" keeps a module as given, in bf16: the summary, `show` and the report say so rather than
    "fp32" (show said fp32×2 where the summary said bf16×2). A cast to bf16 is no candidate there: it is the
    module as it is, plus a wrapper, and a trial spent on it measures nothing new."""
    from click.testing import CliRunner

    from autotune.cli import main
    from autotune.report import html_report
    result, _ = tune(CastsToItsWeights().to(torch.bfloat16), storage, ["int8", "bf16", "fp16", "fp32"])
    summary = result.summary()
    assert result.held == "bf16" and "bf16 baseline" in summary and "fp32" not in summary
    tried = {dtype for trial in result.study.trials for dtype in trial.params.values()}
    assert "bf16" not in tried and "fp16" in tried, tried
    # Nothing lowered within a tolerance of 0: both modules stay as handed over, and are shown so.
    model = CastsToItsWeights().to(torch.bfloat16).eval()
    reference = model(X)
    kept = autotune(model, TuningConfig(
        engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp16", "fp32"]), tolerable_loss=0.0,
        max_trials=3, repeats=3, storage=storage, study_name="kept"), lambda net: float(torch.equal(net(X), reference)),
        example_inputs=X, measurer=RealErrors(["wi", "wo"]))
    assert set(kept.plan.values()) == {"fp32"}
    shown = CliRunner().invoke(main, ["show", "kept", "--storage", storage])
    assert shown.exit_code == 0, shown.output
    best = shown.output.split("baseline accuracy")[1]
    assert "bf16×2" in best and "fp32" not in best, best
    page = html_report(kept.study)     # ASCII: × is &#215;
    assert "bf16&#215;2" in page and "fp32&#215;" not in page and "<td>wi</td><td>bf16</td>" in page


def test_int8_modules_of_a_bf16_model_read_as_bf16():
    """A parent casting to its child's weight dtype, or transformers reading the model's dtype off its first
    parameter, must see the dtype the model was given in, not the int8 kernels' fp32 copies."""
    from autotune import apply_plan
    model = CastsToItsWeights().to(torch.bfloat16).eval()
    lowered = apply_plan(model, {"wi": "int8", "wo": "int8"})
    assert lowered.wi.weight.dtype == torch.bfloat16 and next(lowered.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        reference, out = model(X), lowered(X)
    assert out.dtype == torch.float32 and (out - reference).norm() / reference.norm() < 0.05


def test_a_bf16_module_fed_its_weight_dtype_by_its_parent_hands_back_the_dtype_the_next_module_holds():
    """transformers' code casts to a child's weight dtype (`x.to(self.fc1.weight.dtype)`): with fc1 in bf16 the
    parent feeds it bf16, and fc1's output went on in bf16 into fc2, kept fp32: every such trial failed."""
    from autotune import apply_plan
    model = CastsToItsWeights().eval()
    lowered = apply_plan(model, {"wi": "bf16", "wo": "fp32"})
    with torch.no_grad():
        reference, out = model(X), lowered(X)
    assert lowered.wi.weight.dtype == torch.bfloat16 and lowered.wi(X.bfloat16()).dtype == torch.float32
    assert (out - reference).norm() / reference.norm() < 0.05
    half = apply_plan(CastsToItsWeights().to(torch.bfloat16).eval(), {"wi": "fp16"})
    assert half.wi(X.half()).dtype == torch.bfloat16    # a bf16 model's module hands back bf16
