"""The quantized engine of an int8 Linear: FBGEMM, or oneDNN where it ran the module's own inputs clearly faster,
timed once per kind of Linear; the two round alike to within one quantisation step, and a saved model keeps the
engine it was built in."""
from __future__ import annotations

import io
import itertools

import pytest
import torch
from torch import nn

from autotune import Int8DynamicLinearConfig
from autotune.backends import Int8DynamicMHAConfig, linear_engine
from autotune.backends.linear_engine import ROUNDS, dynamic_linear_engine

needs_onednn = pytest.mark.skipif("onednn" not in torch.backends.quantized.supported_engines,
                                  reason="this torch has no oneDNN quantized engine")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(linear_engine, "_chosen", {})


def scripted_clock(fbgemm_s: float, onednn_s: float):
    """A clock under which each engine's call takes the given seconds: the engines are timed in turn, FBGEMM first,
    one start and one end reading each."""
    now = [0.0]
    steps = itertools.cycle([0.0, fbgemm_s, 0.0, onednn_s])
    reads = []

    def clock() -> float:
        now[0] += next(steps)
        reads.append(now[0])
        return now[0]
    return clock, reads


@needs_onednn
@pytest.mark.parametrize("onednn_s, chosen", [(0.5, "onednn"), (0.95, "fbgemm"), (2.0, "fbgemm")])
def test_onednn_is_taken_only_where_it_ran_clearly_faster(onednn_s, chosen):
    clock, reads = scripted_clock(1.0, onednn_s)
    assert dynamic_linear_engine(nn.Linear(16, 32), torch.randn(4, 16), False, clock) == chosen
    assert len(reads) == 2 * 2 * ROUNDS       # both engines, each round, interleaved


@needs_onednn
def test_a_kind_of_linear_is_timed_once_per_process():
    clock, reads = scripted_clock(1.0, 0.5)
    assert dynamic_linear_engine(nn.Linear(16, 32), torch.randn(4, 16), False, clock) == "onednn"
    timed = len(reads)
    assert dynamic_linear_engine(nn.Linear(16, 32), torch.randn(4, 16), False, clock) == "onednn"   # other weights
    assert len(reads) == timed
    dynamic_linear_engine(nn.Linear(16, 32), torch.randn(9, 16), False, clock)     # other rows: timed anew
    assert len(reads) > timed


@pytest.mark.parametrize("x", [None, torch.ones(4, 16, dtype=torch.long), (torch.randn(4, 16),), torch.randn(0, 16),
                               torch.tensor(2.0)])
def test_without_rows_of_floats_recorded_fbgemm_is_kept_untimed(x):
    clock, reads = scripted_clock(1.0, 0.1)
    assert dynamic_linear_engine(nn.Linear(16, 32), x, False, clock) == "fbgemm" and reads == []


@needs_onednn
def test_a_linear_lowered_in_onednn_computes_what_fbgemm_does_and_keeps_its_engine_when_saved(monkeypatch):
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 128).eval(), torch.randn(2, 8, 64)
    rows = 16
    monkeypatch.setitem(linear_engine._chosen, ((128, 64), True, rows, False), "onednn")
    onednn = Int8DynamicLinearConfig(reduce_range=False).apply(linear, ((x,), {}))
    fbgemm = Int8DynamicLinearConfig(reduce_range=False, engine="fbgemm").apply(linear, ((x,), {}))
    assert (onednn.engine, fbgemm.engine) == ("onednn", "fbgemm")
    with torch.no_grad():
        reference, step = linear(x), linear(x).abs().max() / 127
        assert (onednn(x) - fbgemm(x)).abs().max() < step       # the same rounding, within one step
        assert (onednn(x) - reference).norm() / reference.norm() < 0.05
        saved = io.BytesIO()
        torch.save(onednn, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        assert loaded.engine == "onednn" and torch.equal(loaded(x), onednn(x))


@needs_onednn
def test_attention_projections_take_the_engine_chosen_on_the_query(monkeypatch):
    attention, query = nn.MultiheadAttention(32, 4, batch_first=True).eval(), torch.randn(2, 5, 32)
    monkeypatch.setitem(linear_engine._chosen, ((96, 32), True, 10, False), "onednn")
    lowered = Int8DynamicMHAConfig(reduce_range=False).apply(attention, ((query, query, query), {}))
    assert lowered.in_proj.engine == "onednn"
    with torch.no_grad():
        assert torch.allclose(lowered(query, query, query)[0], attention(query, query, query)[0], atol=0.05)


def test_an_engine_named_in_the_config_is_used_untimed(monkeypatch):
    monkeypatch.setattr(linear_engine, "_faster", lambda *args: pytest.fail("timed an engine the config named"))
    lowered = Int8DynamicLinearConfig(engine="fbgemm").apply(nn.Linear(8, 8), ((torch.randn(3, 8),), {}))
    assert lowered.engine == "fbgemm"


@needs_onednn
def test_the_rows_kept_of_a_linears_recorded_input_make_the_choice_the_whole_input_makes():
    """Once the signals are measured, a module's recorded input only calibrates its lowering, and an int8 Linear's
    reads the rows its engine choice times: only those are kept for the run (whole, they grow with the batch and
    the sequence). Kept rows and whole input must give one key, so a kind is timed once either way."""
    from autotune.backends import calibration_kept
    linear, x = nn.Linear(16, 32), torch.randn(8, 300, 16)
    (rows,), kwargs = calibration_kept(linear, ["int8", "bf16"], ((x,), {}))
    assert kwargs == {} and rows.shape == (linear_engine.MAX_ROWS, 16)
    assert torch.equal(rows, x.reshape(-1, 16)[:linear_engine.MAX_ROWS])
    clock, reads = scripted_clock(1.0, 0.5)
    assert dynamic_linear_engine(linear, x, False, clock) == "onednn"
    timed = len(reads)
    assert dynamic_linear_engine(linear, rows, False, clock) == "onednn" and len(reads) == timed
    small = torch.randn(3, 16)     # fewer rows than the choice times: kept as they are
    assert torch.equal(calibration_kept(linear, ["int8"], ((small,), {}))[0][0], small)


def test_what_each_technique_keeps_of_a_modules_recorded_inputs():
    """Casts and int8 RNNs read nothing of them, a static int8 convolution all (its activation ranges), attention
    the query's rows; where the techniques of a module's dtypes read different parts, all of it is kept."""
    from autotune.backends import CastConfig, calibration_kept, register_technique, unregister_technique
    from autotune.backends.base import Technique
    x = torch.randn(2, 3, 8, 8)
    conv, linear = nn.Conv2d(3, 4, 3), nn.Linear(8, 8)
    assert calibration_kept(linear, ["bf16", "fp16", "fp32"], ((x,), {})) == ((), {})
    assert calibration_kept(nn.LSTM(8, 8), ["int8", "bf16"], ((torch.randn(5, 2, 8),), {})) == ((), {})
    whole = ((x,), {})
    assert calibration_kept(conv, ["int8", "bf16"], whole) is whole
    attention, q = nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 600, 8)
    (rows,), _ = calibration_kept(attention, ["int8"], ((), {"query": q, "key": q, "value": q}))
    assert rows.shape == (linear_engine.MAX_ROWS, 8)
    assert calibration_kept(linear, ["int8"], ((torch.randn(4, 8),), {}))[0][0].shape == (4, 8)

    class ReadsItAll(CastConfig):   # a user's technique: kept what the base says, all of it
        def calibration_kept(self, calibration):
            return Technique.calibration_kept(self, calibration)

    mine = register_technique(ReadsItAll(torch.bfloat16))
    try:
        recorded = ((torch.randn(4, 8),), {})
        assert calibration_kept(linear, ["int8", "bf16"], recorded) is recorded
    finally:
        unregister_technique(mine)
    assert Int8DynamicLinearConfig(engine="fbgemm").calibration_kept(((x,), {})) == ((), {})
