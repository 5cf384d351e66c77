"""Device-aware pruning: a dtype timed slower than fp32 on a module alone is dropped, unless the whole model in
that dtype runs faster than fp32 (then the uniform plan stays in the space)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autotune.measure import LatencyStats, module_latency
from autotune.model_call import call
from autotune.search import SearchSpace

CANDIDATES = {"0": ["int8", "fp32"], "2": ["int8", "fp32"], "3": ["int8", "bf16", "fp32"]}
ALONE_MS = {"0": {"int8": 0.5, "fp32": 1.0},
            "2": {"int8": 1.5, "fp32": 1.0},                # int8 slower alone: the verdict to check
            "3": {"int8": 0.4, "bf16": 2.0, "fp32": 1.0}}   # bf16 slower on every module: nothing to check
SENSITIVITY = {name: {d: (0.0 if d == "fp32" else 0.01) for d in dtypes} for name, dtypes in CANDIDATES.items()}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8)).eval()


def confirm(monkeypatch, whole_model_ms: dict[str, float]) -> tuple[dict, list[list[str]]]:
    """Runs confirm_in_context with the whole-model timings given; returns its latency and what it timed."""
    timed: list[list[str]] = []

    def fake_measure(models, inputs, **kwargs):
        timed.append(sorted(models))
        return {key: LatencyStats(whole_model_ms[key], 0.0, 5) for key in models}

    monkeypatch.setattr(module_latency, "measure_latency", fake_measure)
    net, inputs = model(), ((torch.randn(4, 8),), {})
    calibration = {name: ((torch.randn(4, 8),), {}) for name in CANDIDATES}
    latency = module_latency.confirm_in_context(net, CANDIDATES, ALONE_MS, inputs, calibration, warmup=1, repeats=3,
                                             num_threads=None)
    return latency, timed


def test_a_dtype_slower_alone_is_kept_when_the_whole_model_in_it_is_faster(monkeypatch):
    latency, timed = confirm(monkeypatch, {"fp32": 10.0, "int8": 8.0})
    assert timed == [["fp32", "int8"]]          # bf16 is slower everywhere: the whole model is not timed in it
    assert latency["2"]["int8"] == ALONE_MS["2"]["fp32"]   # kept, with no saving predicted
    assert latency["0"] == ALONE_MS["0"] and latency["3"] == ALONE_MS["3"]

    space = SearchSpace.build(CANDIDATES, SENSITIVITY, latency)
    assert space.choices["2"] == ["fp32", "int8"]
    assert space.choices["3"] == ["int8", "fp32"]   # bf16 pruned
    assert space.fastest_plan()["2"] == "fp32"
    assert space.uniform_plans()[0] == {"0": "int8", "2": "int8", "3": "int8"}
    assert space.knapsack_plan(1.0)["2"] == "fp32"  # int8 there adds noise and saves nothing predicted


@pytest.mark.parametrize("uniform_ms", [10.0, 12.0])
def test_a_dtype_slower_alone_is_pruned_when_the_whole_model_in_it_is_not_faster(monkeypatch, uniform_ms):
    latency, _ = confirm(monkeypatch, {"fp32": 10.0, "int8": uniform_ms})
    assert latency == ALONE_MS
    assert SearchSpace.build(CANDIDATES, SENSITIVITY, latency).choices["2"] == ["fp32"]


@pytest.mark.parametrize("uniform_ms", [7.0, 10.0])
def test_a_dtype_every_module_ran_modestly_slower_in_alone_is_judged_by_the_whole_model(monkeypatch, uniform_ms):
    """120 Linear(384)s at batch 1, each timed alone with its weights in cache, ran 1.4x slower in int8; the whole
    model, streaming 68 MB of weights, ran 0.7x in int8. int8 was pruned from every module and the run returned
    fp32 where a passing plan ran 1.46x faster."""
    candidates = {"0": ["int8", "fp32"], "2": ["int8", "fp32"], "3": ["int8", "bf16", "fp32"]}
    alone = {"0": {"int8": 1.4, "fp32": 1.0}, "2": {"int8": 1.3, "fp32": 1.0},
             "3": {"int8": 0.4, "bf16": 9.0, "fp32": 0.1}}     # bf16 emulated: hopeless, never timed whole
    timed: list[list[str]] = []

    def fake_measure(models, inputs, **kwargs):
        timed.append(sorted(models))
        return {key: LatencyStats({"fp32": 10.0, "int8": uniform_ms}[key], 0.0, 5) for key in models}

    monkeypatch.setattr(module_latency, "measure_latency", fake_measure)
    latency = module_latency.confirm_in_context(model(), candidates, alone, ((torch.randn(4, 8),), {}), {},
                                             warmup=1, repeats=3, num_threads=None)
    assert timed == [["fp32", "int8"]]
    if uniform_ms < 10.0:    # each module saves its share of the whole model's saving: the search can fall back
        assert latency["0"]["int8"] == pytest.approx(0.7) and latency["2"]["int8"] == pytest.approx(0.7)
        assert latency["3"] == alone["3"]     # 4x slower alone, a small head: its verdict stands
        assert SearchSpace.build(candidates, {n: {d: 0.01 for d in ds} for n, ds in candidates.items()},
                                 latency).choices["2"] == ["int8", "fp32"]
    else:
        assert latency == alone


def test_nothing_is_timed_when_every_module_agrees(monkeypatch):
    agreeing = {"0": ["int8", "fp32"], "3": ["int8", "bf16", "fp32"]}
    monkeypatch.setattr(module_latency, "measure_latency", lambda *a, **k: pytest.fail("timed without need"))
    latency = module_latency.confirm_in_context(model(), agreeing, ALONE_MS, ((torch.randn(4, 8),), {}), {},
                                             warmup=1, repeats=3, num_threads=None)
    assert latency is ALONE_MS


def test_nothing_is_timed_for_modules_too_small_to_change_a_plans_time(monkeypatch):
    # Module 2 is slower in int8 alone but holds under 1 % of the fp32 time (a classifier head): pruned there.
    alone = {"0": {"int8": 50.0, "fp32": 100.0}, "2": {"int8": 0.02, "fp32": 0.01},
             "3": {"int8": 40.0, "bf16": 200.0, "fp32": 100.0}}
    monkeypatch.setattr(module_latency, "measure_latency", lambda *a, **k: pytest.fail("timed without need"))
    latency = module_latency.confirm_in_context(model(), CANDIDATES, alone, ((torch.randn(4, 8),), {}), {},
                                             warmup=1, repeats=3, num_threads=None)
    assert latency is alone
    assert SearchSpace.build(CANDIDATES, SENSITIVITY, latency).choices["2"] == ["fp32"]


class _GivenLatency:
    """Module latency as ALONE_MS gives it; records which dtypes sensitivity is asked for."""

    def __init__(self):
        self.asked = None

    def module_latency(self, fp32, candidates, inputs, calibration):
        return ALONE_MS

    def sensitivity(self, fp32, candidates, inputs, calibration):
        self.asked = candidates
        return {name: {d: 0.0 if d == "fp32" else 0.01 for d in dtypes} for name, dtypes in candidates.items()}


def test_the_error_of_a_dtype_timed_slower_than_fp32_on_a_module_is_not_measured(tmp_path):
    import optuna

    from autotune.measure.measurer import cached_signals
    from autotune.measure.shapes import Shape
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    inputs = ((torch.randn(4, 8),), {})
    calibration = {name: ((torch.randn(4, 8),), {}) for name in CANDIDATES}
    measurer = _GivenLatency()
    sensitivity, latency = cached_signals(study, measurer, model(), CANDIDATES, inputs, calibration,
                                          [Shape("example", inputs, 1.0)])
    assert measurer.asked == {"0": ["int8", "fp32"], "2": ["fp32"], "3": ["int8", "fp32"]}
    assert "int8" not in sensitivity["2"] and "bf16" not in sensitivity["3"]      # not measured: absent
    assert sensitivity["0"]["int8"] == 0.01 and study.user_attrs["autotune.sensitivity"] == sensitivity
    # The search prunes those dtypes as it did when their errors were measured.
    assert SearchSpace.build(CANDIDATES, sensitivity, latency).choices == {"0": ["int8", "fp32"], "2": ["fp32"],
                                                                           "3": ["int8", "fp32"]}


class Stepped(nn.Module):
    """A cell its forward steps five times, then a head called once."""

    def __init__(self):
        super().__init__()
        self.cell, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        for _ in range(5):
            x = torch.tanh(self.cell(x))
        return self.head(x)


class _OneMsACall(_GivenLatency):
    def module_latency(self, fp32, candidates, inputs, calibration):
        return {name: dict.fromkeys(dtypes, 1.0) for name, dtypes in candidates.items()}


def test_a_module_s_cost_is_its_call_s_time_times_the_calls_a_forward_makes_of_it(tmp_path):
    # A module was costed at one call's time: a cell stepped 20 times in a loop was predicted the slowest plan to
    # lower when it was the fastest, and the search took plans in the wrong order.
    import optuna

    from autotune.measure.measurer import cached_signals
    from autotune.measure.shapes import Shape
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    inputs = ((torch.randn(4, 8),), {})
    candidates = {"cell": ["int8", "fp32"], "head": ["int8", "fp32"]}
    _, latency = cached_signals(study, _OneMsACall(), Stepped().eval(), candidates, inputs, {},
                                [Shape("example", inputs, 1.0)])
    assert latency == {"cell": {"int8": 5.0, "fp32": 5.0}, "head": {"int8": 1.0, "fp32": 1.0}}


def test_a_groups_modules_are_lowered_together_once_per_dtype_they_share(monkeypatch, caplog):
    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.capture import record_module_inputs
    from autotune.measure import sensitivity as sensitivity_module
    from autotune.measure.measurer import DeviceMeasurer
    from autotune.plan import apply_plan

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    candidates = {"0": ["int8", "bf16", "fp32"], "2": ["int8", "fp32"], "4": ["int8", "fp32"]}
    inputs = ((torch.randn(32, 16),), {})
    calibration = record_module_inputs(net, list(candidates), inputs)
    forwards = []
    monkeypatch.setattr(sensitivity_module, "call", lambda model, batch: forwards.append(1) or call(model, batch))
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), groups=[["0", "2"]])
    with caplog.at_level("INFO", logger="autotune"):   # a 12-layer encoder's took 158 s, unsaid
        errors = DeviceMeasurer(config).sensitivity(net, candidates, inputs, calibration)
    assert len(forwards) == 1 + 1     # the group in int8 (bf16 is not shared), module 4 in int8
    assert "output error of 2 units in their lower dtypes: 2 runs of the model's rest" in caplog.text
    assert "bf16" not in errors["0"] and errors["0"]["int8"] == errors["2"]["int8"] > 0
    with torch.inference_mode():
        reference = call(net, inputs)
        both = sensitivity_module.output_error(reference.flatten(), call(
            apply_plan(net, {"0": "int8", "2": "int8", "4": "fp32"}, calibration), inputs))
    assert math.hypot(errors["0"]["int8"], errors["2"]["int8"]) == pytest.approx(both, rel=1e-5)


class Labels(nn.Module):
    """A classifier whose forward returns the labels themselves (argmax), as a greedy decoder returns token ids."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.body(x))).argmax(-1)


def test_a_forward_returning_labels_is_measured_by_the_share_of_labels_that_change():
    # It stopped the run with "TypeError: the model returned no floating tensor to compare".
    from autotune.capture import record_module_inputs
    from autotune.measure.sensitivity import module_sensitivity, output_error

    assert output_error(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4])) == pytest.approx(0.5)
    assert output_error(torch.tensor([1, 2, 3, 4]), (torch.tensor([1, 2, 3, 4]),)) == 0.0
    torch.manual_seed(0)
    net, inputs = Labels().eval(), ((torch.randn(512, 16),), {})
    candidates = {"body": ["int8", "fp32"], "head": ["int8", "fp32"]}
    errors = module_sensitivity(net, candidates, inputs, record_module_inputs(net, list(candidates), inputs))
    with torch.no_grad():
        reference = net(inputs[0][0])
    assert all(0 <= errors[name]["int8"] <= 1 for name in candidates) and errors["body"]["fp32"] == 0.0
    changed = (reference != reference.flip(0)).float().mean().sqrt().item()
    assert output_error(reference, reference.flip(0)) == pytest.approx(changed) and changed > 0.5
