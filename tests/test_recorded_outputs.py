"""transformers 5 models saved by the engines (`autotune apply`, the compile cache) and loaded in a fresh process:
a backbone's output-capturing hooks made torch.save refuse the model, and a model asking for its hidden states came
back without them."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from autotune.engines import Calibration, get_engine

transformers = pytest.importorskip("transformers")

IMAGE = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
TOKENS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def depth_anything() -> nn.Module:
    """A DINOv2 backbone (hooks installed as it is built) under a depth head."""
    torch.manual_seed(0)
    backbone = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                         intermediate_size=64, image_size=56, patch_size=14,
                                         out_features=["stage1", "stage2", "stage3", "stage4"],
                                         reshape_hidden_states=False)
    config = transformers.DepthAnythingConfig(backbone_config=backbone, neck_hidden_sizes=[16, 32, 64, 64],
                                              fusion_hidden_size=32, reassemble_hidden_size=32, head_hidden_size=16,
                                              patch_size=14)
    return transformers.DepthAnythingForDepthEstimation(config).eval()


def llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64)
    return transformers.LlamaForCausalLM(config).eval()


def depth(model):
    return model(IMAGE).predicted_depth


def hidden_states(model):
    found = model(TOKENS, output_hidden_states=True).hidden_states
    return None if found is None else torch.stack(found)


CASES = {"depth_anything": (depth_anything, depth, (IMAGE,)), "llama": (llama, hidden_states, (TOKENS,))}

LOAD_FRESH = """
import sys, torch
import test_recorded_outputs as case
from autotune.engines import get_engine
folder, engine = sys.argv[1:]
for name, (_, outputs, _) in case.CASES.items():
    loaded = get_engine(engine).load(f"{folder}/{name}.pt")
    with torch.no_grad():
        found = outputs(loaded)
    print(name, "none" if found is None else torch.equal(found, torch.load(f"{folder}/{name}.out")))
"""


@pytest.mark.parametrize("engine", ["eager", "lowp"])
def test_a_transformers_model_saved_records_its_outputs_where_it_is_loaded(tmp_path, engine):
    plans = {"depth_anything": {"backbone.encoder.layer.0.mlp.fc1": "bf16", "head.conv1": "bf16"},
             "llama": {"model.layers.0.mlp.up_proj": "bf16", "model.layers.1.self_attn.q_proj": "bf16"}}
    if engine == "eager":
        plans["llama"]["model.layers.1.mlp.down_proj"] = "int8"
    for name, (build, outputs, args) in CASES.items():
        model = build()
        with torch.no_grad():
            outputs(model)     # the hooks are installed (the backbone's as it was built)
        built = get_engine(engine).build(model, plans[name], Calibration([(args, {})], {}))
        hooks = {key: len(module._forward_hooks) for key, module in built.named_modules()}
        assert sum(hooks.values()) > 0
        with torch.no_grad():
            expected = outputs(built)
        get_engine(engine).save(built, (args, {}), str(tmp_path / f"{name}.pt"))
        torch.save(expected, tmp_path / f"{name}.out")
        # the model saved is as it was: its hooks in place, its outputs the same
        assert {key: len(module._forward_hooks) for key, module in built.named_modules()} == hooks
        with torch.no_grad():
            assert torch.equal(outputs(built), expected)

    loaded = subprocess.run([sys.executable, "-c", LOAD_FRESH, str(tmp_path), engine], capture_output=True,
                            text=True, timeout=300,
                            env={"PYTHONPATH": ":".join(sys.path), "PATH": "/usr/bin:/bin"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == ["depth_anything", "True", "llama", "True"], loaded.stderr[-3000:]
