"""CUDA paths: run on a GPU machine with its own CUDA build of torch (`make test-gpu`), skip cleanly elsewhere (the
CPU wheel this project pins has no CUDA)."""
import copy

import torch
from conftest import RecordedEval, assert_one_call_per_trial, assert_state_equal, needs_cuda, state_snapshot
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.plan import plan_of
from autotune.storage.study import evaluated_trials, trial_plan

pytestmark = needs_cuda()
MODULES = ["0", "2"]


def test_tuning_on_cuda_prunes_cpu_only_int8_meets_the_tolerance_and_leaves_the_model_alone(storage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048)).eval()
    before = state_snapshot(model)
    inputs = torch.randn(4096, 2048, device="cuda")
    with torch.inference_mode():
        reference = copy.deepcopy(model).cuda()(inputs)

    def score(net):
        with torch.inference_mode():
            return nn.functional.cosine_similarity(net(inputs), reference, dim=1).mean().item()

    eval_fn = RecordedEval(score, MODULES)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp16", "fp32"]),
                          tolerable_loss=0.01, max_trials=6, device="cuda", storage=storage)
    result = autotune(model, config, eval_fn, example_inputs=inputs)

    # Chosen dtypes: int8 has no CUDA technique, so it is not even a candidate; the half dtypes are, and what is
    # chosen for a module was not measured slower than fp32 for it (the study keeps the measurements).
    candidates = result.study.user_attrs["autotune.candidates"]
    assert set(candidates) == set(MODULES) and all("int8" not in dtypes for dtypes in candidates.values())
    assert all({"fp16", "fp32"} <= set(dtypes) for dtypes in candidates.values())
    latency = result.study.user_attrs["autotune.module_latency_ms"]
    assert set(result.plan) == set(MODULES) and set(result.plan.values()) <= {"bf16", "fp16", "fp32"}
    for name, dtype in result.plan.items():
        assert latency[name][dtype] <= latency[name]["fp32"], (name, dtype, latency[name])
    # 4096 x 2048 x 2048 matmuls: half precision runs on the tensor cores, so a lowered plan wins.
    assert set(result.plan.values()) & {"bf16", "fp16"}, result.plan
    assert plan_of(result.model, MODULES) == result.plan          # the returned model holds the plan
    assert {p.device.type for p in result.model.parameters()} == {"cuda"}
    assert result.speedup > 1.0

    # Tolerance: as recorded, and re-checked here on the returned model.
    assert config.passes(result.baseline.accuracy, result.best.accuracy)
    assert config.passes(result.baseline.accuracy, score(result.model))
    trials = evaluated_trials(result.study)
    assert all(t.user_attrs["passed"] == config.passes(result.baseline.accuracy, t.user_attrs["accuracy"])
               for t in trials)
    assert any(trial_plan(t) == result.plan and t.user_attrs["passed"] for t in trials)
    assert_one_call_per_trial(eval_fn, 0, result, trials)

    # The user's model: bit for bit as it was, still on the CPU.
    assert_state_equal(model, before)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_the_low_precision_engine_runs_the_model_in_fp16_with_fp32_islands_on_cuda():
    from autotune.engines import Calibration, LowPrecisionEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256)).eval().cuda()
    x = torch.randn(64, 256, device="cuda")
    engine = LowPrecisionEngine()
    built = engine.build(model, {"0": "fp16", "3": "fp32"}, Calibration([], {}))
    assert built[0].weight.dtype == built[1].weight.dtype == torch.float16 and built[3].weight.dtype == torch.float32
    with torch.no_grad():
        out = engine.runnable(built)(x)
        assert out.dtype == torch.float32 and torch.allclose(out, model(x), atol=0.05, rtol=0.05)
