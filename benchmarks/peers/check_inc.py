"""Smoke check of the INC peer on the shipped MNIST CNN: runs `run_inc` and prints its result, the returned model's
accuracy and its latency as a ratio of fp32 (timed interleaved by autotune.measure.measure_latency).

    .venv-bench/bin/python benchmarks/peers/check_inc.py [--configs mixed_precision|int8|int8+mixed_precision]
        [--digits 2000] [--tolerable-loss 0.01] [--max-trials 20] [--repeats 15] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from autotune.measure import measure_latency  # noqa: E402
from autotune.workloads import mnist  # noqa: E402
from benchmarks.peers.inc import CONFIG_SETS, run_inc  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", choices=CONFIG_SETS, default="mixed_precision")
    parser.add_argument("--digits", type=int, default=2000)
    parser.add_argument("--tolerable-loss", type=float, default=0.01)
    parser.add_argument("--max-trials", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="return INC's int8 model eager (QDQ)")
    args = parser.parse_args()

    images, labels = mnist.digits(args.digits)
    accuracy = mnist.accuracy_eval(images, labels)
    example = images[:250]  # the first batch accuracy_eval feeds the model
    fp32 = mnist.model()

    out = run_inc(fp32, accuracy, example, args.tolerable_loss, args.max_trials, configs=args.configs,
                  compile_int8=not args.no_compile)
    for key in ("config", "error", "eval_calls", "wall_s", "passed", "tried", "scores", "notes"):
        print(f"{key}: {out[key]}")
    if out["model"] is None:
        return
    print("model:", type(out["model"]).__name__)
    fp32_acc, tuned_acc = accuracy(fp32), accuracy(out["model"])
    lat = measure_latency({"fp32": fp32, "inc": out["model"]}, ((example,), {}), repeats=args.repeats)
    base, tuned = lat["fp32"], lat["inc"]
    print(f"fp32 {base.median_ms:.2f} ± {base.spread_ms:.2f} ms, inc {tuned.median_ms:.2f} ± {tuned.spread_ms:.2f} ms, "
          f"inc/fp32 {tuned.median_ms / base.median_ms:.3f} (speedup {base.median_ms / tuned.median_ms:.3f}x); "
          f"accuracy fp32 {fp32_acc:.4f}, inc {tuned_acc:.4f}")


if __name__ == "__main__":
    main()
