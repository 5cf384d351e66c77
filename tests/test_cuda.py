"""CUDA paths: run on a GPU machine with its own CUDA build of torch (`make test-gpu`), skip cleanly elsewhere (the
CPU wheel this project pins has no CUDA)."""
import copy

import pytest
import torch
from conftest import RecordedEval, assert_one_call_per_trial, assert_state_equal, held_plan, needs_cuda, state_snapshot
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
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
    assert held_plan(result.model, MODULES) == result.plan        # the returned model holds the plan
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


def cuda_mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)).eval().cuda()


def test_the_gpu_knobs_apply_on_cuda():
    from autotune.engines import KNOBS

    model = cuda_mlp()
    assert KNOBS["autocast"].supports(model) is None and KNOBS["cuda_graphs"].supports(model) is None
    major, minor = torch.cuda.get_device_capability()
    assert KNOBS["tf32"].supports(model) == (None if major >= 8 else   # an H100 has 9.0
                                             "TF32 needs a CUDA device with compute capability >= 8.0; "
                                             f"cuda:0 has {major}.{minor}")


def test_tf32_runs_this_model_in_tf32_only_eager_and_compiled_and_leaves_the_process_setting_alone():
    from autotune.engines import KNOBS, InductorEngine

    model, x = cuda_mlp(), torch.randn(512, 1024, device="cuda")
    assert torch.backends.cuda.matmul.allow_tf32 is False
    tf32 = KNOBS["tf32"].apply(model)
    with torch.no_grad():
        reference = model(x)
        eager = tf32(x)
        compiled = InductorEngine().runnable(tf32)(x)
        again = model(x)
    for out in (eager, compiled):
        assert torch.allclose(out, reference, rtol=1e-2, atol=1e-2)
    assert not torch.equal(eager, reference)                  # TF32 rounding shows on a 1024-wide matmul
    assert torch.equal(again, reference) and torch.backends.cuda.matmul.allow_tf32 is False


def test_autocast_runs_linears_in_fp16_on_cuda_with_fp32_outputs():
    from autotune.engines import KNOBS

    model, x = cuda_mlp(), torch.randn(64, 1024, device="cuda")
    seen = []
    cast = KNOBS["autocast"].apply(model)
    cast[0].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    with torch.no_grad():
        out, reference = cast(x), model(x)
    assert seen == [torch.float16] and out.dtype == torch.float32
    assert torch.allclose(out, reference, rtol=2e-2, atol=2e-2) and not torch.is_autocast_enabled("cuda")


def test_cuda_graphs_replay_the_same_outputs_as_eager_at_two_batch_sizes():
    from autotune.engines import KNOBS, Calibration, InductorEngine, LowPrecisionEngine

    model = cuda_mlp(256)
    marked = KNOBS["cuda_graphs"].apply(model)
    fp32 = InductorEngine().runnable(InductorEngine().build(marked, {"0": "fp32", "2": "fp32"}, Calibration([], {})))
    half = LowPrecisionEngine().runnable(LowPrecisionEngine().build(marked, {"0": "fp16", "2": "fp16"},
                                                                    Calibration([], {})))
    for batch in (8, 32, 8):
        x = torch.randn(batch, 256, device="cuda")
        with torch.inference_mode():
            reference = model(x)
            for _ in range(3):                                # warm-up, recording, replays
                a, b = fp32(x).clone(), half(x).clone()
        assert torch.allclose(a, reference, atol=1e-4) and torch.allclose(b, reference, atol=0.05)


def test_tuning_on_cuda_tries_every_gpu_knob_in_the_engines_it_has_an_effect_in(storage):
    # Weight-bound at batch 8: fp16 halves the bytes read, so autocast is not ruled out as hopeless (at width 256 an
    # H200 measured the casts around fp16 modules at 3.8x their fp32 time, and autocast was rightly not tried).
    model = cuda_mlp(4096).cpu()
    x = torch.randn(8, 4096, device="cuda")
    with torch.inference_mode():
        reference = copy.deepcopy(model).cuda()(x)

    def score(net):
        with torch.inference_mode():
            return nn.functional.cosine_similarity(net(x), reference, dim=1).mean().item()

    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["bf16", "fp16", "fp32"]), tolerable_loss=0.01,
                          max_trials=4, device="cuda", storage=storage, engines=["eager", "inductor"])
    result = autotune(model, config, score, example_inputs=x)
    attrs = result.study.user_attrs
    assert set(attrs["autotune.knobs_not_tried"]) == {"channels_last", "fold_bn"}, attrs["autotune.knobs_not_tried"]
    setup = attrs["autotune.finalist_setup_s"]
    knobs = {engine: {name.rsplit(" +", 1)[1] for name in setup if " +" in name and ("(inductor)" in name) == inductor}
             for engine, inductor in [("eager", False), ("inductor", True)]}
    assert knobs["inductor"] == {"autocast", "tf32", "cuda_graphs"}   # its fp32 plan at least is a finalist
    eager_finalists = any("(" not in name for name in setup)
    assert knobs["eager"] == ({"autocast", "tf32"} if eager_finalists else set())   # eager compiles nothing
    assert config.passes(result.baseline.accuracy, score(result.model)) and result.speedup >= 1.0


@pytest.mark.parametrize("model_class", ["TinyDecoder", "TinyTranslator"])
def test_the_low_precision_engine_replays_a_generations_calls_compiled_on_cuda_cache_and_encoder_in_fp16(model_class):
    """What a GPU user runs as `model.half()` then `generate`: the recorded KV cache held the fp32 model's keys and
    the encoder generate calls apart got fp32 inputs, so the lowp engine failed on every model scored by generate."""
    import test_stateful_inputs as generation

    from autotune.capture import run_capturing
    from autotune.engines import CALLS_ITSELF, ENTRIES, Calibration, LowPrecisionEngine
    from autotune.model_call import call, entry_paths

    torch.manual_seed(0)
    model, prompt = getattr(generation, model_class)().eval().cuda(), generation.PROMPT.cuda()
    with torch.no_grad():
        _, recorded = run_capturing(model, lambda m: m.generate(prompt), stop_early=False)
        names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        built = LowPrecisionEngine().build(model, dict.fromkeys(names, "fp16"), Calibration(recorded, {}))
        setattr(built, CALLS_ITSELF, True)
        setattr(built, ENTRIES, entry_paths(recorded))
        runnable = LowPrecisionEngine().runnable(built)
        for recorded_call in recorded[:2]:
            out, reference = call(runnable, recorded_call), call(model, recorded_call)
            assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05, rtol=0.05)
