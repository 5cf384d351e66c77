"""The report's charts, drawn by matplotlib's Agg canvas and inlined as PNG data URIs."""
from __future__ import annotations

import base64
import io
import math

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from autotune.backends import dtype_names
from autotune.plan import Plan, is_baseline, plan_id
from autotune.report.rows import Chosen, Row, pareto_front, trial_speedups

LABEL_LIMIT = 40     # more points than this: only the Pareto front and the chosen plan are numbered on the plot
MODULE_LIMIT = 40    # more modules than this: the module chart shows those slowest in fp32
CHOSEN_COLOUR = "#f2b705"


def _data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def accuracy_latency_chart(rows: list[Row], chosen: Chosen | None, baseline: float | None,
                           limit: float | None, score: str = "accuracy") -> str:
    """Accuracy vs in-trial speedup, points numbered by trial, the chosen plan at its re-timed speedup."""
    fig = Figure(figsize=(9, 5.2), dpi=110)
    ax = fig.subplots()
    done = [r for r in rows if r.ratio is not None]
    # Each group says how its speedups came: a study timing its trials predicts those of plans that missed.
    for passed, colour, marker, label in ((True, "tab:green", "o", "passed"), (False, "tab:red", "X",
                                                                               "missed tolerance")):
        group = [r for r in done if r.passed == passed]
        ax.scatter([r.speedup for r in group], [r.accuracy for r in group], c=colour, marker=marker, s=36,
                   alpha=0.75, label=f"{label}: {trial_speedups(group)}", zorder=3)
    front = pareto_front(done)
    ax.plot([r.speedup for r in front], [r.accuracy for r in front], "-", c="0.55", lw=1.0, zorder=2,
            label=f"Pareto front ({trial_speedups(front)})")
    numbered = done if len(done) <= LABEL_LIMIT else front + [r for r in done if r.chosen]
    at: dict[tuple[float, float], list[Row]] = {}   # trials at one point (one plan's twins, fp32 alike) share a label
    for row in numbered:
        at.setdefault((round(row.speedup, 3), round(row.accuracy, 6)), []).append(row)
    for same in at.values():
        ax.annotate(" ".join(f"#{row.number}" for row in same), (same[0].speedup, same[0].accuracy), xytext=(4, 4),
                    textcoords="offset points", fontsize=7, color="0.25")
    if baseline is not None:
        ax.scatter([1.0], [baseline], marker="s", s=70, c="tab:blue", label="fp32 baseline", zorder=4)
    if limit is not None:
        ax.axhline(limit, color="0.5", lw=0.8, ls=":", label="tolerance limit")
    ax.axvline(1.0, color="0.7", lw=0.6)
    ax.margins(x=0.06, y=0.12)   # room for the labels above the top points
    if chosen is not None:
        _mark_chosen(ax, chosen)
    ax.set_xlabel("speedup vs fp32 (fp32 ms / plan ms; higher is faster)")
    ax.set_ylabel(f"{score} (eval_fn)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _data_uri(fig)


def _mark_chosen(ax, chosen: Chosen) -> None:
    x, y = chosen.speedup, chosen.accuracy
    ax.scatter([x], [y], marker="*", s=420, c=CHOSEN_COLOUR, edgecolors="black", linewidths=1.0, zorder=5,
               label="chosen plan: re-timed after the search")
    trial = chosen.trial
    if trial is not None and trial.speedup is not None:
        ax.annotate("", (x, y), xytext=(trial.speedup, trial.accuracy),
                    arrowprops=dict(arrowstyle="->", color="#b08500", lw=1.2, ls=":"), zorder=4)
    name = (f"#{trial.number} {plan_id(chosen.plan)}" if trial is not None
            else f"{chosen.kept} baseline" if is_baseline(chosen.plan) else f"{chosen.summary} (no trial)")
    (left, right), (bottom, top) = ax.get_xlim(), ax.get_ylim()
    on_left = x > left + 0.6 * (right - left)    # the label goes toward the middle of the plot, off the edges
    below = y > bottom + 0.5 * (top - bottom)
    ax.annotate(f"chosen {name}\n{chosen.speedup:.2f}x re-timed", (x, y),
                xytext=(-12 if on_left else 12, -12 if below else 12), textcoords="offset points", fontsize=9,
                fontweight="bold", ha="right" if on_left else "left", va="top" if below else "bottom",
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec=CHOSEN_COLOUR, alpha=0.9), zorder=6)


def history_chart(rows: list[Row], chosen: Chosen | None) -> str:
    """Each trial's in-trial speedup by trial number, the best passing one so far, and the chosen plan's."""
    fig = Figure(figsize=(9, 3.8), dpi=110)
    ax = fig.subplots()
    done = [r for r in rows if r.ratio is not None]
    for passed, colour, marker, label in ((True, "tab:green", "o", "passed"), (False, "tab:red", "X", "missed")):
        group = [r for r in done if r.passed == passed]
        ax.scatter([r.number for r in group], [r.speedup for r in group], c=colour, marker=marker, s=24,
                   alpha=0.6, label=f"{label} ({trial_speedups(group)})", zorder=3)
    speedups = trial_speedups([r for r in done if r.passed])
    steps, best = [], None
    for row in done:
        if row.passed and (best is None or row.speedup > best):
            best = row.speedup
        if best is not None:
            steps.append((row.number, best))
    if steps:
        ax.step([n for n, _ in steps], [s for _, s in steps], where="post", c="tab:green", lw=2,
                label=f"best passing so far ({speedups})")
    ax.axhline(1.0, color="tab:blue", lw=0.8, ls=":", label="fp32")
    if chosen is not None:
        ax.axhline(chosen.speedup, color=CHOSEN_COLOUR, lw=1.5, ls="--",
                   label=f"chosen plan, re-timed: {chosen.speedup:.2f}x")
    ax.set_xlabel("trial number")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))    # no trial 4.2
    ax.set_ylabel("speedup vs fp32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _data_uri(fig)


def shown_modules(sensitivity: dict, latency: dict) -> list[str]:
    """The modules the module chart shows, in model order: all of them, or the MODULE_LIMIT slowest in fp32."""
    names = list(dict.fromkeys([*sensitivity, *latency]))
    if len(names) <= MODULE_LIMIT:
        return names
    slowest = set(sorted(names, key=lambda n: -latency.get(n, {}).get("fp32", 0.0))[:MODULE_LIMIT])
    return [name for name in names if name in slowest]


def module_chart(sensitivity: dict, latency: dict, plan: Plan | None) -> str:
    """Per module, a dot per dtype: output error with only that module lowered, and its latency (log scales)."""
    names = shown_modules(sensitivity, latency)
    found = {d for table in (sensitivity, latency) for n in names for d in table.get(n, {})}
    order = [d for d in dtype_names() if d != "fp32"]
    dtypes = sorted(found, key=lambda d: (d == "fp32", order.index(d) if d in order else len(order), d))
    fig = Figure(figsize=(10, 1.4 + 0.3 * len(names)), dpi=110)
    error_ax, latency_ax = fig.subplots(1, 2, sharey=True)
    markers = "osD^v<>p"
    plotted = {error_ax: 0, latency_ax: 0}   # points on each: a log scale with none fails to place its ticks
    for index, dtype in enumerate(dtypes):
        offset = (index - (len(dtypes) - 1) / 2) * 0.5 / max(1, len(dtypes))   # dots of one module apart
        style = dict(color=f"C{index}", marker=markers[index % len(markers)], s=30, label=dtype, zorder=3)
        errors = [(i + offset, sensitivity.get(n, {}).get(dtype)) for i, n in enumerate(names)]
        if dtype != "fp32":   # its error is 0 by definition, which a log scale cannot show
            finite = [(y, e) for y, e in errors if e is not None and 0 < e < math.inf]
            error_ax.scatter([e for _, e in finite], [y for y, _ in finite], **style)
            plotted[error_ax] += len(finite)
            for y, e in errors:
                if e is not None and not e < math.inf:
                    error_ax.annotate(f"{dtype}: inf", (1, y), xycoords=("axes fraction", "data"), fontsize=7,
                                      ha="right", va="center")
        times = [(i + offset, latency.get(n, {}).get(dtype)) for i, n in enumerate(names)]
        times = [(y, t) for y, t in times if t is not None and t > 0]
        latency_ax.scatter([t for _, t in times], [y for y, _ in times], **style)
        plotted[latency_ax] += len(times)
    error_ax.set_yticks(range(len(names)), [f"{n} [{plan[n]}]" if plan and n in plan else n for n in names],
                        fontsize=8)
    error_ax.set_ylim(len(names) - 0.5, -0.5)   # first module on top
    for ax, title, label in ((error_ax, "sensitivity", "model output error, only this module lowered"),
                             (latency_ax, "module latency", "ms, the module alone")):
        if plotted[ax]:
            ax.set_xscale("log")
            # Ticks as plain numbers: matplotlib's own labelled minor ticks as 3x10^-4 4x10^-4 ... where the points
            # span less than a decade, and the labels ran into each other.
            low, high = ax.dataLim.intervalx
            narrow = high < low * 30     # less than a decade and a half: 1, 2 and 5 of each decade, else decades
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if narrow else (1.0,), numticks=7))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(label + " (log)")
        else:   # e.g. no module's output changed when lowered alone: errors of 0, which a log scale cannot show
            ax.text(0.5, 0.5, "no error above 0 measured", transform=ax.transAxes, ha="center", va="center", fontsize=9)
            ax.set_xlabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    latency_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="dtype")
    fig.tight_layout()
    return _data_uri(fig)
