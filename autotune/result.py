"""What `autotune` hands back."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import optuna
from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines.saving import save_built
from autotune.errors import SaveError
from autotune.measure.latency import UNCERTAIN_RATIO, LatencyStats
from autotune.plan import Plan, summarize
from autotune.storage.study import score_name

CONTENDED = ("other processes kept the CPUs busy while {shapes} was timed: threads sharing cores with other work "
             "can run many times slower, unevenly, so the speedup may be far off however steady its timing looked; "
             "time the plan again on a quiet machine{how}, or set num_threads to leave cores free")
MEDIANS_DISAGREE = ("the medians {where} disagree with the speedup: it is the median of per-round ratios, fp32 and "
                    "the {what} timed in each round, which a busy host's swings leave alone")
NOISE_KEY = "speedup_noise"   # in a study's `best`: how far off its speedup may be, where its timing was noisy
BUSY_KEY = "timed_busy"       # in a study's `best`: true where other processes kept the CPUs busy as it was timed


class SavedModel(NamedTuple):
    path: str         # the file written
    loads_with: str   # how to load it ("torch.load(path, weights_only=False), where autotune is importable ...")


@dataclass(frozen=True)
class Measurement:
    accuracy: float
    latency: LatencyStats
    weight_bytes: int


@dataclass(frozen=True)
class ShapeLatency:
    """fp32 and the tuned model timed together at one of the shapes latency is measured at."""
    name: str
    weight: float
    fp32: LatencyStats
    best: LatencyStats

    @property
    def speedup(self) -> float:
        return 1.0 / self.best.ratio_to(self.fp32)


@dataclass
class TuningResult:
    model: nn.Module
    plan: Plan
    baseline: Measurement
    best: Measurement
    study: optuna.Study
    eval_calls: int          # eval_fn calls this run made (a resumed run reuses earlier trials)
    trials_evaluated: int    # evaluated trials in the whole study
    wall_time_s: float
    engine: str = "eager"    # how `model` runs: autotune.engines
    shapes: list[ShapeLatency] = field(default_factory=list)   # every shape timed; baseline/best: the first
    knobs: tuple[str, ...] = ()   # model-level knobs `model` runs with: autotune.engines.knobs
    held: str = "fp32"       # the dtype the model was handed over in: what the baseline and the plan's "fp32" hold
    stopped: str | None = None   # why the search stopped, where the summary says it (the CLI says it as it stops)
    failed: str = ""         # how many evaluated trials failed and why (storage.study.failures_said); "" if none
    built: nn.Module | None = field(default=None, repr=False)   # `model` before compiling (save writes it); None: model
    example: CallInputs | None = field(default=None, repr=False)   # one call's inputs (the compiled engine exports)

    def save(self, path: str) -> SavedModel:
        """Writes the tuned model to `path` as `autotune apply` does, in its engine's way (the compiled engine's
        exported graph, for torch.export.load; the others' module, for torch.load: parametrizations such as weight_norm
        held as the weights they compute, transformers' output-capturing hooks installed again where it loads). With
        no suffix, `path` gets its engine's (.pt2 or .pt). Returns the path written and how to load it.

        Raises:
            SaveError: a suffix the engine's loader cannot read, or torch refusing to write the model.
        """
        if self.example is None:
            raise SaveError("this result holds no inputs to write its model with")
        written, loads_with = save_built(self.built if self.built is not None else self.model, self.engine,
                                         self.example, path)
        return SavedModel(written, loads_with)

    def __call__(self, *args, **kwargs):
        raise TypeError("autotune returns a TuningResult, not the model: call result.model (INC's autotune returns "
                        "the tuned model itself)")

    @property
    def speedup(self) -> float:
        """fp32 latency / tuned latency, the median of per-round ratios (the two timed in turn each round: not the
        ratio of the medians, which a busy host's swings move); with several shapes, 1 / the weighted mean of their
        latency ratios."""
        if not self.shapes:
            return 1.0 / self.best.latency.ratio_to(self.baseline.latency)
        return sum(s.weight for s in self.shapes) / sum(s.weight / s.speedup for s in self.shapes)

    def noisy_shapes(self) -> dict[str, float]:
        """{shape: how far off its speedup may be, as a share} where the timing behind it was too noisy to trust
        (worse than ±UNCERTAIN_RATIO: another load on the machine; `autotune bench` times it again)."""
        timed = {s.name: (s.best, s.fp32) for s in self.shapes} or {"": (self.best.latency, self.baseline.latency)}
        return {name: off for name, (best, fp32) in timed.items() if (off := best.ratio_uncertainty(fp32))
                > UNCERTAIN_RATIO}


    def contended_shapes(self) -> list[str]:
        """Shapes whose final timing shared the CPUs with more work than they left free (measure.host_load)."""
        timed = {s.name: (s.best, s.fp32) for s in self.shapes} or {"": (self.best.latency, self.baseline.latency)}
        return [name for name, pair in timed.items() if any(stats.contended for stats in pair)]

    def summary(self) -> str:
        rows = [("", f"{self.held} baseline", "tuned"),
                (score_name(self.study), formatted(self.baseline.accuracy), formatted(self.best.accuracy)),
                ("latency ms (median ± IQR)", _latency(self.baseline.latency), _latency(self.best.latency)),
                ("weights MiB", f"{self.baseline.weight_bytes / 2**20:.2f}", f"{self.best.weight_bytes / 2**20:.2f}")]
        engine = self.engine + (f" + {', '.join(self.knobs)}" if self.knobs else "")
        speedup = speedup_text(self.speedup, max(self.noisy_shapes().values(), default=None))
        lines = [table(rows), f"speedup {speedup}   plan {summarize(self.plan, self.held)}   engine {engine}",
                 f"study {self.study.study_name!r}: {counted(self.trials_evaluated, 'evaluated trial')}"
                 + (f" ({self.failed})" if self.failed else "") + "; "
                 f"{counted(self.eval_calls, 'eval_fn call')} this run; {self.wall_time_s:.1f} s"
                 + (f"; search stopped: {self.stopped}" if self.stopped else "")]
        medians = self.best.latency.median_ms / self.baseline.latency.median_ms
        if len(self.shapes) <= 1 and medians_disagree(medians, 1 / self.speedup):
            lines.insert(2, MEDIANS_DISAGREE.format(where="above", what="tuned model"))
        if busy := self.contended_shapes():
            lines.insert(2, f"other processes kept the CPUs busy while {', '.join(filter(None, busy)) or 'it'} was "
                            "timed: the speedup may be far off (`autotune bench` times it again)")
        if len(self.shapes) > 1:
            lines.insert(1, table([("shape", "weight", "fp32 ms", "tuned ms", "speedup"),
                                   *((s.name, f"{s.weight:g}", _latency(s.fp32), _latency(s.best),
                                      f"{s.speedup:.2f}x") for s in self.shapes)]))
        return "\n".join(lines)


def speedup_text(speedup: float, noise: float | None = None, busy: bool = False) -> str:
    """`1.52x`, and how far off it may be where its timing was noisy (`noise`: a share, UNCERTAIN_RATIO or more) or
    taken beside other busy processes (`busy`: see CONTENDED)."""
    doubts = ([f"±{100 * noise:.0f} %: noisy timing"] if noise else []) + (
        ["timed beside busy processes: may be far off"] if busy else [])
    return f"{speedup:.2f}x" + (f" ({'; '.join(doubts)})" if doubts else "")


def best_speedup(best: dict) -> str:
    """speedup_text of a study's recorded `best`."""
    return speedup_text(best["speedup"], best.get(NOISE_KEY), bool(best.get(BUSY_KEY)))


def medians_disagree(of_medians: float, per_round: float) -> bool:
    """Whether the ratio of two medians and the median of per-round ratios tell different stories: one faster than
    fp32 and the other not, or 1.5 times apart (a busy host's swings: 47x in a table where the rounds said 1.16x)."""
    return (of_medians - 1) * (per_round - 1) < 0 or max(of_medians, per_round) > 1.5 * min(of_medians, per_round)


def counted(number: int, noun: str) -> str:
    """`1 evaluated trial`, `2 evaluated trials`."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def formatted(value: float | None, pattern: str | None = None) -> str:
    """A number for a table: "-" for none; by `pattern`, else as a score: 4 decimals, or 4 significant digits
    where the decimals would hide it (a mean squared error of 1.2e-4 read 0.0001)."""
    if value is None:
        return "-"
    if pattern is not None:
        return pattern.format(value)
    return f"{value:.4f}" if value == 0 or abs(value) >= 0.1 else f"{value:.4g}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Plain-text columns, first row as header."""
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def _latency(stats: LatencyStats) -> str:
    return f"{stats.median_ms:.3f} ± {stats.spread_ms:.3f}"
