from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import benchmark

from autotune.measure import fixed_threads, measure_latency, weight_bytes
from autotune.measure.latency import MIN_ROUNDS, settled, still_racing


def test_interleaved_latency_orders_a_heavier_model_after_a_lighter_one_and_stops_once_settled():
    light, heavy = nn.Linear(64, 64), nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    stats = measure_latency({"light": light, "heavy": heavy},
                            {"light": ((torch.randn(64, 64),), {}), "heavy": ((torch.randn(64, 512),), {})},
                            warmup=1, repeats=40)
    assert stats["light"].repeats == stats["heavy"].repeats == len(stats["light"].samples_ms)
    assert MIN_ROUNDS <= stats["light"].repeats < 40   # the ranking is clear long before 40 rounds
    assert stats["light"].spread_ms >= 0
    assert stats["light"].median_ms < stats["heavy"].median_ms


@pytest.mark.parametrize(("rounds", "other", "expected"), [
    (MIN_ROUNDS - 1, [0.5, 0.5], False),                        # never before MIN_ROUNDS
    (MIN_ROUNDS, [0.5, 0.5, 0.5], True),                        # clearly faster than the reference
    (6, [0.8, 1.2, 0.9, 1.1, 1.0, 1.15], False),                # wide, and overlapping the reference's 1.0
    (6, [1.001, 0.999, 1.0, 1.0, 1.002, 0.998], True),          # ties the reference, but to within ±3 %
])
def test_a_comparison_settles_when_each_ratio_is_precise_or_apart_from_the_others(rounds, other, expected):
    samples = {"fp32": [1.0] * rounds, "plan": other}
    assert settled(samples) is expected


def test_three_variants_settle_only_when_the_two_close_ones_are_told_apart_or_precise():
    rounds = 8
    noisy_a = [0.60, 0.75, 0.62, 0.71, 0.66, 0.74, 0.61, 0.70]
    noisy_b = [0.64, 0.72, 0.69, 0.61, 0.73, 0.65, 0.70, 0.62]
    assert not settled({"fp32": [1.0] * rounds, "a": noisy_a, "b": noisy_b})
    assert settled({"fp32": [1.0] * rounds, "a": noisy_a, "b": [0.3] * rounds})


def test_a_variant_clearly_slower_than_the_fastest_stops_being_timed_the_reference_never():
    rounds = 6
    fast = [0.50, 0.56, 0.52, 0.58, 0.51, 0.55]
    close = [0.54, 0.50, 0.57, 0.52, 0.56, 0.53]       # overlaps the fastest: still in the race
    samples = {"fp32": [1.0] * rounds, "fast": fast, "close": close, "slow": [0.9] * rounds}
    assert still_racing(samples) == ["fp32", "fast", "close"]
    assert still_racing({name: times[:2] for name, times in samples.items()}) == list(samples)  # too few rounds
    assert still_racing({name: times[:1] for name, times in samples.items()}) == list(samples)
    assert still_racing({"fp32": [1.0] * rounds, "slow": [3.0] * rounds}) == ["fp32", "slow"]  # nothing to race


def test_after_two_rounds_only_a_variant_far_slower_in_every_sample_is_out_the_reference_never():
    samples = {"fp32": [4.0, 4.1], "fast": [1.0, 1.9], "far": [3.9, 4.2], "spell": [1.1, 4.5]}
    # "far": both samples 2x the fastest's slower one (1.9); "spell": one slow sample is not enough.
    assert still_racing(samples) == ["fp32", "fast", "spell"]
    # The bar is twice the slowest sample of the variant whose slowest is lowest: a spell on the fastest raises it.
    assert still_racing({**samples, "fast": [1.0, 2.0]}) == list(samples)


def test_a_near_tie_within_the_precision_of_the_fastest_stops_being_timed_a_wide_contender_does_not():
    rounds = 6
    fastest = [0.52, 0.54, 0.53, 0.55, 0.52, 0.54]
    twin = [t + 0.01 for t in fastest]     # overlaps the fastest's notch, but could beat it by under 3 % at most
    wide = [0.45, 0.60, 0.50, 0.58, 0.47, 0.62]     # still as likely as not to be well ahead
    samples = {"fp32": [1.0] * rounds, "twin": twin, "fastest": fastest, "wide": wide}
    assert still_racing(samples) == ["fp32", "fastest", "wide"]
    assert still_racing(samples, precision=0.0) == ["fp32", "twin", "fastest", "wide"]   # any gain is worth rounds


def test_samples_feed_torch_benchmark_compare():
    stats = measure_latency({"fp32": nn.Linear(32, 32)}, ((torch.randn(8, 32),), {}), warmup=1, repeats=3,
                            num_threads=1)
    compare = benchmark.Compare([stats["fp32"].measurement("latency", "batch 8", "fp32", num_threads=1)])
    assert "batch 8" in str(compare) and "fp32" in str(compare)


def test_threads_are_fixed_while_measuring_and_restored():
    before = torch.get_num_threads()
    with fixed_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_weight_bytes_counts_parameters_and_buffers():
    model = nn.Sequential(nn.Linear(10, 5), nn.BatchNorm1d(5), nn.Linear(5, 3, bias=False).half())
    expected = (10 * 5 + 5) * 4 + (5 + 5 + 5 + 5) * 4 + 8 + 5 * 3 * 2  # BN: weight, bias, mean, var; int64 counter
    assert weight_bytes(model) == expected


def test_weight_bytes_counts_a_tied_weight_once():
    embed, out = nn.Embedding(100, 16), nn.Linear(16, 100, bias=False)
    out.weight = embed.weight
    assert weight_bytes(nn.Sequential(embed, out)) == 100 * 16 * 4


class _Counted(nn.Module):
    """`inner`, counting its calls and sleeping `sleep_s` in each (a dtype emulated far slower than fp32), and
    `first_s` more in the first call of every `_Counted` of its dtype (what a dtype's first use initialises)."""

    started: set[str] = set()

    def __init__(self, inner, sleep_s, calls, dtype, first_s=0.0):
        super().__init__()
        self.inner, self.sleep_s, self.calls, self.dtype, self.first_s = inner, sleep_s, calls, dtype, first_s

    def forward(self, x):
        import time
        self.calls[self.dtype] += 1
        time.sleep(self.sleep_s + (self.first_s if self.dtype not in self.started else 0.0))
        self.started.add(self.dtype)
        return self.inner(x)


def _module_latency(monkeypatch, sleeps: dict[str, float], first_s: dict[str, float], modules: int = 1):
    """module_latency on `modules` Linear layers whose dtypes sleep as given; returns (timings, calls per dtype)."""
    import collections

    from autotune.measure import module_latency as per_module
    calls = collections.Counter()
    monkeypatch.setattr(_Counted, "started", set())
    monkeypatch.setattr(per_module, "lower_module", lambda module, dtype, calibration: _Counted(
        module, sleeps[dtype], calls, dtype, first_s.get(dtype, 0.0)))
    model = nn.Sequential(*(nn.Linear(64, 64 + index) for index in range(modules)))   # not twins: each is timed
    candidates = {str(index): list(sleeps) for index in range(modules)}
    calibration = {name: ((torch.randn(8, 64),), {}) for name in candidates}
    return per_module.module_latency(model, candidates, calibration, repeats=15, num_threads=1), calls


def test_a_dtype_many_times_slower_than_fp32_is_costed_from_one_or_two_calls_not_timed_in_rounds(monkeypatch):
    timings, calls = _module_latency(monkeypatch, {"int8": 0.0, "bf16": 0.03, "fp32": 0.0}, {}, modules=2)
    assert all(timings[name]["bf16"] >= 30.0 > 10 * timings[name]["fp32"] for name in timings)
    # The first module: a first call and two warm ones, both past twice fp32's. The second: bf16 has run before,
    # and its first two calls are far past fp32's first.
    assert calls["bf16"] == 3 + 2
    assert calls["int8"] > 2 * 3 * MIN_ROUNDS      # the others are timed in interleaved rounds of blocks
    assert all(timings[name]["int8"] < 1.0 for name in timings)


def test_modules_of_one_type_weight_shapes_and_inputs_are_timed_once(monkeypatch, caplog):
    """A BERT-base's 72 encoder Linears are four kinds: timing each alone took most of the per-module timing."""
    import collections
    import logging

    from autotune.measure import module_latency as per_module
    calls = collections.Counter()
    monkeypatch.setattr(_Counted, "started", set())
    monkeypatch.setattr(per_module, "lower_module", lambda module, dtype, calibration: _Counted(
        module, 0.0, calls, (dtype, module.out_features, calibration[0][0].shape[0]), 0.0))
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 64))
    candidates = {str(index): ["int8", "fp32"] for index in range(4)}
    rows = {"0": 8, "1": 8, "2": 8, "3": 4}     # the last sees other inputs
    calibration = {name: ((torch.randn(rows[name], 64),), {}) for name in candidates}
    with caplog.at_level(logging.INFO, logger="autotune"):
        timings = per_module.module_latency(model, candidates, calibration, repeats=3, num_threads=1)
    assert {kind for kind, _, _ in calls} == {"int8", "fp32"}
    assert {(out, rows) for _, out, rows in calls} == {(64, 8), (32, 8), (64, 4)}   # "1" is "0"'s twin
    assert timings["1"] == timings["0"] and set(timings) == set(candidates)
    assert "4 modules timed alone as 3 kinds" in caplog.text


def test_a_slow_first_use_of_a_dtype_does_not_prune_it(monkeypatch):
    timings, calls = _module_latency(monkeypatch, {"int8": 0.0, "fp32": 0.0}, {"int8": 0.05})
    assert timings["0"]["int8"] < 1.0              # timed in rounds once warm: its cost, not the first call's
    assert calls["int8"] > 2 + 1    # its first and warm calls, then the rounds' (one call, then timed blocks)


def test_a_dtype_twice_as_slow_as_fp32_when_warm_is_costed_from_its_warm_call(monkeypatch):
    timings, calls = _module_latency(monkeypatch, {"int8": 0.006, "fp32": 0.002}, {}, modules=2)
    assert calls["int8"] == 3 + 3   # a first and two warm calls per module: the first is not 8x fp32's
    assert all(6.0 <= timings[name]["int8"] for name in timings)


def test_one_call_descheduled_on_a_busy_host_does_not_prune_a_dtype(monkeypatch):
    """One int8 call of a Linear read 3.9 ms where it runs in 0.025 (the process descheduled on a busy host), and
    int8 was pruned from the whole search: a verdict now takes two calls past its bar."""
    import collections
    import time

    from autotune.measure import module_latency as per_module
    calls = collections.Counter()

    class OnceSlow(nn.Module):
        def __init__(self, inner, dtype):
            super().__init__()
            self.inner, self.dtype = inner, dtype

        def forward(self, x):
            calls[self.dtype] += 1
            if self.dtype == "int8" and calls["int8"] == 2:    # its warm call
                time.sleep(0.03)
            return self.inner(x)
    monkeypatch.setattr(per_module, "lower_module", lambda module, dtype, calibration: OnceSlow(module, dtype))
    model = nn.Sequential(nn.Linear(64, 64))
    timings = per_module.module_latency(model, {"0": ["int8", "fp32"]}, {"0": ((torch.randn(8, 64),), {})},
                                        repeats=5, num_threads=1)
    assert timings["0"]["int8"] < 5.0 and calls["int8"] > 3      # timed in rounds, not costed from one call


@pytest.mark.parametrize("warmup", [2, 0])
def test_a_long_call_is_sampled_alone_a_short_one_in_blocks_each_round(monkeypatch, warmup):
    import collections

    from autotune.measure import latency
    calls = collections.Counter()
    monkeypatch.setattr(latency, "LONG_CALL_S", 0.01)
    models = {"fp32": _Counted(nn.Identity(), 0.0, calls, "fp32"),
              "slow": _Counted(nn.Identity(), 0.02, calls, "slow")}
    stats = measure_latency(models, ((torch.randn(4, 4),), {}), warmup=warmup, repeats=4)
    rounds = stats["slow"].repeats
    assert rounds == stats["fp32"].repeats >= MIN_ROUNDS
    assert calls["slow"] == warmup + rounds           # the warm-up calls, then one call per sample
    # Each sample of the short call is Timer's: a call that sizes the block (and warms up again), then the timed
    # block: ten or more calls where the machine is quiet, one where a loaded host stretched a call past BLOCK_S.
    if warmup:
        assert calls["fp32"] >= warmup + rounds * 2
    else:        # models already warm: the first sample is one call, which tells long calls apart
        assert calls["fp32"] >= 1 + (rounds - 1) * 2
    assert 20.0 <= stats["slow"].median_ms < 40.0


def test_the_device_measurer_warms_models_up_as_configured_unless_told_they_are_warm(monkeypatch):
    import collections

    from autotune import MixedPrecisionConfig, TuningConfig
    from autotune.measure import latency
    from autotune.measure.measurer import DeviceMeasurer
    monkeypatch.setattr(latency, "LONG_CALL_S", 0.01)   # every sample below is one call
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), warmup=4, repeats=3)
    for warmup, expected in ((None, 4), (1, 1), (0, 0)):
        calls = collections.Counter()
        models = {name: _Counted(nn.Identity(), 0.015, calls, name) for name in ("fp32", "plan")}
        stats = DeviceMeasurer(config).latency(models, ((torch.randn(2, 2),), {}), 3, warmup)
        assert all(calls[name] == expected + stats[name].repeats for name in models), (warmup, calls)


def test_a_variant_timed_in_fewer_rounds_is_compared_with_fp32s_same_rounds():
    from autotune.measure.latency import LatencyStats
    from autotune.measure.measurer import ratios_to_fp32
    fp32 = LatencyStats(5.0, 2.5, 8, (10.0, 10.0, 10.0, 5.0, 5.0, 5.0, 5.0, 5.0))   # a loaded spell, then quiet
    stopped = LatencyStats(6.0, 0.0, 3, (6.0, 6.0, 6.0))           # the race stopped timing it after 3 rounds
    raced = LatencyStats(4.0, 2.0, 8, (8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 4.0, 4.0))
    ratios = {name: ratios_to_fp32({"b": {"fp32": fp32, name: stats}}, name)["b"]
              for name, stats in (("stopped", stopped), ("raced", raced))}
    # Its medians alone would put `stopped` at 6/5 = 1.2x fp32's time and `raced` at 0.8x; round by round,
    # `stopped` ran at 0.6x, the faster of the two.
    assert ratios == {"stopped": pytest.approx(0.6), "raced": pytest.approx(0.8)}
    assert LatencyStats(3.0, 0.1, 5).ratio_to(LatencyStats(4.0, 0.1, 5)) == pytest.approx(0.75)   # no samples kept


def test_the_summary_says_how_far_off_a_speedup_timed_noisily_may_be():
    """The warning went to the log while summary() printed the bare figure: a Mistral reported 2.79x, and ran at
    1.08x timed again."""
    from types import SimpleNamespace

    from autotune.measure.latency import LatencyStats
    from autotune.result import Measurement, TuningResult

    def result(best_samples):
        fp32 = LatencyStats(10.0, 0.0, 5, (10.0,) * 5)
        best = LatencyStats(sorted(best_samples)[2], 0.0, 5, tuple(best_samples))
        return TuningResult(nn.Linear(2, 2), {"0": "int8"}, Measurement(1.0, fp32, 8), Measurement(1.0, best, 4),
                            SimpleNamespace(study_name="s", user_attrs={}), 3, 3, 1.0)
    assert "speedup 2.00x   plan" in result([5.0, 5.0, 5.1, 4.9, 5.0]).summary()
    noisy = result([2.0, 8.0, 5.0, 3.0, 9.0]).summary()
    assert "speedup 2.00x (±" in noisy and " %: noisy timing)   plan" in noisy


def test_the_summary_counts_one_trial_and_one_call_in_the_singular():
    """A study of one evaluated trial read "1 evaluated trials; 1 eval_fn calls this run"."""
    from types import SimpleNamespace

    from autotune.measure.latency import LatencyStats
    from autotune.result import Measurement, TuningResult

    def summary(calls: int, trials: int) -> str:
        fp32, best = (LatencyStats(ms, 0.0, 5, (ms,) * 5) for ms in (10.0, 5.0))
        return TuningResult(nn.Linear(2, 2), {"0": "int8"}, Measurement(1.0, fp32, 8), Measurement(1.0, best, 4),
                            SimpleNamespace(study_name="s", user_attrs={}), calls, trials, 1.0).summary()
    assert "study 's': 1 evaluated trial; 1 eval_fn call this run;" in summary(1, 1)
    assert "study 's': 2 evaluated trials; 0 eval_fn calls this run;" in summary(0, 2)


def test_the_summary_says_why_its_medians_can_disagree_with_the_speedup():
    """A GPT-2's summary showed the tuned median above fp32's on the row above "speedup 1.08x", with no word why."""
    from types import SimpleNamespace

    from autotune.measure.latency import LatencyStats
    from autotune.result import Measurement, TuningResult

    def result(fp32_samples, best_samples):
        fp32, best = (LatencyStats(sorted(samples)[2], 0.0, 5, tuple(samples))
                      for samples in (fp32_samples, best_samples))
        return TuningResult(nn.Linear(2, 2), {"0": "int8"}, Measurement(1.0, fp32, 8), Measurement(1.0, best, 4),
                            SimpleNamespace(study_name="s", user_attrs={}), 3, 3, 1.0)
    # Round by round the tuned model ran at 0.9 of fp32; the busy rounds fell on its samples more.
    busy = result([10.0, 20.0, 10.0, 30.0, 10.0], [9.0, 18.0, 27.0, 27.0, 9.0]).summary()
    assert "speedup 1.11x" in busy and "the medians above disagree with the speedup" in busy
    assert "disagree" not in result([10.0] * 5, [9.0] * 5).summary()


def _spin(seconds: float, spinning) -> None:
    import time
    end = time.monotonic() + seconds
    spinning.release()
    while time.monotonic() < end:
        pass


def test_timing_beside_processes_that_keep_the_cpus_busy_is_told_and_the_summary_says_the_speedup_may_be_far_off():
    """On a 2-core host beside other work, a model timed on 2 threads ran 100x its quiet time, steadily: the spread
    raised no doubt, and a plan timed at 1.46x fp32 ran 0.48x alone."""
    import multiprocessing
    import os
    import time
    from types import SimpleNamespace

    from autotune.measure.host_load import contended, other_work
    from autotune.measure.latency import LatencyStats
    from autotune.result import Measurement, TuningResult

    if not os.path.exists("/proc/stat"):
        pytest.skip("the CPUs' busy time is read from Linux's /proc/stat")
    cpus = os.cpu_count() or 1
    context = multiprocessing.get_context("spawn")
    spinning = context.Semaphore(0)
    burners = [context.Process(target=_spin, args=(30.0, spinning)) for _ in range(min(cpus, 4))]
    for burner in burners:
        burner.start()
    for _ in burners:   # each started spinning (a spawned process takes a moment to come up)
        assert spinning.acquire(timeout=60)
    try:
        with other_work() as others:   # this process idle for a second: the spinning ones' work is what is read
            time.sleep(1.0)
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).eval()
        timed = measure_latency({"a": model, "b": model}, ((torch.randn(64, 256),), {}), repeats=5, num_threads=cpus)
    finally:
        for burner in burners:
            burner.kill()
    assert others[0] > 0.5 * len(burners), others
    assert timed["a"].others_cpus is not None and timed["a"].threads == cpus
    assert not contended(None, 1) and not contended(0.2, cpus) and contended(cpus, 1)

    def summary(busy: float) -> str:
        fp32, best = (LatencyStats(ms, 0.0, 5, (ms,) * 5, busy, cpus) for ms in (10.0, 5.0))
        return TuningResult(nn.Linear(2, 2), {"0": "int8"}, Measurement(1.0, fp32, 8), Measurement(1.0, best, 4),
                            SimpleNamespace(study_name="s", user_attrs={}), 3, 3, 1.0).summary()
    assert "other processes kept the CPUs busy while it was timed: the speedup may be far off" in summary(cpus)
    assert "busy" not in summary(0.0)


@pytest.mark.parametrize("of_medians, per_round, disagree", [
    (1.3 / 61.5, 1 / 1.16, True),   # a busy host's bench: 47x in the table where the rounds said 1.16x
    (1.1, 0.9, True),               # one slower than fp32, the other faster
    (0.5, 0.52, False),
    (0.5, 0.7, False),
])
def test_medians_and_per_round_ratios_are_told_apart_where_they_tell_different_stories(of_medians, per_round,
                                                                                        disagree):
    from autotune.result import medians_disagree
    assert medians_disagree(of_medians, per_round) is disagree


@pytest.mark.parametrize("others_cpus, warned", [(64.0, True), (0.0, False)])
def test_per_module_timings_taken_beside_busy_processes_are_warned_of(monkeypatch, caplog, others_cpus, warned):
    """Timed beside other users' compiler jobs, every module's int8 and fp32 cost read as multiples of 7.9 ms (a
    scheduler's slices): the search pruned every dtype, and only the final speedup was said to be doubtful."""
    import contextlib
    import logging

    from autotune.config import TuningConfig
    from autotune.measure import measurer

    @contextlib.contextmanager
    def other_work():
        yield [others_cpus]
    monkeypatch.setattr(measurer, "other_work", other_work)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    inputs = ((torch.randn(8, 64),), {})
    calibration = {"0": inputs, "2": ((torch.randn(8, 64),), {})}
    timing = measurer.DeviceMeasurer(TuningConfig(repeats=3, warmup=1))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        for _ in range(2):    # each shape latency_inputs names is timed so: the warning came once a shape
            timing.module_latency(model, {"0": ["int8", "fp32"], "2": ["int8", "fp32"]}, inputs, calibration)
    said = "other processes kept the CPUs busy (64.0 CPUs' worth) while each module was timed alone"
    assert caplog.text.count(said) == (1 if warned else 0), caplog.text


def _host(monkeypatch, tmp_path, meminfo: str | None, cgroup: str = "0::/\n", limits: dict | None = None):
    """memory.py reading a host made under tmp_path in place of /proc and /sys: `meminfo` (None: unreadable),
    /proc/self/cgroup's text, and {folder under the cgroup root: (limit, usage[, memory.stat])}."""
    from autotune.measure import memory
    root = tmp_path / f"host{len(list(tmp_path.iterdir()))}"
    root.mkdir()
    if meminfo is not None:
        (root / "meminfo").write_text(meminfo)
    (root / "cgroup").write_text(cgroup)
    for folder, (limit, usage, *stat) in (limits or {}).items():
        (root / "sys" / folder).mkdir(parents=True, exist_ok=True)
        names = memory.V1_FILES if folder.startswith("memory") else memory.V2_FILES
        (root / "sys" / folder / names[0]).write_text(limit)
        (root / "sys" / folder / names[1]).write_text(usage)
        if stat:
            (root / "sys" / folder / "memory.stat").write_text(stat[0])
    monkeypatch.setattr(memory, "MEMINFO", root / "meminfo")
    monkeypatch.setattr(memory, "CGROUPS", root / "cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root / "sys")
    return memory


MEMINFO = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:    8388608 kB\n"
GIB = 2 ** 30


def test_available_memory_is_memavailable_or_what_a_cgroups_limit_leaves_where_that_is_less(monkeypatch, tmp_path):
    """A container's or a service's limit is not in MemAvailable, which speaks of the whole host: under
    `docker run --memory 2g` on a 24 GiB host, building finalists until MemAvailable ran short would have the
    container killed first."""
    memory = _host(monkeypatch, tmp_path, MEMINFO)
    assert memory.available_bytes() == 8 * GIB
    # cgroup v2, its own namespace (a container): the root folder is its own
    memory = _host(monkeypatch, tmp_path, MEMINFO, limits={".": (str(2 * GIB), str(GIB))})
    assert memory.available_bytes() == GIB
    # the file cache in its usage that the kernel drops before it kills anything counts as free
    cached = f"file 9\ninactive_file {GIB // 2}\n"
    memory = _host(monkeypatch, tmp_path, MEMINFO, limits={".": (str(2 * GIB), str(GIB), cached)})
    assert memory.available_bytes() == GIB + GIB // 2
    memory = _host(monkeypatch, tmp_path, MEMINFO, limits={".": ("max\n", str(GIB))})      # no limit
    assert memory.available_bytes() == 8 * GIB
    memory = _host(monkeypatch, tmp_path, MEMINFO, limits={".": (str(GIB), str(2 * GIB))})  # over its limit
    assert memory.available_bytes() == 0
    # v2 on the host: a systemd service's MemoryMax on its slice, the tightest of the folders up to the root
    memory = _host(monkeypatch, tmp_path, MEMINFO, "0::/tune.slice/run.service\n",
                   {"tune.slice": (str(4 * GIB), str(GIB)), "tune.slice/run.service": ("max", str(GIB))})
    assert memory.available_bytes() == 3 * GIB
    # v1: the memory controller's own hierarchy; "no limit" is a number near 2**63
    memory = _host(monkeypatch, tmp_path, MEMINFO, "4:memory:/docker/abc\n0::/\n",
                   {"memory/docker/abc": (str(3 * GIB), str(2 * GIB), f"inactive_file 0\ntotal_inactive_file {GIB}\n")})
    assert memory.available_bytes() == 2 * GIB
    memory = _host(monkeypatch, tmp_path, MEMINFO, "4:memory:/docker/abc\n",
                   {"memory/docker/abc": ("9223372036854771712", str(GIB))})
    assert memory.available_bytes() == 8 * GIB
    # lines and files it cannot read, and a namespace whose path starts above it, are passed over
    memory = _host(monkeypatch, tmp_path, MEMINFO, "garbage\n0::/../../x\n",
                   {".": ("banana", str(GIB)), "x": (str(2 * GIB), str(GIB))})
    assert memory.available_bytes() == GIB
    memory = _host(monkeypatch, tmp_path, None, "")     # nothing readable: not known, so never said to be short
    assert memory.available_bytes() is None
    assert memory.BuildMemory(weights=2 ** 40).too_little() is None


def test_this_hosts_memory_reads_as_linux_gives_it():
    from autotune.measure.memory import available_bytes, rss_bytes
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc here (not Linux): memory is not watched")
    assert 0 < rss_bytes() and 0 < available_bytes() < 2 ** 50


def test_a_build_is_taken_to_need_the_most_any_build_took_and_the_weights_are_kept_for_the_race(monkeypatch):
    from autotune.measure import memory
    rss = iter([100, 400, 400, 450])   # resident bytes before and after each of two builds: +300, +50
    monkeypatch.setattr(memory, "rss_bytes", lambda: next(rss))
    left = [1000]
    guard = memory.BuildMemory(weights=100, available=lambda: left[0])
    assert guard.build == 200 and guard.too_little() is None     # twice the weights until a build shows more
    for _ in range(2):
        with guard.measuring():
            pass
    assert guard.largest == 300 and guard.build == 300
    left[0] = 400
    assert guard.too_little() is None           # a build (300) and the race's reserve (the weights, 100)
    left[0] = 399
    assert guard.too_little() == ("only 0.0 MiB of memory is left, a finalist's build took up to 0.0 MiB, and the "
                                  "race after needs about the weights again")
    assert memory.BuildMemory(weights=2 ** 30, available=lambda: 2 ** 30).too_little() == (
        "only 1.0 GiB of memory is left, a finalist's build may take twice the model's weights, 2.0 GiB, and the race "
        "after needs about the weights again")
