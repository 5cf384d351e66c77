"""What the deployment benchmarks (deploy.py on the CPU, gpu.py on a GPU) share: a candidate as built, warmed up
and timed, the tuned candidate, and the accuracy loss they are judged by."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from harness import TOLERANCE
from torch import nn

from autotune import LatencyInput, MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure.shapes import batch_size
from autotune.model_call import call
from autotune.plan import summarize

ALL_ENGINES = ["eager", "compiled", "inductor", "lowp"]


@dataclass
class Candidate:
    name: str
    timed: nn.Module | None      # what serves (None: the candidate could not run, `note` says why)
    scored: nn.Module | None     # what eval_fn scores
    setup_s: float
    note: str = ""


def warmed(name: str, build, scored_from, shapes: dict, note: str = "") -> Candidate:
    """Builds a candidate, then calls it once at each shape (compilation happens there): all of it is setup."""
    started = time.perf_counter()
    try:
        timed = build()
        with torch.inference_mode():
            for inputs in shapes.values():
                call(timed, inputs)
    except Exception as exc:  # noqa: BLE001 - a peer that fails is a result
        return Candidate(name, None, None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"[:200])
    return Candidate(name, timed, scored_from(timed), time.perf_counter() - started, note)


def tuned(name: str, fp32: nn.Module, eval_fn, example, dtypes: list[str], max_trials: int, shapes: dict,
          tuned_for: dict, folder: str, engines: list[str] = ALL_ENGINES, device: str = "cpu") -> Candidate:
    """autotune in `engines` on `device`, its latency measured at the shapes of `tuned_for` (equal weights)."""
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=dtypes), tolerable_loss=TOLERANCE,
                          max_trials=max_trials, engines=engines, device=device,
                          storage=f"sqlite:///{folder}/p.db", study_name=name, compile_cache=f"{folder}/cache",
                          latency_inputs=[LatencyInput(batch=batch_size(inputs), weight=1.0)
                                          for inputs in tuned_for.values()])
    started = time.perf_counter()
    result = autotune(fp32, config, eval_fn, example)
    knobs = "".join(f" +{knob}" for knob in result.knobs)
    found = warmed(name, lambda: result.model, lambda m: m, shapes,
                   note=f"{summarize(result.plan)}, {result.engine} engine{knobs}, {result.eval_calls} eval_fn calls")
    found.setup_s += time.perf_counter() - started
    return found


def relative_loss(baseline: float, accuracy: float) -> float:
    return (baseline - accuracy) / abs(baseline)


def top1_accuracy(data: list[tuple], labels: list[torch.Tensor]):
    """An eval_fn: the share of `data`'s examples (batches of positional inputs) whose top-1 class is the label."""
    examples = sum(len(y) for y in labels)

    def eval_fn(candidate: nn.Module) -> float:
        with torch.inference_mode():
            return sum((candidate(*batch).argmax(-1) == y).sum().item() for batch, y in zip(data, labels)) / examples
    return eval_fn


def top1_agreement(reference: nn.Module, data: list[tuple]):
    """top1_accuracy with the reference model's predictions as labels, so the reference scores 1.0 (random-weight
    models, no labels)."""
    with torch.inference_mode():
        return top1_accuracy(data, [reference(*batch).argmax(-1) for batch in data])
