"""A self-contained HTML report of a study: accuracy vs latency with the Pareto front, and the best plan."""
from __future__ import annotations

import base64
import html
import io

import optuna
from optuna.trial import FrozenTrial

from autotune.plan import summarize
from autotune.storage import study as studies


def pareto_front(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Trials no other trial beats on both latency ratio and accuracy loss, fastest first."""
    front, best_loss = [], float("inf")
    for trial in sorted(trials, key=lambda t: (t.values[0], t.user_attrs["accuracy_loss"])):
        if trial.user_attrs["accuracy_loss"] < best_loss:
            front.append(trial)
            best_loss = trial.user_attrs["accuracy_loss"]
    return front


def scatter_png(trials: list[FrozenTrial], baseline: float | None) -> bytes:
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for passed, colour, label in ((True, "tab:green", "passed"), (False, "tab:red", "missed tolerance")):
        chosen = [t for t in trials if bool(t.user_attrs.get("passed")) == passed]
        ax.scatter([t.values[0] for t in chosen], [t.user_attrs["accuracy"] for t in chosen], c=colour,
                   label=label, alpha=0.7)
    front = pareto_front(trials)
    ax.plot([t.values[0] for t in front], [t.user_attrs["accuracy"] for t in front], "k--o", lw=1, ms=11,
            mfc="none", drawstyle="steps-post", label="Pareto front")
    ax.scatter([1.0], [baseline] if baseline is not None else [], marker="*", s=200, c="tab:blue",
               label="fp32 baseline")
    ax.set_xlabel("latency / fp32 latency (lower is faster)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _table(header: list[str], rows: list[list[object]]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def html_report(study: optuna.Study) -> str:
    trials = list(studies.view_trials(study).finished.values())
    baseline = studies.get_attr(study, "baseline_accuracy")
    best = studies.get_attr(study, "best")
    latency = studies.get_attr(study, "module_latency_ms") or {}
    parts = [f"<h1>autotune study {html.escape(study.study_name)}</h1>",
             f"<p>{len(trials)} evaluated plans; {len(study.trials)} trials in all.</p>"]
    if trials:
        png = base64.b64encode(scatter_png(trials, baseline)).decode()
        parts.append(f'<h2>Accuracy vs latency</h2><img alt="accuracy vs latency" src="data:image/png;base64,{png}">')
    if best:
        parts.append("<h2>Baseline vs best</h2>" + _table(
            ["", "fp32 baseline", "best"],
            [["accuracy", _number(baseline), _number(best["accuracy"])],
             ["speedup", "1.00x", f"{best['speedup']:.2f}x"],
             ["plan", "fp32", summarize(best["plan"])]]))
        parts.append("<h2>Best plan per module</h2>" + _table(
            ["module", "dtype", "module ms (fp32)", "module ms (chosen)"],
            [[name, dtype, _number(latency.get(name, {}).get("fp32")), _number(latency.get(name, {}).get(dtype))]
             for name, dtype in best["plan"].items()]))
    else:
        parts.append("<p>No best plan recorded yet: the tuning run has not finished.</p>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>autotune {html.escape(study.study_name)}"
            f"</title><style>{style}</style></head><body>{''.join(parts)}</body></html>")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
