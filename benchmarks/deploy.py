"""Deployment benchmark: the tuned model beside what a user would pick instead, at batch 1 and the eval batch.

    .venv-bench/bin/python benchmarks/deploy.py [--workloads mnist,minilm,encoder,lstm,gru,resnet] [--quick]
                                                  [--max-trials N]

Per workload (benchmarks/harness.py's real workloads; `encoder` is benchmarks/encoder_workload.py, `lstm` and `gru`
benchmarks/rnn_workload.py, `resnet` benchmarks/cnn_workload.py), each candidate
is built, scored once with the workload's eval_fn, and all of them are timed interleaved in one run per shape, fp32
eager among them (speedups are ratios within that run):
  fp32 eager            the model as given
  torch.compile fp32    `torch.compile(model)`
  quantize_dynamic      `torch.ao.quantization.quantize_dynamic(model, {nn.Linear, nn.LSTM, nn.GRU}, dtype=torch.qint8)`
  pt2e int8 + inductor  torchao's X86InductorQuantizer over the whole model (static ranges from the first 4 batches
                        eval_fn feeds it), then `torch.compile` with inductor's freezing on, as torchao's x86
                        tutorial has it: the uniform int8 plan of autotune's compiled engine
  INC int8              Intel Neural Compressor 3.x `autotune` over its static then dynamic PT2E int8 config sets
                        (benchmarks/peers/inc.py; under .venv-bench, else a row saying why not)
  autotune (batch N)    int8/bf16/fp16/fp32 per module, engines eager, compiled, inductor and lowp, tolerance 0.01
                        relative, latency measured at the eval batch (the default)
  autotune (both shapes)  the same with latency_inputs at both shapes, equal weights
The "both shapes" column is each candidate's speedup under that equal-weight objective (1 / mean latency ratio):
one model serving both shapes.
Setup is what a candidate cost before it could serve: tuning, quantising, compiling and the first call at each
shape. A compiled candidate is scored as it runs (compiled), pt2e too, as autotune's finalists are evaluated for
the win: inductor's int8 kernels round otherwise than the converted graph (LayoutLM: 96.9 % top-1 agreement with
fp32 compiled, 98.4 % converted), and until ee95ba1 a RoCBert's compiled graph wrote into a constant of its own at
each call (100 % converted, 45 % compiled).
Every candidate is built and timed with glibc malloc's thresholds fixed (autotune.measure.steady_allocation, as the
tuner does): left to move, they made fp32 eager's MNIST time at batch 250 swing between 16 and 35 ms from one run to
the next, and every speedup with it.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from candidates import Candidate, relative_loss, tuned, warmed  # noqa: E402
from harness import TOLERANCE, real_workload  # noqa: E402

from autotune import MixedPrecisionConfig, TuningConfig  # noqa: E402
from autotune.capture import as_call_inputs, run_capturing  # noqa: E402
from autotune.clone import clone  # noqa: E402
from autotune.discovery import search_candidates  # noqa: E402
from autotune.engines import Calibration, CompiledEngine, compile_model  # noqa: E402
from autotune.engines.pt2e import QUANTISED  # noqa: E402
from autotune.measure import measure_latency, steady_allocation  # noqa: E402
from autotune.measure.shapes import batch_size, resize_batch  # noqa: E402


def peers(fp32: nn.Module, eval_fn, example, batches: list, shapes: dict, max_trials: int) -> list[Candidate]:
    def pt2e():
        plan = {name: "int8" for name in search_candidates(fp32, TuningConfig(config_set=MixedPrecisionConfig(
            dtype=["int8", "fp32"]))) if type(fp32.get_submodule(name)) in QUANTISED}   # what the quantizer takes
        engine = CompiledEngine()
        return engine.runnable(engine.build(fp32, plan, Calibration(batches, {})))

    found = [Candidate("fp32 eager", fp32, fp32, 0.0),
             warmed("torch.compile fp32", lambda: compile_model(copy.deepcopy(fp32), alone=True), lambda m: m, shapes),
             warmed("quantize_dynamic int8", lambda: torch.ao.quantization.quantize_dynamic(
                 copy.deepcopy(fp32), {nn.Linear, nn.LSTM, nn.GRU}, dtype=torch.qint8), lambda m: m, shapes),
             warmed("pt2e int8 + inductor (uniform)", pt2e, lambda m: m, shapes)]
    return found + [_inc(fp32, eval_fn, example, max_trials, shapes)]


def _inc(fp32, eval_fn, example, max_trials: int, shapes: dict) -> Candidate:
    try:
        from benchmarks.peers.inc import run_inc
        out = run_inc(fp32, eval_fn, example, tolerable_loss=TOLERANCE, max_trials=max_trials, configs="int8")
    except ImportError:
        return Candidate("INC int8", None, None, 0.0, "neural_compressor is not importable (run under .venv-bench)")
    if out["model"] is None:
        return Candidate("INC int8", None, None, out["wall_s"], str(out["error"])[:200])
    found = warmed("INC int8", lambda: out["model"], lambda m: m, shapes, note=f"{out['config']}")
    found.setup_s += out["wall_s"]
    return found


def run(workload: str, quick: bool, max_trials: int | None) -> str:
    fp32, eval_fn, example, dtypes, default_trials, description = real_workload(workload, quick)
    fp32 = fp32.eval()
    max_trials = max_trials or default_trials
    batches = run_capturing(clone(fp32), eval_fn, stop_early=True)[1]
    eval_batch = as_call_inputs(example)
    shapes = {"batch 1": resize_batch(eval_batch, 1), f"batch {batch_size(eval_batch)}": eval_batch}
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = peers(fp32, eval_fn, example, batches, shapes, max_trials)
        eval_shape = list(shapes)[-1]
        found += [tuned(f"autotune ({eval_shape})", fp32, eval_fn, example, dtypes, max_trials, shapes,
                        {eval_shape: shapes[eval_shape]}, folder),
                  tuned("autotune (both shapes)", fp32, eval_fn, example, dtypes, max_trials, shapes, shapes, folder)]
        baseline = float(eval_fn(clone(fp32)))
        scores = {c.name: float(eval_fn(c.scored)) for c in found if c.scored is not None}
        serving = {c.name: c.timed for c in found if c.timed is not None}
        timing = {shape: measure_latency(serving, inputs, warmup=3, repeats=30, precision=0.01)
                  for shape, inputs in shapes.items()}
    return table(workload, description, found, baseline, scores, timing)


def table(workload, description, found, baseline, scores, timing) -> str:
    shapes = list(timing)

    def speedup(name: str, shape: str) -> float:
        return 1.0 / timing[shape][name].ratio_to(timing[shape]["fp32 eager"])

    def both(name: str) -> float:   # the equal-weight objective over the shapes, as a speedup
        return len(shapes) / sum(1 / speedup(name, s) for s in shapes)

    lines = [f"### {workload}: {description}", "",
             "| candidate | accuracy (loss) | within tolerance | " + " | ".join(f"{s} speedup (IQR)" for s in shapes)
             + " | both shapes, equal weights | setup s | notes |",
             "|---|---|---|" + "---|" * len(shapes) + "---|---|---|"]
    peers_ok = [name for name in timing[shapes[0]] if not name.startswith("autotune")
                and relative_loss(baseline, scores[name]) <= TOLERANCE]
    for c in found:
        if c.timed is None:
            lines.append(f"| {c.name} | – | – | " + " | ".join("–" for _ in shapes) + f" | – | {c.setup_s:.1f} | "
                         f"did not run: {c.note} |")
            continue
        loss = relative_loss(baseline, scores[c.name])
        cells = []
        for s in shapes:
            t = timing[s][c.name]
            cells.append(f"{speedup(c.name, s):.2f}x (±{t.spread_ms / t.median_ms:.0%})")
        lines.append(f"| {c.name} | {scores[c.name]:.4f} ({loss:+.2%}) | {'yes' if loss <= TOLERANCE else 'NO'} | "
                     + " | ".join(cells) + f" | {both(c.name):.2f}x | {c.setup_s:.1f} | {c.note} |")
    fp32_ms = ", ".join(f"{timing[s]['fp32 eager'].median_ms:.3f} ms at {s}" for s in shapes)
    lines += ["", f"fp32 eager: {fp32_ms}. Best peer within tolerance: "
              + ", ".join(f"at {s} {max(peers_ok, key=lambda n, s=s: speedup(n, s))} "
                          f"{max(speedup(n, s) for n in peers_ok):.2f}x" for s in shapes)
              + f"; over both shapes {max(peers_ok, key=both)} {max(both(n) for n in peers_ok):.2f}x."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mnist,minilm")
    parser.add_argument("--quick", action="store_true", help="fewer examples (500 digits, 200 sentences)")
    parser.add_argument("--max-trials", type=int, default=None, help="default: the harness's per workload")
    args = parser.parse_args()
    torch.manual_seed(0)
    steady_allocation()
    for workload in args.workloads.split(","):
        print(run(workload, args.quick, args.max_trials), "\n", flush=True)


if __name__ == "__main__":
    main()
