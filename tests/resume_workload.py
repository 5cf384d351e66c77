"""A workload with one clear answer for the kill-and-resume test (`tests/test_resume_kill.py`).

Five blocks of Linear(1024, 1024) + ReLU on 512 rows, where FBGEMM's int8 Linear is clearly faster than fp32.
Feature 0 is dead everywhere (zero in the inputs, and every layer's output 0 is ReLU(-1) = 0), so a huge weight
on input column 0 changes nothing in fp32. The SENSITIVE layers carry such an outlier in every output row: per-
channel int8 then scales each row by it and rounds every other weight of the row to zero, which wrecks the
layer. The eval_fn scores embedding fidelity (mean cosine similarity to the fp32 outputs on fixed inputs), so
the only passing plans keep the sensitive layers in fp32, and the fastest of them puts every other layer in
int8, whatever the latency noise.

YAML configs import it as `resume_workload:model` etc. with this folder on PYTHONPATH.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

WIDTH, ROWS, BLOCKS = 1024, 512, 5
SENSITIVE = (1, 3)          # block indices; as Sequential module names: "2" and "6"
OUTLIER = 1e4               # typical weights are below 1/32


def module_name(block: int) -> str:
    return str(2 * block)


def expected_plan() -> dict[str, str]:
    return {module_name(b): "fp32" if b in SENSITIVE else "int8" for b in range(BLOCKS)}


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for block in range(BLOCKS):
        linear = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            linear.weight[0].zero_()      # output feature 0 is ReLU(0 * x - 1) = 0: dead for the next layer
            linear.bias[0] = -1.0
            if block in SENSITIVE:
                linear.weight[:, 0] = OUTLIER   # multiplies the dead feature: harmless in fp32, fatal in int8
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers).eval()


def inputs(seed: int = 1, rows: int = ROWS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=generator)
    x[:, 0] = 0.0
    return x


def example_inputs() -> torch.Tensor:
    return inputs(seed=1)


def fidelity_eval(delay_s: float = 1.2, seed: int = 2):
    """eval_fn(model) -> mean cosine similarity of its outputs to the fp32 model's on fixed inputs.

    `delay_s` stands for a slow real evaluation, so that a test can kill the process in the middle of a study.
    """
    x = inputs(seed=seed)
    with torch.inference_mode():
        reference = model()(x)

    def eval_fn(candidate: nn.Module) -> float:
        time.sleep(delay_s)
        with torch.inference_mode():
            out = candidate(x)
        return F.cosine_similarity(out.float(), reference, dim=1).mean().item()

    return eval_fn


def write_config(folder: Path, study_name: str, evaluation: dict, **tuning) -> Path:
    """A YAML config tuning this workload into `folder`/s.db: int8 or fp32 per layer, tolerance 0.01, quick timing,
    finalists run eager (no compiling)."""
    config = {
        "model": {"factory": "resume_workload:model"},
        "evaluation": evaluation,
        "example_inputs": {"factory": "resume_workload:example_inputs"},
        "tuning": {"config_set": {"dtype": ["int8", "fp32"]}, "tolerable_loss": 0.01, "repeats": 5, "warmup": 1,
                   "num_threads": 1, "seed": 0, "engines": ["eager"], **tuning, "study_name": study_name,
                   "storage": f"sqlite:///{folder}/s.db"},
    }
    path = folder / f"{study_name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
