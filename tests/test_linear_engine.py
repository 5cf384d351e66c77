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
