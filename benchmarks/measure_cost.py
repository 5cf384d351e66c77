"""What measuring costs in a real tuning run: seconds spent in per-module signals and in whole-model timing,
beside eval_fn's seconds and the wall time, on the shipped workloads (a shipped YAML config each).

    .venv/bin/python benchmarks/measure_cost.py [--workloads mnist,minilm] [--max-trials N] [--trial-timing T]

Run it on two checkouts (PYTHONPATH=<other checkout> for the other) to compare measuring strategies: the
Measurer interface it wraps is the one the tuner has always used.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from harness import SHIPPED_CONFIGS as CONFIGS


class TimedMeasurer:
    """The device measurer, with the seconds spent timing whole models and spent on everything else it does
    (per-module signals), whatever its methods are called in the checkout measured."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, {}

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
        return timed


def run(workload: str, max_trials: int | None, trial_timing: str | None = None) -> dict:
    import autotune
    from autotune.config.file import load_config
    from autotune.measure.measurer import DeviceMeasurer

    config = load_config(Path(__file__).resolve().parent.parent / CONFIGS[workload])
    eval_fn, eval_s = config.evaluation.build(), [0.0]

    def timed_eval(model):
        started = time.perf_counter()
        try:
            return eval_fn(model)
        finally:
            eval_s[0] += time.perf_counter() - started

    with tempfile.TemporaryDirectory() as folder:
        # A fresh compile cache too: finalists compiled by an earlier run would be read back, not compiled.
        tuning = config.tuning.model_copy(update={"storage": f"sqlite:///{folder}/cost.db",
                                                  "compile_cache": f"{folder}/compiled"})
        if max_trials:
            tuning.max_trials = max_trials
        if trial_timing:
            tuning.trial_timing = trial_timing
        measurer = TimedMeasurer(DeviceMeasurer(tuning))
        started = time.perf_counter()
        result = autotune.autotune(config.build_model(), tuning, timed_eval, config.build_example_inputs(),
                                   measurer=measurer)
        wall = time.perf_counter() - started
    latency_s = measurer.seconds.pop("latency", 0.0)
    return {"workload": workload, "wall_s": wall, "signals_s": sum(measurer.seconds.values()),
            "signals": measurer.seconds, "latency_s": latency_s,
            "eval_s": eval_s[0], "eval_calls": result.eval_calls, "speedup": result.speedup,
            "plan": autotune.plan.summarize(result.plan)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default="mnist,minilm")
    parser.add_argument("--max-trials", type=int, default=None, help="default: the config's")
    parser.add_argument("--trial-timing", choices=["measured", "predicted"], default=None,
                        help="default: the config's")
    args = parser.parse_args()
    print("| workload | wall s | signals s | trial+final timing s | measuring share | eval_fn s | eval calls "
          "| speedup | plan | signals in detail s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        r = run(workload, args.max_trials, args.trial_timing)
        measuring = r["signals_s"] + r["latency_s"]
        print(f"| {workload} | {r['wall_s']:.1f} | {r['signals_s']:.1f} | {r['latency_s']:.1f} | "
              f"{100 * measuring / r['wall_s']:.0f} % | {r['eval_s']:.1f} | {r['eval_calls']} | "
              f"{r['speedup']:.2f}x | {r['plan']} | "
              f"{', '.join(f'{name} {s:.1f}' for name, s in r['signals'].items())} |", flush=True)


if __name__ == "__main__":
    main()
