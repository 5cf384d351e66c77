"""Modules lowered inside torch's transformer encoders: their fused inference path reads the children's weights
(and the encoder hands its layers nested tensors), so above a lowered module they must call their children."""
import logging

import pytest
import torch
from conftest import HalfCostMeasurer
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.capture import record_module_inputs
from autotune.plan import apply_plan

LINEARS = [f"enc.layers.{i}.{name}" for i in range(2) for name in ("linear1", "linear2")] + ["head"]


class Encoder(nn.Module):
    """Two encoder layers and a head over the unpadded positions: what a user's text classifier looks like."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                         enable_nested_tensor=True)
        self.head = nn.Linear(32, 3)

    def forward(self, x, mask=None):
        hidden = self.enc(x, src_key_padding_mask=mask)
        keep = torch.ones(x.shape[:2]) if mask is None else (~mask).float()
        return self.head((hidden * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True))


def inputs(padded: bool):
    x = torch.randn(8, 10, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(8, 10, dtype=torch.bool)
    mask[:, 7:] = True
    return (x,), ({"mask": mask} if padded else {})


def run(model, call_inputs):
    with torch.inference_mode():
        return model(*call_inputs[0], **call_inputs[1])


@pytest.mark.parametrize("padded", [False, True])
def test_a_lowered_module_inside_an_encoder_layer_runs_and_takes_effect(padded):
    model, call_inputs = Encoder().eval(), inputs(padded)
    names = ["enc.layers.0.linear1", "enc.layers.1.linear2"]
    calibration = record_module_inputs(model, names, call_inputs)
    assert not any(t.is_nested for name in names for t in calibration[name][0])   # as a lowered module sees them
    reference = run(model, call_inputs)
    for dtype in ("int8", "bf16"):
        tuned = apply_plan(model, dict.fromkeys(names, dtype), calibration)
        output = run(tuned, call_inputs)
        # Close, and not equal: had the fused path run the fp32 weights, the lowering would change nothing.
        assert torch.allclose(output, reference, atol=0.05) and not torch.equal(output, reference)
    # The fp32 model keeps its fused path: recording its inputs put back what it changed.
    assert model.enc.use_nested_tensor and all(layer.activation_relu_or_gelu for layer in model.enc.layers)


def test_an_encoder_is_tuned_and_the_attention_projections_it_never_calls_are_left_alone(storage, caplog):
    model, call_inputs = Encoder().eval(), inputs(padded=True)
    reference = run(model, call_inputs)

    def fidelity(net):
        return 1 - ((run(net, call_inputs) - reference).norm() / reference.norm()).item()

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"], module_types=["Linear"]),
                          tolerable_loss=0.05, max_trials=4, repeats=3, storage=storage)
    with caplog.at_level(logging.INFO, logger="autotune"):
        result = autotune(model, config, fidelity, example_inputs=call_inputs, measurer=HalfCostMeasurer(LINEARS))
    assert sorted(result.plan) == sorted(LINEARS)            # no self_attn.out_proj: MultiheadAttention reads it
    assert "int8" in result.plan.values()
    said = [r for r in caplog.records if "never called by the forward on the captured batch" in r.getMessage()]
    assert len(said) == 1 and "self_attn.out_proj" in said[0].getMessage()
    assert said[0].levelno == logging.INFO      # a small share of the weights, read by their parent: no warning
    assert fidelity(result.model) >= 1 - 0.05


@pytest.mark.parametrize("padded", [False, True])
def test_attention_is_one_unit_with_its_projections_and_runs_lowered_inside_its_layer(padded):
    from autotune.discovery import search_candidates
    model, call_inputs = Encoder().eval(), inputs(padded)
    candidates = search_candidates(model, TuningConfig())
    attention = [f"enc.layers.{i}.self_attn" for i in range(2)]
    assert all("bf16" in candidates[name] and "int8" in candidates[name] for name in attention)
    assert not [name for name in candidates if "out_proj" in name]     # the attention owns it
    reference = run(model, call_inputs)
    for dtype in ("bf16", "int8"):
        tuned = apply_plan(model, dict.fromkeys(attention, dtype), record_module_inputs(model, attention, call_inputs))
        output = run(tuned, call_inputs)
        assert torch.allclose(output, reference, atol=0.05) and not torch.equal(output, reference)
