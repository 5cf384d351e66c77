import torch
from torch import nn

from autotune.measure import fixed_threads, measure_latency, weight_bytes


def test_interleaved_latency_orders_a_heavier_model_after_a_lighter_one():
    light, heavy = nn.Linear(64, 64), nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    stats = measure_latency({"light": light, "heavy": heavy},
                            {"light": ((torch.randn(64, 64),), {}), "heavy": ((torch.randn(64, 512),), {})},
                            warmup=1, repeats=5)
    assert stats["light"].repeats == stats["heavy"].repeats == 5
    assert stats["light"].spread_ms >= 0
    assert stats["light"].median_ms < stats["heavy"].median_ms


def test_threads_are_fixed_while_measuring_and_restored():
    before = torch.get_num_threads()
    with fixed_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_weight_bytes_counts_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(10, 5), nn.BatchNorm1d(5), nn.Linear(5, 3, bias=False).half())
    expected = (10 * 5 + 5) * 4 + (5 + 5 + 5 + 5) * 4 + 8 + 5 * 3 * 2  # BN: weight, bias, mean, var; int64 counter
    assert weight_bytes(model) == expected
