"""The low-precision engine: the whole model in the plan's low dtype (LayerNorm and activations too, as
`model.half()` does), the plan's fp32 modules as fp32 islands with their weights unrounded, casts only at the
edges, the given model untouched; it realises one low dtype and fp32 only."""
import pytest
import torch
from conftest import HalfCostMeasurer, assert_state_equal, export_then_apply, fidelity, is_compiled, state_snapshot
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.engines import Calibration, LowPrecisionEngine
from autotune.measure import LatencyStats

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
PLAN = {"0": "bf16", "3": "fp32", "4": "bf16"}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 4)).eval()


def test_the_model_runs_in_the_low_dtype_with_fp32_islands_and_fp32_at_its_edges():
    fp32 = model()
    before = state_snapshot(fp32)
    built = LowPrecisionEngine().build(fp32, PLAN, Calibration([], {}))
    assert built[0].weight.dtype == built[1].weight.dtype == built[4].weight.dtype == torch.bfloat16
    assert built[3].weight.dtype == torch.float32 and torch.equal(built[3].weight, fp32[3].weight)
    seen = {}
    built[3].register_forward_pre_hook(lambda m, args: seen.update(island=args[0].dtype))
    built[4].register_forward_pre_hook(lambda m, args: seen.update(after=args[0].dtype))
    with torch.no_grad():
        out, reference = built(X), fp32(X)
    assert seen == {"island": torch.float32, "after": torch.bfloat16}
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)
    assert_state_equal(fp32, before)


class CachedTable(nn.Module):
    """A table computed in its input's dtype on the first call and kept as a plain attribute (not a buffer), as
    Wav2Vec2-Conformer keeps its rotary embedding."""

    def __init__(self):
        super().__init__()
        self.proj, self.table = nn.Linear(16, 16), None

    def forward(self, x):
        if self.table is None:
            self.table = torch.eye(16).type_as(x)
        return torch.matmul(self.proj(x), self.table)


def test_a_cache_held_as_a_plain_attribute_and_filled_in_fp32_runs_in_the_low_dtype():
    """The model was called in fp32 before it is built (the baseline, the signals): its cache held fp32, and the
    matmul met a bf16 input: "expected both operands to have the same dtype"."""
    torch.manual_seed(0)
    fp32 = nn.Sequential(CachedTable(), nn.Linear(16, 4)).eval()
    with torch.no_grad():
        reference = fp32(X)
    built = LowPrecisionEngine().build(fp32, {"0.proj": "bf16", "1": "bf16"}, Calibration([], {}))
    with torch.no_grad():
        out = built(X)
    assert built[0].table.dtype == torch.bfloat16 and fp32[0].table.dtype == torch.float32
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)


class PositionsOnTheFly(nn.Module):
    """Sinusoidal positions computed in the forward, in fp32 whatever the weights' dtype."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm, self.proj = nn.Embedding(100, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(1) / 10000 ** (torch.arange(32) / 32)
        return self.proj(self.norm(self.embed(ids) + torch.sin(positions)))


def test_a_tensor_the_forward_builds_in_fp32_meets_the_low_dtype_weights_cast_to_it():
    """The sum of the bf16 embedding and the fp32 positions was fp32, and the bf16 LayerNorm refused it: "mixed
    dtype (CPU): expect parameter to have scalar type of Float"; the engine was left out of such a model's run."""
    torch.manual_seed(0)
    fp32, ids = PositionsOnTheFly().eval(), torch.randint(0, 100, (4, 10))
    built = LowPrecisionEngine().build(fp32, {"embed": "bf16", "proj": "bf16"}, Calibration([], {}))
    seen = []
    built.proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with torch.no_grad():
        out, reference = built(ids), fp32(ids)
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert torch.allclose(out, reference, atol=0.1, rtol=0.05)
    island = LowPrecisionEngine().build(fp32, {"embed": "bf16", "proj": "fp32"}, Calibration([], {}))
    island.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.no_grad():
        island(ids)
    assert seen[-1] == torch.float32 and island.proj.weight.dtype == torch.float32    # the island stays fp32


class TiedLM(nn.Module):
    """A language model whose head shares the embedding's weight, as GPT-2's does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.body, self.head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.embed(ids))))


def test_an_fp32_island_tied_to_a_weight_in_the_low_dtype_keeps_its_own_fp32_copy():
    fp32, ids = TiedLM().eval(), torch.randint(0, 50, (2, 7))
    built = LowPrecisionEngine().build(fp32, {"body": "bf16", "head": "fp32"}, Calibration([], {}))
    assert built.embed.weight.dtype == torch.bfloat16 and built.head.weight.dtype == torch.float32
    assert torch.equal(built.head.weight, fp32.head.weight)
    with torch.no_grad():
        out, reference = built(ids), fp32(ids)
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)
    assert fp32.head.weight is fp32.embed.weight and fp32.embed.weight.dtype == torch.float32   # left as it was


@pytest.mark.parametrize(("plan", "reason"), [
    ({"0": "fp32", "3": "fp32", "4": "fp32"}, "every module in fp32"),
    ({"0": "int8", "3": "fp32", "4": "bf16"}, "not ['int8']"),
    ({"0": "bf16", "3": "fp16", "4": "fp32"}, "one low dtype per model"),
])
def test_what_the_engine_cannot_realise_is_said(plan, reason):
    assert reason in LowPrecisionEngine().unsupported(plan, model())


def test_saved_and_loaded_it_runs_the_same_and_compiled_it_agrees(tmp_path):
    engine = LowPrecisionEngine()
    built = engine.build(model(), PLAN, Calibration([], {}))
    engine.save(built, ((X,), {}), str(tmp_path / "m.pt"))
    loaded = engine.load(str(tmp_path / "m.pt"))
    with torch.no_grad():
        assert torch.equal(loaded(X), built(X))
        assert torch.allclose(engine.runnable(loaded)(X), built(X), atol=1e-2)


class LowpIsFastest(HalfCostMeasurer):
    """Whole-model timings in which a compiled model runs at 0.3 of fp32, an eager lowered one at 0.8."""

    def latency(self, models, inputs, repeats, warmup=None):
        def ms(name, model):
            return 10.0 if name == "fp32" else 3.0 if is_compiled(model) else 8.0
        return {name: LatencyStats(ms(name, model), 0.0, repeats) for name, model in models.items()}


def test_the_tuner_returns_a_lowp_winner_that_export_and_apply_rebuild(tmp_path):
    fp32 = model()
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["bf16", "fp32"]), tolerable_loss=0.2,
                          max_trials=3, engines=["eager", "lowp"], storage=f"sqlite:///{tmp_path}/l.db",
                          study_name="lowp", compile_cache=str(tmp_path / "cache"))
    result = autotune(fp32, config, fidelity(fp32, X), X, measurer=LowpIsFastest())
    assert result.engine == "lowp" and result.speedup == pytest.approx(10 / 3)
    assert set(result.plan.values()) <= {"bf16", "fp32"} and "bf16" in result.plan.values()

    saved, output = export_then_apply(tmp_path, "lowp", f"sqlite:///{tmp_path}/l.db", "test_lowp:model",
                                      "test_lowp:inputs")
    assert saved["engine"] == "lowp" and "lowp engine" in output
    rebuilt = torch.load(tmp_path / "applied.pt", weights_only=False)
    with torch.no_grad():
        out, reference = rebuilt(X), fp32(X)
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)
    lowered = [name for name, dtype in result.plan.items() if dtype == "bf16"]
    assert all(rebuilt.get_submodule(name).weight.dtype == torch.bfloat16 for name in lowered)


def inputs():
    return X
