"""Tunes the ccexam MNISTNet on real MNIST digits in a fresh study and prints, from this one run: fp32 and tuned
latency (timed interleaved), their ratio, accuracy of both, eval_fn calls (counted here, around the user's
function) and total wall time.

    .venv/bin/python benchmarks/mnist_tuning.py [--digits 5000] [--tolerable-loss 0.01] [--max-trials 20]
"""
from __future__ import annotations

import argparse
import tempfile
import time

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.plan import summarize
from autotune.workloads import mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digits", type=int, default=5000)
    parser.add_argument("--tolerable-loss", type=float, default=0.01)
    parser.add_argument("--max-trials", type=int, default=20)
    args = parser.parse_args()

    images, labels = mnist.digits(args.digits)
    accuracy = mnist.accuracy_eval(images, labels)
    calls = 0

    def eval_fn(model):
        nonlocal calls
        calls += 1
        return accuracy(model)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp16", "fp32"]),
                              tolerable_loss=args.tolerable_loss, max_trials=args.max_trials,
                              storage=f"sqlite:///{folder}/bench.db", study_name="mnist-bench")
        result = autotune(mnist.model(), config, eval_fn)
    wall = time.perf_counter() - started

    base, best = result.baseline, result.best
    print(f"| workload | fp32 ms | tuned ms | tuned/fp32 | fp32 acc | tuned acc | eval_fn calls | wall s | plan |")
    print(f"|---|---|---|---|---|---|---|---|---|")
    print(f"| MNISTNet, {args.digits} digits, tol {args.tolerable_loss} | {base.latency.median_ms:.2f} "
          f"± {base.latency.spread_ms:.2f} | {best.latency.median_ms:.2f} ± {best.latency.spread_ms:.2f} | "
          f"{best.latency.median_ms / base.latency.median_ms:.3f} | {base.accuracy:.4f} | {best.accuracy:.4f} | "
          f"{calls} | {wall:.1f} | {summarize(result.plan)} |")


if __name__ == "__main__":
    main()
