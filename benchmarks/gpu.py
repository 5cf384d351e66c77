"""GPU benchmark: autotune beside what a GPU user picks instead, at a small and a large batch per workload.

    make bench-gpu                                   # on a GPU machine, with its own torch (see the Makefile)
    python3 benchmarks/gpu.py [--workloads mnist,minilm] [--device cuda] [--quick] [--max-trials N] [--out FILE]
    .venv/bin/python benchmarks/gpu.py --device cpu --quick --workloads mnist    # the table's structure on a CPU
    MINILM_PACKED=DIR ...            # MiniLM from a folder benchmarks/minilm_pack.py wrote (a GPU machine lacks it)

For each workload (benchmarks/harness.py's real workloads) at each batch (MNIST CNN 250 and 5000, MiniLM sentiment
32 and 256), every candidate is built, scored once with the workload's eval_fn (its CPU batches moved to the
device), and all are timed interleaved in one run at that batch, fp32 eager among them (speedups are ratios within
that run):
  fp32 eager                   the model as given
  fp32 + TF32                  TF32 matmuls and convolutions for this model only (the tf32 knob); CUDA >= 8.0
  torch.autocast (AMP)         the forward under torch.autocast: fp16 on CUDA, bf16 on a CPU (the autocast knob)
  model.half()                 every parameter, buffer and activation in fp16, inputs and outputs cast at the edges
  torch.compile(model)         fp32, inductor's default mode
  torch.compile(model.half())  the same half model, compiled
  ... mode="reduce-overhead"   the same, compiled with CUDA graphs (CUDA only)
  autotune                     bf16/fp16/fp32 per module, engines eager, inductor and lowp, every knob, tolerance 0.01
                               relative, latency measured at that batch
Setup is what a candidate cost before it could serve: tuning, casting, compiling and its first call. Peak memory is
its weights plus the most its calls at that batch allocate on top of what was allocated before them
(torch.cuda.max_memory_allocated); a CUDA-graph candidate's memory pool, recorded during warm-up, is outside it.
On CUDA the report is also written to benchmarks/results-gpu.md (--out to change that).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from candidates import Candidate, relative_loss, tuned, warmed  # noqa: E402
from harness import TOLERANCE, real_workload  # noqa: E402

from autotune import MixedPrecisionConfig, TuningConfig  # noqa: E402
from autotune.capture import as_call_inputs, to_device  # noqa: E402
from autotune.clone import clone  # noqa: E402
from autotune.discovery import search_candidates  # noqa: E402
from autotune.engines import KNOBS, Calibration, LowPrecisionEngine, compile_model  # noqa: E402
from autotune.measure.latency import device_name, measure_latency  # noqa: E402
from autotune.measure.shapes import resize_batch  # noqa: E402
from autotune.model_call import call  # noqa: E402
from autotune.tree import map_tensors  # noqa: E402

BATCHES = {"mnist": (250, 5000), "minilm": (32, 256)}
DTYPES = ["bf16", "fp16", "fp32"]
ENGINES = ["eager", "inductor", "lowp"]
CUDA_GRAPHS = 'torch.compile(model.half(), mode="reduce-overhead")'
NAMES = ["fp32 eager", "fp32 + TF32", "torch.autocast (AMP)", "model.half()", "torch.compile(model)",
         "torch.compile(model.half())", CUDA_GRAPHS, "autotune"]


class OnDevice(nn.Module):
    """Hands `net` an eval_fn's CPU batches on `device`, and its outputs back on the CPU (for scoring only)."""

    def __init__(self, net: nn.Module, device: torch.device):
        super().__init__()
        self.net, self.device = net, device

    def forward(self, *args, **kwargs):
        args, kwargs = to_device((args, kwargs), self.device)
        return map_tensors(self.net(*args, **kwargs), lambda t: t.cpu())


def on_device(eval_fn: Callable[[nn.Module], float], device: torch.device) -> Callable[[nn.Module], float]:
    return eval_fn if device.type == "cpu" else lambda net: eval_fn(OnDevice(net, device))


def recipes(fp32: nn.Module, device: torch.device) -> dict[str, tuple[str | None, Callable[[], nn.Module]]]:
    """Each candidate but autotune: (why it cannot run here, or None; how to build what serves)."""
    lowp = LowPrecisionEngine()
    modules = search_candidates(fp32, TuningConfig(config_set=MixedPrecisionConfig(dtype=["fp16", "fp32"])))

    def half() -> nn.Module:     # model.half(), with the eval_fn's fp32 inputs and outputs cast at the edges
        return lowp.build(fp32, dict.fromkeys(modules, "fp16"), Calibration([], {}))

    return {"fp32 eager": (None, lambda: fp32),
            "fp32 + TF32": (KNOBS["tf32"].supports(fp32), lambda: KNOBS["tf32"].apply(fp32)),
            "torch.autocast (AMP)": (KNOBS["autocast"].supports(fp32), lambda: KNOBS["autocast"].apply(fp32)),
            "model.half()": (None, half),
            "torch.compile(model)": (None, lambda: compile_model(clone(fp32), alone=True)),
            "torch.compile(model.half())": (None, lambda: lowp.runnable(half())),
            CUDA_GRAPHS: (KNOBS["cuda_graphs"].supports(fp32),
                          lambda: lowp.runnable(KNOBS["cuda_graphs"].apply(half())))}


@dataclass
class Case:
    title: str
    found: list[Candidate]
    baseline: float
    scores: dict[str, float]
    timing: dict                       # {name: LatencyStats}, fp32 eager first
    peak_mib: dict[str, float | None]  # None off CUDA


def peak_mib(model: nn.Module, inputs, device: torch.device) -> float | None:
    """Its weights plus the most two calls on `inputs` allocate above what was allocated before them, in MiB."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        for _ in range(2):
            call(model, inputs)
    torch.cuda.synchronize(device)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model.state_dict().values() if t.device == device}
    return (torch.cuda.max_memory_allocated(device) - before + sum(storages.values())) / 2**20


def run_case(title: str, fp32: nn.Module, eval_fn, example, batch: int, device: torch.device, *,
             names: list[str] = NAMES, max_trials: int = 40, repeats: int = 30) -> Case:
    """The candidates `names` for `fp32` on `device` at `batch` rows of `example`: built, scored, timed."""
    unknown = sorted(set(names) - set(NAMES))
    if unknown or "fp32 eager" not in names:
        raise ValueError(f"candidates must include 'fp32 eager' and be among {NAMES}; got unknown {unknown}")
    fp32 = fp32.eval().to(device)
    eval_fn = on_device(eval_fn, device)
    inputs = to_device(resize_batch(as_call_inputs(example), batch), device)
    shapes = {f"batch {batch}": inputs}
    found = []
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (reason, build) in recipes(fp32, device).items():
            if name in names and reason is None:
                found.append(warmed(name, build, lambda m: m, shapes))
            elif name in names:
                why = reason if device.type == "cuda" else f"needs CUDA: {reason}"
                found.append(Candidate(name, None, None, 0.0, why))
        if "autotune" in names:
            found.append(tuned("autotune", fp32, eval_fn, inputs, DTYPES, max_trials, shapes, shapes, folder,
                               engines=ENGINES, device=str(device)))
        baseline = float(eval_fn(clone(fp32)))
        scores = {c.name: float(eval_fn(c.scored)) for c in found if c.scored is not None}
        serving = {c.name: c.timed for c in found if c.timed is not None}
        timing = measure_latency(serving, inputs, warmup=3, repeats=repeats, precision=0.01)
        peaks = {name: peak_mib(model, inputs, device) for name, model in serving.items()}
    return Case(title, found, baseline, scores, timing, peaks)


def case_table(case: Case) -> str:
    fp32 = case.timing["fp32 eager"]
    lines = [f"### {case.title}", "", f"fp32 eager: {fp32.median_ms:.3f} ms per call.", "",
             "| candidate | speedup (IQR) | ms | accuracy (loss) | within tolerance | setup s | peak MiB | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for c in case.found:
        if c.timed is None:
            lines.append(f"| {c.name} | – | – | – | – | {c.setup_s:.1f} | – | {c.note} |")
            continue
        t, loss, peak = case.timing[c.name], relative_loss(case.baseline, case.scores[c.name]), case.peak_mib[c.name]
        lines.append(f"| {c.name} | {1.0 / t.ratio_to(fp32):.2f}x (±{t.spread_ms / t.median_ms:.0%}) | "
                     f"{t.median_ms:.3f} | {case.scores[c.name]:.4f} ({loss:+.2%}) | "
                     f"{'yes' if loss <= TOLERANCE else 'NO'} | {c.setup_s:.1f} | "
                     f"{'–' if peak is None else f'{peak:.0f}'} | {c.note} |")
    return "\n".join(lines)


def summary(cases: list[Case]) -> str:
    """Speedups over fp32 eager, a candidate per row and a case per column (NO: outside the tolerance)."""
    def cell(case: Case, name: str) -> str:
        candidate = next((c for c in case.found if c.name == name), None)
        if candidate is None or candidate.timed is None:
            return "needs CUDA" if candidate is not None and candidate.note.startswith("needs CUDA") else "–"
        speedup = 1.0 / case.timing[name].ratio_to(case.timing["fp32 eager"])
        loss = relative_loss(case.baseline, case.scores[name])
        return f"{speedup:.2f}x" + ("" if loss <= TOLERANCE else f" (NO: {loss:+.1%})")

    names = [name for name in NAMES if any(c.name == name for case in cases for c in case.found)]
    return "\n".join([f"| candidate | {' | '.join(case.title for case in cases)} |",
                      "|---|" + "---|" * len(cases),
                      *(f"| {name} | {' | '.join(cell(case, name) for case in cases)} |" for name in names)])


def report(cases: list[Case], device: torch.device) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    header = (f"{device_name(device)} ({device}), torch {torch.__version__}"
              + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else "")
              + f"; autotune at {commit}, {time.strftime('%Y-%m-%d')}; tolerance {TOLERANCE} relative.")
    return "\n\n".join(["## What a GPU user would pick instead", header, summary(cases),
                        *(case_table(case) for case in cases)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mnist,minilm")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer examples, the small batch only, fewer trials")
    parser.add_argument("--max-trials", type=int, default=None, help="default: the harness's per workload (8 quick)")
    parser.add_argument("--out", default=None, help="default on CUDA: benchmarks/results-gpu.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"gpu.py: torch {torch.__version__} in {sys.executable} sees no CUDA device "
                         "(--device cpu shows the table's structure)")
    unknown = sorted(set(args.workloads.split(",")) - set(BATCHES))
    if unknown:
        raise SystemExit(f"gpu.py: unknown workloads {unknown}; known: {sorted(BATCHES)}")
    torch.manual_seed(0)
    cases = []
    for workload in args.workloads.split(","):
        fp32, eval_fn, example, _, trials, description = real_workload(workload, args.quick)
        for batch in BATCHES[workload][:1] if args.quick else BATCHES[workload]:
            cases.append(run_case(f"{description}, batch {batch}", fp32, eval_fn, example, batch, device,
                                  max_trials=args.max_trials or (8 if args.quick else trials),
                                  repeats=5 if args.quick else 30))
            print(case_table(cases[-1]), "\n", flush=True)
    text = report(cases, device)
    print(text)
    out = args.out or (str(ROOT / "benchmarks" / "results-gpu.md") if device.type == "cuda" else None)
    if out:
        Path(out).write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
