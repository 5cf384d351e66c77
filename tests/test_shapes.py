"""Latency at the shapes users deploy (`latency_inputs`): shapes built from the captured batch or factories,
weighted into the objective, every per-shape ratio kept on the trial."""
import pytest
import torch
from torch import nn

from autotune import ConfigError, LatencyInput, MixedPrecisionConfig, StudyMismatchError, TuningConfig, autotune
from autotune.config import parse_config
from autotune.measure import LatencyStats
from autotune.measure.shapes import Shape, combine_module_latency, latency_shapes, resize_batch, weighted_ratio
from autotune.plan import plan_of
from autotune.service.worker import JobRefused, check_allowed
from autotune.storage.study import evaluated_trials

NAMES = ["0", "1", "2"]
WIDTH = 16


def cost_ms(dtype: str, batch: int) -> float:
    """Dynamic int8 as on a CPU: a fixed per-call cost (quantising activations, packing), cheaper rows."""
    return 1.5 + 0.4 * batch if dtype == "int8" else 1.0 * batch


class ShapeCostMeasurer:
    """No timing: each module costs `cost_ms` at the batch of the inputs it is given, so int8 loses at batch 1
    and wins at batch 64."""

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return {name: {d: 0.0 if d == "fp32" else 1e-3 for d in dtypes} for name, dtypes in candidates.items()}

    def module_latency(self, fp32, candidates, inputs, calibration):
        batch = inputs[0][0].shape[0]
        return {name: {d: cost_ms(d, batch) for d in dtypes} for name, dtypes in candidates.items()}

    def latency(self, models, inputs, repeats, warmup=None):
        batch = inputs[0][0].shape[0]
        return {name: LatencyStats(sum(cost_ms(d, batch) for d in plan_of(model, NAMES).values()), 0.0, repeats)
                for name, model in models.items()}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in NAMES)).eval()


def eval_fn(net: nn.Module) -> float:
    with torch.no_grad():
        net(torch.randn(8, WIDTH))
    return 1.0 - 0.001 * sum(d == "int8" for d in plan_of(net, NAMES).values())


def tune(tmp_path, weights: tuple[float, float], **more):
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.01,
                          max_trials=8, storage=f"sqlite:///{tmp_path}/shapes.db",
                          latency_inputs=[LatencyInput(batch=1, weight=weights[0]),
                                          LatencyInput(batch=64, weight=weights[1])], **more)
    return autotune(model(), config, eval_fn, measurer=ShapeCostMeasurer())


@pytest.mark.parametrize(("weights", "int8_chosen"), [((0.1, 0.9), True), ((0.9, 0.1), False)])
def test_the_weighted_shape_decides_whether_int8_is_chosen(tmp_path, weights, int8_chosen):
    result = tune(tmp_path, weights)
    assert ("int8" in result.plan.values()) is int8_chosen
    ratio_1, ratio_64 = (3 * cost_ms("int8", b) / (3 * cost_ms("fp32", b)) for b in (1, 64))
    expected_speedup = 1 / (weights[0] * ratio_1 + weights[1] * ratio_64) if int8_chosen else 1.0
    assert result.speedup == pytest.approx(expected_speedup)
    assert [s.name for s in result.shapes] == ["batch 1", "batch 64"]
    assert result.study.user_attrs["autotune.best"]["speedup_by_shape"] == {
        s.name: pytest.approx(s.speedup) for s in result.shapes}
    assert "batch 64" in result.summary()
    for trial in evaluated_trials(result.study):     # every per-shape ratio kept, the objective their weighted mean
        by_shape = trial.user_attrs["latency_by_shape"]
        lowered = sum(d == "int8" for d in trial.user_attrs["plan"].values())
        for name, batch in (("batch 1", 1), ("batch 64", 64)):
            fp32 = 3 * cost_ms("fp32", batch)
            assert by_shape[name]["ratio"] == pytest.approx(
                (fp32 + lowered * (cost_ms("int8", batch) - cost_ms("fp32", batch))) / fp32)
        assert trial.values[0] == pytest.approx(weights[0] * by_shape["batch 1"]["ratio"]
                                                + weights[1] * by_shape["batch 64"]["ratio"])


def test_a_study_made_for_other_shapes_is_not_resumed_with_these(tmp_path):
    tune(tmp_path, (0.5, 0.5), study_name="fixed")
    with pytest.raises(StudyMismatchError, match="measures latency at"):
        tune(tmp_path, (0.9, 0.1), study_name="fixed")


def test_resize_batch_cuts_or_repeats_rows_of_batched_tensors_only():
    ids, mask, scale = torch.arange(12).reshape(4, 3), torch.ones(4, 3), torch.tensor(2.0)
    inputs = ((ids,), {"attention_mask": mask, "scale": scale, "table": torch.zeros(7, 2)})
    small, large = resize_batch(inputs, 1), resize_batch(inputs, 10)
    assert small[0][0].tolist() == [[0, 1, 2]] and small[1]["attention_mask"].shape == (1, 3)
    assert large[0][0].shape == (10, 3) and large[0][0][4:8].tolist() == ids.tolist()
    assert large[1]["scale"] is scale and large[1]["table"].shape == (7, 2)   # not batched: left alone


class Bags(nn.Module):
    """An nn.EmbeddingBag's inputs: flat indices with one offset per row, beside a batch of dense features."""

    def __init__(self):
        super().__init__()
        self.bag, self.dense = nn.EmbeddingBag(50, 4, mode="sum"), nn.Linear(3, 4)

    def forward(self, indices, offsets, dense):
        return self.bag(indices, offsets) + self.dense(dense)


def bag_inputs(rows: int = 8, per_row: int = 5):
    return ((torch.randint(0, 50, (rows * per_row,)), torch.arange(rows) * per_row, torch.randn(rows, 3)), {})


def test_the_batch_is_the_first_dimension_most_inputs_share_so_an_embedding_bag_resizes():
    captured = bag_inputs()
    shapes = latency_shapes(TuningConfig(latency_inputs=[{"batch": 1}]), [captured], torch.device("cpu"), Bags())
    assert shapes[0].name == "batch 1"
    assert [t.shape[0] for t in shapes[0].inputs[0]] == [40, 1, 1]   # offsets and dense rows cut, indices kept
    assert latency_shapes(TuningConfig(), [captured], torch.device("cpu"))[0].name == "batch 8"


def test_a_shape_the_model_cannot_run_is_a_config_error_naming_it():
    """Repeated offsets go back to the start of the indices, which nn.EmbeddingBag refuses: the error says how
    batches are resized and what to give instead."""
    config = TuningConfig(latency_inputs=[{"batch": 1}, {"batch": 32}])
    with pytest.raises(ConfigError, match=r"latency_inputs.1: the fp32 model fails on the inputs of shape "
                                          r"'batch 32': RuntimeError: .*give a factory for this shape"):
        latency_shapes(config, [bag_inputs()], torch.device("cpu"), Bags())
    config = TuningConfig(latency_inputs=[{"call": 1, "batch": 32}])    # the batch named is that call's
    with pytest.raises(ConfigError, match=r"first dimension is the captured batch \(3\), so give a factory"):
        latency_shapes(config, [bag_inputs(), bag_inputs(rows=3)], torch.device("cpu"), Bags())


def batch_of_ones(rows: int = 2):
    return torch.ones(rows, WIDTH)


def test_shapes_come_from_factories_by_callable_or_import_path_with_their_names():
    config = TuningConfig(latency_inputs=[{"factory": batch_of_ones, "kwargs": {"rows": 3}},
                                          {"factory": "test_shapes:batch_of_ones", "name": "server", "weight": 2}])
    shapes = latency_shapes(config, [((torch.zeros(5, WIDTH),), {})], torch.device("cpu"))
    assert [(s.name, s.inputs[0][0].shape[0], s.weight) for s in shapes] == [("batch_of_ones", 3, 1.0),
                                                                              ("server", 2, 2.0)]
    default = latency_shapes(TuningConfig(), [((torch.zeros(5, WIDTH),), {})], torch.device("cpu"))
    assert [(s.name, s.weight) for s in default] == [("batch 5", 1.0)]


@pytest.mark.parametrize(("entries", "message"), [
    ([{"factory": "test_shapes:missing"}], r"latency_inputs.0.factory: .*has no attribute 'missing'"),
    ([{"factory": batch_of_ones, "kwargs": {"rows": -1}}], r"latency_inputs.0.factory: batch_of_ones.*raised"),
    ([{"batch": 1}, {"batch": 8}, {"batch": 1}], r"two shapes are named alike"),
    ([{"call": 1}], r"latency_inputs.0.call: the model's calls recorded are 1 \(calls 0 to 0\), so call 1 cannot"),
])
def test_shapes_that_cannot_be_built_raise_config_errors_naming_the_field(entries, message):
    config = TuningConfig(latency_inputs=entries)
    with pytest.raises(ConfigError, match=message):
        latency_shapes(config, [((torch.zeros(5, WIDTH),), {})], torch.device("cpu"))


def test_a_batch_of_inputs_without_a_batch_dimension_is_refused():
    with pytest.raises(ConfigError, match="latency_inputs.0.batch: the captured inputs have no batch dimension"):
        latency_shapes(TuningConfig(latency_inputs={"batch": 4}), [((torch.tensor(1.0),), {})], torch.device("cpu"))


@pytest.mark.parametrize(("entry", "message"), [
    ({"batch": 0}, "latency_inputs.0.batch"),
    ({"batch": 2, "factory": "a:b"}, "give factory, or batch and call"),
    ({"call": 1, "factory": "a:b"}, "give factory, or batch and call"),
    ({"call": -1}, "greater than or equal to 0"),
    ({"batch": 2, "weight": 0}, "latency_inputs.0.weight"),
    ({"factory": "nocolon"}, "not an import path"),
    ({"batch": 2, "kwargs": {"a": 1}}, "kwargs belong to factory"),
])
def test_bad_latency_inputs_in_yaml_name_their_field(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"model": {"factory": "test_shapes:model"}, "evaluation": {"eval_fn": "test_shapes:model"},
                      "tuning": {"latency_inputs": [entry]}})


def test_a_worker_refuses_a_shape_factory_it_does_not_allow():
    data = {"model": {"factory": "autotune.workloads.mnist:model"},
            "tuning": {"latency_inputs": [{"batch": 1}, {"factory": "os:system", "kwargs": {"command": "true"}}]}}
    with pytest.raises(JobRefused, match=r"tuning.latency_inputs.1.factory: os:system"):
        check_allowed(data, ("autotune.workloads.*",))


def test_module_costs_combine_as_weighted_shares_of_each_shapes_fp32_model():
    shapes = [Shape("a", ((), {}), 1.0), Shape("b", ((), {}), 3.0)]
    per_shape = [{"m": {"fp32": 2.0, "int8": 1.0}, "n": {"fp32": 2.0, "int8": 4.0}},
                 {"m": {"fp32": 10.0, "int8": 2.0}, "n": {"fp32": 30.0, "int8": 30.0}}]
    combined = combine_module_latency(per_shape, shapes)
    # a plan's predicted ratio is its summed costs over fp32's, exactly the weighted mean of its per-shape ratios
    plan_ratio = (combined["m"]["int8"] + combined["n"]["fp32"]) / (combined["m"]["fp32"] + combined["n"]["fp32"])
    assert plan_ratio == pytest.approx(weighted_ratio({"a": 3.0 / 4.0, "b": 32.0 / 40.0}, shapes))
    assert combine_module_latency(per_shape[:1], shapes[:1]) == per_shape[0]


def test_show_and_report_give_every_shapes_ratio(tmp_path):
    from click.testing import CliRunner

    from autotune.cli import main

    result = tune(tmp_path, (0.1, 0.9), study_name="shown")
    storage = f"sqlite:///{tmp_path}/shapes.db"
    shown = CliRunner().invoke(main, ["show", "shown", "--storage", storage])
    assert shown.exit_code == 0, shown.output
    assert "by shape" in shown.output and "batch 1 ×0.1, batch 64 ×0.9" in shown.output
    trial = evaluated_trials(result.study)[0]
    ratios = trial.user_attrs["latency_by_shape"]
    assert f"batch 1 {ratios['batch 1']['ratio']:.3f} · batch 64 {ratios['batch 64']['ratio']:.3f}" in shown.output
    page = tmp_path / "r.html"
    assert CliRunner().invoke(main, ["report", "shown", "--storage", storage, "--out", str(page)]).exit_code == 0
    html = page.read_text()
    assert "Latency by shape" in html and "batch 64 (weight 0.9)" in html
    assert f"({ratios['batch 64']['ratio']:.3f}; fp32" in html


def test_export_writes_the_configs_shapes_for_bench_and_none_where_a_factory_is_a_callable(tmp_path):
    """`export` wrote only the calls a generation was timed at: a study tuned at batches 1 and 64 exported a plan
    that `bench` timed at the captured batch alone."""
    import json

    from click.testing import CliRunner

    from autotune.cli import main
    storage = f"sqlite:///{tmp_path}/shapes.db"
    tune(tmp_path, (0.8, 0.2), study_name="written")
    exported = CliRunner().invoke(main, ["export", "written", "--storage", storage])
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.output)["latency_inputs"] == [{"batch": 1, "weight": 0.8}, {"batch": 64, "weight": 0.2}]
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), max_trials=2,
                          storage=storage, study_name="callable",
                          latency_inputs=[LatencyInput(factory=lambda: torch.randn(4, WIDTH))])
    autotune(model(), config, eval_fn, measurer=ShapeCostMeasurer())
    exported = CliRunner().invoke(main, ["export", "callable", "--storage", storage])
    assert exported.exit_code == 0 and "latency_inputs" not in json.loads(exported.output)
