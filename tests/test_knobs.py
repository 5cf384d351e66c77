"""Model-level knobs: each says where it applies, leaves the given model alone, keeps the numerics; the tuner
tries them on the finalists, keeps one only where it is re-timed faster, and export / apply rebuild it."""
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import HalfCostMeasurer, export_then_apply, fidelity
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.cli import main
from autotune.engines import KNOBS
from autotune.measure import LatencyStats

X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def conv_bn() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    net[1].running_mean.uniform_(-1, 1)
    net[1].running_var.uniform_(0.5, 2)
    return net.eval()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4)).eval()


def test_each_knob_says_where_it_applies():
    assert KNOBS["channels_last"].supports(conv_bn()) is None and KNOBS["fold_bn"].supports(conv_bn()) is None
    assert "no Conv2d" in KNOBS["channels_last"].supports(mlp())
    assert "no BatchNorm" in KNOBS["fold_bn"].supports(mlp())


@pytest.mark.parametrize("name", ["channels_last", "fold_bn"])
def test_a_knob_keeps_the_numerics_and_leaves_the_given_model_alone(name):
    model = conv_bn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    changed = KNOBS[name].apply(model)
    with torch.no_grad():
        assert torch.allclose(changed(X), model(X), atol=1e-5)
    assert all(torch.equal(before[k], v) and v.is_contiguous() for k, v in model.state_dict().items())
    if name == "fold_bn":
        assert not any(isinstance(m, nn.BatchNorm2d) for m in changed.modules())
        assert isinstance(changed.get_submodule("0"), nn.Conv2d) and isinstance(changed.get_submodule("4"), nn.Linear)
    else:
        assert changed.get_submodule("0").weight.is_contiguous(memory_format=torch.channels_last)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x)) if x.sum() > 0 else x    # data-dependent: torch.fx cannot trace it


def test_fold_bn_raises_on_a_model_it_cannot_trace():
    with pytest.raises(Exception, match="symbolically traced"):
        KNOBS["fold_bn"].apply(Branchy().eval())


class FoldedIsFaster(HalfCostMeasurer):
    """A model without BatchNorm (folded) runs at 0.4 of fp32; lowered ones at 0.7 (no real timing)."""

    def latency(self, models, inputs, repeats):
        def ms(name, model):
            if name == "fp32":
                return 10.0
            return 4.0 if not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()) else 7.0
        return {name: LatencyStats(ms(name, model), 0.0, repeats) for name, model in models.items()}


def test_a_knob_measured_faster_is_kept_and_export_and_apply_rebuild_it(tmp_path):
    model = conv_bn()
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.2,
                          max_trials=4, storage=f"sqlite:///{tmp_path}/k.db", study_name="knobs")
    result = autotune(model, config, fidelity(model, X), X, measurer=FoldedIsFaster())
    assert result.knobs == ("fold_bn",) and result.speedup == pytest.approx(2.5)
    assert result.study.user_attrs["autotune.best"]["knobs"] == ["fold_bn"] and "fold_bn" in result.summary()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in result.model.modules())

    saved, output = export_then_apply(tmp_path, "knobs", f"sqlite:///{tmp_path}/k.db", "test_knobs:conv_bn",
                                      "test_knobs:inputs")
    assert saved["knobs"] == ["fold_bn"] and "with fold_bn" in output
    rebuilt = torch.load(tmp_path / "applied.pt", weights_only=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in rebuilt.modules())


def inputs():
    return X


def test_a_plan_file_naming_an_unknown_knob_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"plan": {"0": "fp32"}, "engine": "eager", "knobs": ["turbo"]}))
    (tmp_path / "k.yaml").write_text(yaml.safe_dump({
        "model": {"factory": "test_knobs:conv_bn"}, "evaluation": {"eval_fn": "test_knobs:conv_bn"}}))
    result = CliRunner().invoke(main, ["apply", str(plan), "--config", str(tmp_path / "k.yaml"),
                                       "--out", str(tmp_path / "m.pt")])
    assert result.exit_code == 2 and "knobs must be a list of ['channels_last', 'fold_bn']" in result.output
