"""A self-contained HTML report of a study: the chosen plan, every evaluated trial, and the signals behind them.

One file with its charts inline (PNG data URIs drawn by matplotlib's Agg canvas), no script and nothing fetched.
Two timings appear and are labelled apart: each trial timed its plan once against fp32 in that trial; the chosen
plan (study attribute `best`) was re-timed against fp32 with the other finalists after the search, so its speedup
is not its trial's.
"""
from __future__ import annotations

import html
import math
import statistics
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.plan import Plan, is_baseline, plan_id
from autotune.report.charts import (
    LABEL_LIMIT,
    accuracy_latency_chart,
    history_chart,
    module_chart,
    shown_modules,
)
from autotune.report.rows import Chosen, Row, tolerance_limit, trial_rows, trial_speedups
from autotune.result import formatted, speedup_text
from autotune.storage import study as studies


def _cell(value: object) -> str:
    """A table cell: text is escaped; a tuple (html,) is inserted as is."""
    return value[0] if isinstance(value, tuple) else html.escape(str(value))


def _table(header: list[str], rows: list[list[object]], classes: list[str] | None = None) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(f"<tr{classes[i] if classes else ''}>" + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>"
                   for i, row in enumerate(rows))
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _plan_code(plan: Plan) -> tuple[str]:
    full = ", ".join(f"{name}={dtype}" for name, dtype in plan.items())
    return (f'<code title="{html.escape(full[:2000])}">{plan_id(plan)}</code>',)


def _figure(alt: str, uri: str, caption: str) -> str:
    return (f'<figure><img alt="{html.escape(alt)}" src="{uri}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def trials_section(rows: list[Row], score: str = "accuracy") -> str:
    """The numbered table of evaluated trials: the numbers are those on the plots."""
    # Several shapes: the ratio is their weighted mean, the milliseconds the first shape's (the others: `shapes`).
    shapes = next((list(row.by_shape) for row in rows if row.by_shape), [])
    several = len(shapes) > 1
    header = ["#", "plan id", "plan", "source", score, "loss",
              f"latency/fp32 in trial{', weighted over shapes' if several else ''} (speedup)",
              f"plan ms ± IQR (fp32 ms) in trial{f', at {shapes[0]}' if several else ''}", "result", "chosen"]
    body, classes = [], []
    for row in rows:
        timing = (f"{formatted(row.latency_ms, '{:.3f}')} ± {formatted(row.spread_ms, '{:.3f}')} "
                  f"({formatted(row.fp32_ms, '{:.3f}')})" if row.latency_ms is not None else "-")
        result = f"<span class='{row.outcome.lower()}'>{row.outcome}</span>"
        if row.error is not None:
            result += f"<small title='{html.escape(row.error)}'>{html.escape(row.error[:80])}</small>"
        ratio = f"{row.ratio:.3f} ({row.speedup:.2f}x)" if row.ratio else "-"
        if row.ratio and row.latency_ms is None and row.error is None:
            ratio += " predicted"
        body.append([row.number, _plan_code(row.plan), row.summary, row.source, formatted(row.accuracy),
                     formatted(row.loss), ratio, timing, (result,),
                     ("<strong>&#9733; chosen</strong>",) if row.chosen else ""])
        classes.append(f' id="trial-{row.number}"' + (' class="chosen"' if row.chosen else ""))
    caption = ("One row per evaluated trial, numbered as on the plots; trials that reused an earlier result "
               "are left out. Latency/fp32 is one timing of the plan against fp32 within that trial, or for a "
               "plan that missed the tolerance its prediction from the per-module costs (it is not timed: it "
               "cannot be chosen); hover a plan id for the whole plan.")
    return (f"<h2 id='trials'>Trials</h2><p class='caption'>{html.escape(caption)}</p>"
            + _table(header, body, classes).replace("<table>", "<table class='trials'>", 1))


def chosen_section(chosen: Chosen | None, baseline: float | None, why_none: str = "", score: str = "accuracy") -> str:
    """Baseline vs the chosen plan, and how its re-timed speedup relates to its trial's timing. The baseline is
    the model in the dtype it was handed over in (`chosen.kept`); `why_none`: why there is no chosen plan."""
    if chosen is None:
        return f"<h2 id='chosen'>Baseline vs best</h2><p>No best plan recorded yet: {html.escape(why_none)}.</p>"
    held = chosen.kept
    trial = chosen.trial
    source = (f"<a href='#trial-{trial.number}'>trial #{trial.number}</a>" if trial is not None
              else f"the {held} model (no trial)" if is_baseline(chosen.plan) else "no evaluated trial")
    rows = [[score, formatted(baseline), formatted(chosen.accuracy) + " (re-evaluated)"],
            [f"speedup vs the {held} baseline", "1.00x",
             f"{speedup_text(chosen.speedup, chosen.noise, chosen.busy)} (re-timed)"],
            ["plan", held, (f"{_plan_code(chosen.plan)[0]} {html.escape(chosen.summary)}",)],
            ["first evaluated in", "-", (source,)]]
    if trial is not None and trial.speedup is not None:
        rows.append(["in its trial", "-", f"latency/fp32 {trial.ratio:.3f} ({trial.speedup:.2f}x), "
                                          f"{score} {formatted(trial.accuracy)}"])
    rows += [[key.replace("_", " "), "-", _shown(key, value)] for key, value in chosen.extra.items()]
    caption = ("The chosen plan is the one the tuner returned: after the search, the best passing plans were "
               "timed again together with fp32 and the fastest was re-evaluated. Its speedup here is from that "
               "re-timing, so it can differ from the single timing its trial took.")
    if is_baseline(chosen.plan):
        caption = (f"No lowered plan both met the tolerance and ran faster than {held} when re-timed: the model is "
                   f"kept as handed over, in {held}.")
    return ("<h2 id='chosen'>Baseline vs best (chosen plan)</h2>"
            + _table(["", f"{held} baseline", "chosen plan"], rows)
            + f"<p class='caption'>{html.escape(caption)}</p>")


def _shown(key: str, value: Any) -> str:
    """A value the tuner stored with the chosen plan, as a reader reads it (not Python's repr of it)."""
    if isinstance(value, dict):
        return "; ".join(f"{name}: {_shown(key, item)}" for name, item in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value) or "none"
    if isinstance(value, float):
        return f"{value:.2f}x" if "speedup" in key else f"{value:.1f} s" if key.endswith("_s") else formatted(value)
    return str(value)


def finalists_section(setup_s: dict[str, float], race: dict[str, float], evaluated: dict[str, str],
                      chosen: Chosen | None, dropped: dict[str, str], knobs_not_tried: dict[str, str]) -> str:
    """Every finalist built after the search: its set-up seconds (build and first calls, where compiling happens),
    its ratio to fp32 eager in the race, fastest first, and how its re-evaluation went; and the engines and knobs
    left out, with why."""
    if not setup_s and not dropped:
        return ""
    chosen_name = chosen.extra.get("finalist") if chosen is not None else None
    names = sorted(setup_s, key=lambda name: race.get(name, math.inf))
    body = [[name, f"{setup_s[name]:.1f}",
             f"{race[name]:.3f} ({1 / race[name]:.2f}x)" if race.get(name) else "-", evaluated.get(name, "-"),
             ("<strong>&#9733; chosen</strong>",) if name == chosen_name else ""] for name in names]
    left_out = [f"engine {name}: {reason}" for name, reason in dropped.items()]
    left_out += [f"knob {name}: {reason}" for name, reason in knobs_not_tried.items()]
    caption = (f"{len(setup_s)} finalists, {sum(setup_s.values()):.1f} s of set-up in all. Each was timed "
               "against fp32 eager with the others; the fastest were re-evaluated in that order, and the first "
               "within the tolerance was chosen and timed once more (its speedup above).")
    return ("<h2 id='finalists'>Finalists</h2>"
            + _table(["finalist", "set-up s", "latency/fp32 in the race (speedup)", "re-evaluation", "chosen"], body)
            + f"<p class='caption'>{html.escape(caption)}</p>"
            + ("<p>Left out: " + "; ".join(html.escape(line) for line in left_out) + "</p>" if left_out else ""))


SETTING_LABELS = {"device": "device", "device_name": "device name", "num_threads": "threads while timing",
                  "num_threads_earlier": "threads while timing in earlier runs (trials timed then kept their ratios)",
                  "allocation": "memory allocation while timing",
                  "warmup": "warm-up calls",
                  "repeats": "most timing rounds per model in a trial (fewer once the comparison settles)",
                  "torch": "torch version", "tolerable_loss": "tolerable loss", "loss_kind": "loss kind",
                  "higher_is_better": "higher is better", "objective": "objective"}


def timing_section(rows: list[Row], settings: dict[str, Any]) -> str:
    """The device the study was timed on, and how much its timings moved."""
    parts = ["<h2 id='timing'>Device and timing spread</h2>"]
    if settings:
        ordered = [k for k in SETTING_LABELS if k in settings] + [k for k in settings if k not in SETTING_LABELS]
        parts.append(_table(["setting", "value"], [[SETTING_LABELS.get(k, k), settings[k]] for k in ordered]))
    else:
        parts.append("<p>This study does not record the device it was timed on.</p>")
    fp32 = [r.fp32_ms for r in rows if r.fp32_ms]
    spreads = [r.spread_ms / r.latency_ms for r in rows if r.latency_ms and r.spread_ms is not None]
    stats = []
    if fp32:
        stats.append(["fp32 latency, timed once in each trial", f"median {statistics.median(fp32):.3f} ms, "
                      f"range {min(fp32):.3f} to {max(fp32):.3f} ms ({len(fp32)} trials)"])
    if spreads:
        stats.append(["plan timing IQR / median, within a trial",
                      f"median {statistics.median(spreads):.1%}, worst {max(spreads):.1%}"])
    if stats:
        parts.append(_table(["timing", "value"], stats))
        parts.append("<p class='caption'>Every trial times fp32 again beside its plan: the range shows how much "
                     "timings on this device move from trial to trial, the IQR how much they scatter within one. "
                     "A trial's latency ratio rests on one such timing; the chosen plan's speedup on a longer "
                     "re-timing after the search.</p>")
    return "".join(parts)


def shapes_section(rows: list[Row], chosen: Chosen | None, weights: dict[str, float]) -> str:
    """Plan × shape, as torch.utils.benchmark's Compare lays it out: the passing trials' latency at every shape
    (median ± IQR, ratio to fp32 timed beside it), and the chosen plan's re-timed speedups. Only with 2+ shapes."""
    if len(weights) < 2:
        return ""
    header = ["plan", *(f"{name} (weight {weight:g})" for name, weight in weights.items()), "weighted ratio"]
    body = []
    if chosen is not None and chosen.extra.get("speedup_by_shape"):
        speedups = chosen.extra["speedup_by_shape"]
        body.append([("<strong>chosen</strong> (re-timed)",),
                     *(f"{speedups[name]:.2f}x" if name in speedups else "-" for name in weights),
                     f"{1 / chosen.speedup:.3f}"])
    passing = sorted((r for r in rows if r.passed and r.by_shape), key=lambda r: r.ratio)[:8]
    for row in passing:
        cells = []
        for name in weights:
            t = row.by_shape.get(name)
            cells.append("-" if t is None else f"{t['latency_ms']:.3f} ± {t['latency_spread_ms']:.3f} ms "
                                               f"({t['ratio']:.3f}; fp32 {t['fp32_latency_ms']:.3f})")
        body.append([(f"<a href='#trial-{row.number}'>#{row.number}</a> {html.escape(row.summary)}",),
                     *cells, f"{row.ratio:.3f}"])
    caption = ("Latency at every shape the study measures (latency_inputs): each passing trial's plan, median ± "
               "IQR with its ratio to fp32 timed beside it, fastest first by the weighted mean of those ratios "
               "(the objective). The chosen plan's row gives its speedups from the re-timing after the search.")
    return ("<h2 id='shapes'>Latency by shape</h2>" + _table(header, body)
            + f"<p class='caption'>{html.escape(caption)}</p>")


def modules_section(sensitivity: dict, latency: dict, chosen: Chosen | None) -> str:
    """The per-module signals as a chart, and the chosen plan module by module."""
    plan = chosen.plan if chosen else None
    parts = ["<h2 id='modules'>Per-module signals</h2>"]
    if sensitivity or latency:
        shown = shown_modules(sensitivity, latency)
        note = "" if len(shown) == len(set(sensitivity) | set(latency)) else \
            f" Only the {len(shown)} modules slowest in fp32 are drawn."
        parts.append(_figure("per-module sensitivity and latency", module_chart(sensitivity, latency, plan),
                             "Measured before the search, one module lowered at a time: left, the model's output "
                             "error (relative L2 against fp32); right, the module's own latency. Brackets: the "
                             "chosen plan's dtype." + note))
    else:
        parts.append("<p>No per-module signals are recorded on this study.</p>")
    if plan:
        kept = chosen.kept    # what a plan's "fp32" computes in: the dtype the model was handed over in
        parts.append("<h3>Chosen plan per module</h3>" + _table(
            ["module", "dtype", "output error", f"module ms ({kept})", "module ms (chosen dtype)"],
            [[name, kept if dtype == "fp32" else dtype, formatted(sensitivity.get(name, {}).get(dtype), "{:.3g}"),
              formatted(latency.get(name, {}).get("fp32")), formatted(latency.get(name, {}).get(dtype))]
             for name, dtype in plan.items()]))
    return "".join(parts)


STYLE = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}"
         "table{border-collapse:collapse;margin:0.5em 0 1em;font-size:0.9em}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
         "th{background:#f0f0f0}tr.chosen td{background:#fff3c4}"
         "span.fail,span.error{color:#b00000;font-weight:600}span.pass{color:#1a7f37}"
         "figure{margin:0.5em 0 1.5em}img{max-width:100%;height:auto}"
         ".caption,figcaption{color:#555;font-size:0.9em;max-width:80em}code{font-size:0.95em}"
         "nav a{margin-right:1em}table.trials td{white-space:nowrap}"
         "table.trials td small{display:block;white-space:normal;max-width:18em;color:#555}")


def _intro(study: optuna.Study, rows: list[Row], baseline: float | None, settings: dict[str, Any]) -> str:
    reused = sum(bool(t.user_attrs.get("duplicate")) for t in study.trials)
    pending = sum(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in study.trials)
    lost = len(study.trials) - len(rows) - reused - pending   # their process died mid-trial, say
    errors = sum(r.error is not None for r in rows)
    device = settings.get("device_name") or settings.get("device")
    return (f"<h1>autotune study {html.escape(study.study_name)}</h1>"
            f"<p>{len(rows)} plans evaluated ({errors} of them with an eval_fn error) in {len(study.trials)} "
            f"trials; {reused} reused an earlier result, {lost} ended without one, {pending} running or queued. "
            f"Baseline {studies.score_name(study)} {formatted(baseline)}"
            + (f"; timed on {html.escape(str(device))}." if device else ".") + "</p>")


SECTIONS = (("chosen", "chosen plan"), ("plot", "accuracy vs latency"), ("shapes", "latency by shape"),
            ("trials", "trials"), ("history", "history"), ("finalists", "finalists"), ("timing", "timing"),
            ("modules", "modules"))


def _nav(body: str) -> str:
    """Links to the sections `body` holds: a study with no timed trial has no plot, one with one shape no shapes."""
    return "<nav>" + "".join(f"<a href='#{anchor}'>{label}</a>" for anchor, label in SECTIONS
                             if f"<h2 id='{anchor}'>" in body) + "</nav>"


def _plot_section(rows: list[Row], chosen: Chosen | None, baseline: float | None, settings: dict[str, Any],
                  score: str = "accuracy") -> str:
    done = sum(r.ratio is not None for r in rows)
    caption = "Each point is a trial, numbered as in the table below, " + {
        "in-trial timing": "at the speedup its plan showed when timed once against fp32 within that trial. ",
        "predicted": "at the speedup predicted for its plan from the per-module costs (trial_timing: predicted: only "
                     "the finalists were timed). ",
        "in-trial timing or predicted": "at the speedup its plan showed when timed once against fp32 within that "
                                        "trial; a plan that missed the tolerance was not timed (it cannot be "
                                        "chosen), and its speedup is predicted from the per-module costs. ",
    }[trial_speedups(rows)]
    if chosen is not None:
        caption += "The star is the chosen plan at its speedup re-timed after the search" + (
            "; the dotted arrow starts at its own trial's point." if chosen.trial is not None
            else ": no trial evaluated its plan (a finalist built from the trials' results).")
    if done > LABEL_LIMIT:
        caption += f" With more than {LABEL_LIMIT} trials only the Pareto front and the chosen plan are numbered."
    chart = accuracy_latency_chart(rows, chosen, baseline, tolerance_limit(baseline, settings), score)
    return "<h2 id='plot'>Accuracy vs latency</h2>" + _figure("accuracy vs latency", chart, caption)


def _history_section(rows: list[Row], chosen: Chosen | None) -> str:
    taken = {"in-trial timing": "single timings taken within each trial",
             "predicted": "predicted from the per-module costs, no trial timed",
             "in-trial timing or predicted": "single timings taken within each trial, and predicted from the "
                                             "per-module costs for plans that missed the tolerance (never timed)",
             }[trial_speedups(rows)]
    caption = ("The best passing speedup found so far by trial number, and each trial's own. These are "
               f"{taken}; the dashed line is the chosen plan's speedup re-timed after the search, which is what the "
               "tuner reports.")
    return ("<h2 id='history'>Optimisation history</h2>"
            + _figure("optimisation history", history_chart(rows, chosen), caption))


def html_report(study: optuna.Study) -> str:
    """The report of `study` as one self-contained HTML page (ASCII, non-ASCII as character references)."""
    rows, chosen = trial_rows(study)
    baseline = studies.get_attr(study, studies.BASELINE_ATTR)
    settings = studies.get_attr(study, "settings") or {}
    timed = any(r.ratio is not None for r in rows)
    score = studies.score_name(study)
    parts = [chosen_section(chosen, baseline, studies.why_no_best(study), score),
             _plot_section(rows, chosen, baseline, settings, score) if timed else "",
             shapes_section(rows, chosen, studies.get_attr(study, "latency_shapes") or {}), trials_section(rows, score),
             _history_section(rows, chosen) if timed else "",
             finalists_section(studies.get_attr(study, "finalist_setup_s") or {},
                               studies.get_attr(study, "finalist_ratio") or {},
                               studies.get_attr(study, "finalist_evaluated") or {}, chosen,
                               studies.get_attr(study, "engines_dropped") or {},
                               studies.get_attr(study, "knobs_not_tried") or {}),
             timing_section(rows, settings),
             modules_section(studies.get_attr(study, "sensitivity") or {},
                             studies.get_attr(study, "module_latency_ms") or {}, chosen)]
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>autotune {html.escape(study.study_name)}</title><style>{STYLE}</style></head>"
            f"<body>{_intro(study, rows, baseline, settings)}{_nav(''.join(parts))}{''.join(parts)}</body></html>")
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")
