"""CUDA paths: run where a GPU is present, skip cleanly elsewhere (CI has none)."""
import pytest
import torch
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_tuning_on_cuda_prunes_cpu_only_int8_and_returns_a_cuda_model(storage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 2048))
    inputs = torch.randn(4096, 2048, device="cuda")
    reference = model.cuda()(inputs).detach()
    model = model.cpu()

    def eval_fn(net):
        with torch.inference_mode():
            return nn.functional.cosine_similarity(net(inputs), reference, dim=1).mean().item()

    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp16", "fp32"]),
                          tolerable_loss=0.01, max_trials=6, device="cuda", storage=storage)
    result = autotune(model, config, eval_fn, example_inputs=inputs)
    assert "int8" not in result.study.user_attrs["autotune.candidates"]["0"]
    assert next(result.model.parameters()).device.type == "cuda"
    assert result.speedup > 1.0
