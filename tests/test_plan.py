import pytest
import torch
from conftest import assert_state_equal, state_snapshot
from torch import nn

from autotune import PlanError, apply_plan
from autotune.plan import plan_key, plan_of, summarize, validate_plan


def test_apply_plan_builds_a_new_model_and_leaves_the_original_bit_identical():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    before = state_snapshot(model)
    tuned = apply_plan(model, {"0": "int8", "2": "bf16"})
    assert tuned is not model
    assert type(tuned[0]).__name__ == "DynamicInt8Linear" and type(tuned[2]).__name__ == "CastWrapper"
    assert isinstance(model[0], nn.Linear) and model[2].weight.dtype == torch.float32
    assert_state_equal(model, before)


def test_a_bare_root_module_can_be_lowered():
    tuned = apply_plan(nn.Linear(8, 8), {"": "int8"})
    assert type(tuned).__name__ == "DynamicInt8Linear"


def test_plan_naming_a_missing_module_is_an_error():
    with pytest.raises(PlanError, match="'decoder' which Sequential does not have|does not have"):
        apply_plan(nn.Sequential(nn.Linear(2, 2)), {"decoder": "int8"})


def test_a_plan_with_calibrated_int8_is_applied_on_example_inputs_and_says_so_without_them():
    """The README's `autotune.apply_plan(model, plan)` failed for an int8 Conv2d ("needs the inputs the module saw")
    with no word of how to give them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).eval()
    x = torch.randn(4, 3, 8, 8)
    plan = {"0": "int8", "3": "int8"}
    with pytest.raises(ValueError, match=r"int8 Conv2d needs the inputs .* apply_plan\(model, plan, example_inputs="):
        apply_plan(model, plan)
    tuned = apply_plan(model, plan, example_inputs=x)
    assert plan_of(tuned, plan) == plan
    with torch.no_grad():
        assert ((tuned(x) - model(x)).norm() / model(x).norm()).item() < 0.05
    assert torch.equal(apply_plan(model, plan, example_inputs=(x,))(x), tuned(x))   # a tuple: the same call


def test_validate_plan_reports_unknown_modules_and_disallowed_dtypes():
    candidates = {"a": ["int8", "fp32"], "b": ["fp32"]}
    with pytest.raises(PlanError, match=r"not tunable in this model: \['zzz'\]"):
        validate_plan({"a": "int8", "zzz": "fp32"}, candidates)
    with pytest.raises(PlanError, match=r"b=int8 \(allowed \['fp32'\]\)"):
        validate_plan({"b": "int8"}, candidates)


def test_plan_key_ignores_order_and_summary_counts_dtypes():
    assert plan_key({"a": "int8", "b": "fp32"}) == plan_key({"b": "fp32", "a": "int8"})
    assert summarize({"a": "int8", "b": "fp32", "c": "int8"}) == "int8×2 fp32×1"


def test_models_built_from_kept_variants_match_fresh_ones_and_share_no_module():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)), torch.randn(3, 8)
    before = state_snapshot(model)
    plan = {"0": "int8", "1": "bf16", "2": "fp32"}
    variants = {}
    first, second = apply_plan(model, plan, variants=variants), apply_plan(model, plan, variants=variants)
    assert set(variants) == {("0", "int8"), ("1", "bf16")}
    first[1].register_forward_hook(lambda module, args, out: out * 0)      # what an eval_fn might leave behind
    first[1].inner.weight.data.zero_()
    with torch.inference_mode():
        assert torch.equal(second(x), apply_plan(model, plan)(x))
    assert all(a is not b for a, b in zip(first, second))
    assert first[0]._packed is second[0]._packed                            # immutable packed int8 weights
    assert_state_equal(model, before)


def test_plan_of_reads_a_plan_back_and_names_a_missing_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    built = apply_plan(model, {"0": "bf16", "1.0": "int8"})
    assert plan_of(built, (name for name in ["0", "1.0"])) == {"0": "bf16", "1.0": "int8"}
    with pytest.raises(PlanError, match="no module '2'"):
        plan_of(built, ["0", "2"])
