"""The HTML report tells the truth as a person reads it: the chosen plan marked at its re-timed speedup, every
evaluated trial numbered and linked to its plan, the history and per-module charts; and it renders in a browser."""
from __future__ import annotations

import base64
import json
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import torch
from optuna.trial import TrialState
from torch import nn

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.measure import LatencyStats
from autotune.plan import plan_id, plan_of, summarize
from autotune.report import html_report, trial_rows
from autotune.storage import study as studies

NAMES = ["0", "1", "2", "3"]
FP32_MS = 4.0
# accuracy lost per module in int8 / bf16; module "0" in int8 alone misses the 2% tolerance
PENALTY = {"0": {"int8": 0.03, "bf16": 0.004}, "1": {"int8": 0.006, "bf16": 0.001},
           "2": {"int8": 0.006, "bf16": 0.001}, "3": {"int8": 0.004, "bf16": 0.001}}
MODULE_COST = {"int8": 0.55, "bf16": 0.8, "fp32": 1.0}
CHROMIUM = Path("/usr/bin/chromium")


def accuracy_of(plan: dict[str, str]) -> float:
    return 0.9 - sum(PENALTY[name].get(dtype, 0.0) for name, dtype in plan.items())


class ScriptedMeasurer:
    """Latency is a known function of the plan. A trial times its plan once against fp32 with a large, plan-dependent
    error; the verification after the search (its models already warm: no warm-up) times the true cost, so a plan's
    re-timed speedup differs from its trial's, as on a noisy host."""

    def __init__(self):
        self.calls = 0

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return {n: {d: 0.0 if d == "fp32" else PENALTY[n][d] / 3 for d in ds} for n, ds in candidates.items()}

    def module_latency(self, fp32, candidates, inputs, calibration):
        return {n: {d: MODULE_COST[d] * FP32_MS / len(NAMES) for d in ds} for n, ds in candidates.items()}

    def latency(self, models, inputs, repeats, warmup=None):
        self.calls += 1
        drift = 1.0 + 0.03 * (self.calls % 4)   # the host's speed moves between trials, fp32 with it

        def stats(model):
            plan = plan_of(model, NAMES)
            ratio = sum(MODULE_COST[d] for d in plan.values()) / len(NAMES)
            if warmup is None and "int8" in plan.values():   # one noisy timing within a trial
                ratio *= 1.0 + 0.25 * (int(plan_id(plan), 16) % 7) / 6
            return LatencyStats(FP32_MS * drift * ratio, 0.02 * FP32_MS * drift * ratio, repeats)
        return {name: stats(model) for name, model in models.items()}


def tuned_study(tmp_path: Path, settings: dict | None = None, trial_timing: str = "measured"):
    """A real tuning run on a small Linear stack; `settings` is written as the study's settings attribute."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in NAMES)).eval()
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.02,
                          max_trials=14, repeats=3, storage=f"sqlite:///{tmp_path}/report.db", study_name="report",
                          trial_timing=trial_timing)
    inputs = torch.randn(4, 8)

    def eval_fn(tuned):
        tuned(inputs)
        plan = plan_of(tuned, NAMES)
        if plan["0"] == "int8" and plan["3"] == "bf16":
            raise ValueError("scripted evaluation failure")
        return accuracy_of(plan)

    result = autotune(model, config, eval_fn, inputs, measurer=ScriptedMeasurer())
    if settings is not None:
        studies.set_attr(result.study, "settings", settings)
    return result


# what the study attribute autotune.settings holds: the device and how it timed, and the tolerance
SETTINGS = {"device": "cpu", "device_name": "Test CPU 9000", "num_threads": 2, "warmup": 3, "repeats": 3,
            "torch": torch.__version__, "tolerable_loss": 0.02, "loss_kind": "relative", "higher_is_better": True}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    result = tuned_study(folder, SETTINGS)
    out = folder / "report.html"
    out.write_text(html_report(result.study), encoding="ascii")
    return result, out


def images(page: str) -> dict[str, bytes]:
    return {alt: base64.b64decode(data) for alt, data in
            re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)}


def test_the_run_has_a_chosen_plan_whose_re_timed_speedup_differs_from_its_trial(tuned):
    result, _ = tuned
    rows, chosen = trial_rows(result.study)
    assert chosen is not None and chosen.plan == result.plan and chosen.trial is not None
    assert chosen.speedup == pytest.approx(result.speedup)
    assert abs(chosen.trial.speedup - chosen.speedup) > 0.05   # the case the report must not blur
    assert sum(row.chosen for row in rows) == 1


def test_the_chosen_plan_is_marked_with_its_re_timed_speedup(tuned):
    result, out = tuned
    page = out.read_text()
    rows, chosen = trial_rows(result.study)
    speedup = f"{result.speedup:.2f}x (re-timed)"
    assert "Baseline vs best" in page and speedup in page and plan_id(result.plan) in page
    assert f"<a href='#trial-{chosen.trial.number}'>trial #{chosen.trial.number}</a>" in page
    assert f"({chosen.trial.speedup:.2f}x)" in page    # its trial's own timing, shown apart from the re-timing
    row = re.search(rf'<tr id="trial-{chosen.trial.number}" class="chosen[^"]*">(.*?)</tr>', page).group(1)
    assert "&#9733; chosen" in row and plan_id(result.plan) in row
    assert page.count("&#9733; chosen") == 2    # its trial's row, and its finalist's
    assert "re-timed after the search" in page and "timed once against fp32 within that trial" in page


def test_a_table_row_per_evaluated_trial_with_its_plan(tuned):
    result, out = tuned
    page = out.read_text()
    evaluated = studies.evaluated_trials(result.study)
    assert len(evaluated) >= 5
    errors = sum(t.state == TrialState.FAIL for t in evaluated)
    assert errors and f"{len(evaluated)} plans evaluated ({errors} of them with an eval_fn error)" in page
    for trial in evaluated:
        plan = studies.trial_plan(trial)
        row = re.search(rf'<tr id="trial-{trial.number}"[^>]*>(.*?)</tr>', page)
        assert row, f"no row for trial {trial.number}"
        cells = [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td>(.*?)</td>", row.group(1))]
        assert cells[0] == str(trial.number) and cells[1] == plan_id(plan)
        assert cells[2] == summarize(plan).replace("×", "&#215;") and cells[3] == trial.user_attrs["source"]
        if trial.state == TrialState.FAIL:
            assert cells[8] == "errorValueError: scripted evaluation failure" and cells[6] == "-"
            continue
        assert cells[4] == f"{trial.user_attrs['accuracy']:.4f}"
        predicted = "" if trial.user_attrs["passed"] else " predicted"   # a failing plan is not timed
        assert cells[6] == f"{trial.values[0]:.3f} ({1 / trial.values[0]:.2f}x){predicted}"
        assert cells[8] == ("pass" if trial.user_attrs["passed"] else "FAIL")
    duplicates = [t for t in result.study.trials if t.user_attrs.get("duplicate")]
    assert all(f'id="trial-{t.number}"' not in page for t in duplicates)
    assert len(re.findall(r'<tr id="trial-', page)) == len(evaluated)


def test_every_finalist_is_listed_fastest_first_with_its_set_up_and_race_ratio(tuned):
    result, out = tuned
    page = out.read_text()
    setup = result.study.user_attrs["autotune.finalist_setup_s"]
    race = result.study.user_attrs["autotune.finalist_ratio"]
    chosen = result.study.user_attrs["autotune.best"]["finalist"]
    assert len(setup) >= 2 and set(race) == set(setup) and chosen in setup
    table = re.search(r"<h2 id='finalists'>Finalists</h2><table>(.*?)</table>", page).group(1)
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", table)
    assert [row[0] for row in rows] == sorted(setup, key=race.get)
    evaluated = result.study.user_attrs["autotune.finalist_evaluated"]
    for name, setup_s, ratio, outcome, mark in rows:
        assert setup_s == f"{setup[name]:.1f}" and ratio == f"{race[name]:.3f} ({1 / race[name]:.2f}x)"
        assert ("chosen" in mark) == (name == chosen) and outcome == evaluated.get(name, "-")
    assert evaluated[chosen].startswith("passed: score ")
    assert all(race[name] <= race[chosen] for name in evaluated)   # evaluated fastest first, until one passed
    assert f"{len(setup)} finalists" in page and "Left out: knob" in page   # no Conv2d: channels_last not tried


def test_the_charts_are_inline_pngs(tuned):
    _, out = tuned
    page = out.read_text()
    charts = images(page)
    assert set(charts) == {"accuracy vs latency", "optimisation history", "per-module sensitivity and latency"}
    assert all(data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000 for data in charts.values())
    assert "Optimisation history" in page and "Per-module signals" in page
    assert not re.search(r"(src|href)=[\"'](https?:)?//", page) and "<script" not in page
    assert page.isascii()


def test_device_settings_and_timing_spread_are_shown(tuned):
    result, out = tuned
    page = out.read_text()
    assert "timed on Test CPU 9000" in page and "<td>threads while timing</td><td>2</td>" in page
    fp32 = [t.user_attrs["fp32_latency_ms"] for t in studies.evaluated_trials(result.study)
            if t.state == TrialState.COMPLETE and t.user_attrs["latency_measured"]]
    assert f"median {statistics.median(fp32):.3f} ms, range {min(fp32):.3f} to {max(fp32):.3f} ms" in page
    assert "plan timing IQR / median, within a trial" in page and "median 2.0%" in page


def test_per_module_table_lists_the_chosen_dtypes(tuned):
    result, out = tuned
    page = out.read_text()
    for name, dtype in result.plan.items():
        assert f"<tr><td>{name}</td><td>{dtype}</td>" in page


def test_a_study_without_settings_or_best_still_reports(tmp_path):
    result = tuned_study(tmp_path)
    studies.set_attr(result.study, "settings", None)    # as in a study tuned before settings were kept
    page = html_report(result.study)
    assert "does not record the device" in page and "; timed on" not in page
    result.study.set_user_attr(studies.ATTR_PREFIX + "best", None)
    page = html_report(result.study)
    assert "No best plan recorded yet" in page and "&#9733; chosen" not in page
    assert len(images(page)) == 3


# ---- in a real browser ----

WINDOW = "1200,2600"
PROBE = """<script>window.addEventListener("load", () => {
  const box = e => { const r = e.getBoundingClientRect(); return {top: r.top + scrollY, bottom: r.bottom + scrollY,
                                                                 left: r.left, right: r.right}; };
  const chosen = document.querySelector("tr.chosen");
  const probe = {images: [...document.images].map(i => ({alt: i.alt, complete: i.complete,
                  width: i.naturalWidth, height: i.naturalHeight, box: box(i)})),
                 chosen: chosen ? {text: chosen.innerText, box: box(chosen)} : null,
                 headings: [...document.querySelectorAll("h1, h2")].map(h => h.innerText)};
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify(probe);
  document.body.appendChild(out);
});</script>"""


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=120)


def screenshot(page: Path, png: Path, profile: Path, size: str = WINDOW) -> None:
    """A headless Chromium screenshot of `page` (the top `size` pixels)."""
    chromium(f"--screenshot={png}", f"--window-size={size}", page.as_uri(), profile=profile)


@pytest.fixture(scope="module")
def rendered(tuned, tmp_path_factory):
    """The report in headless Chromium: what a script saw once the page loaded, and a screenshot's pixels."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from matplotlib.image import imread

    _, out = tuned
    folder = tmp_path_factory.mktemp("chromium")
    probed = folder / "probed.html"
    probed.write_text(out.read_text().replace("</body>", PROBE + "</body>"))
    run = chromium("--dump-dom", f"--window-size={WINDOW}", probed.as_uri(), profile=folder / "profile")
    found = re.search(r'<pre id="probe">(.*?)</pre>', run.stdout, re.S)
    assert found, f"no probe in the rendered DOM: {run.stderr[-2000:]}"
    probe = json.loads(found.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    png = folder / "report.png"
    screenshot(out, png, folder / "profile")
    assert png.is_file(), "chromium wrote no screenshot"
    return probe, imread(png)[..., :3]


def test_the_report_renders_in_chromium_with_its_images_and_the_chosen_plan(tuned, rendered):
    result, _ = tuned
    probe, _ = rendered
    assert [image["alt"] for image in probe["images"]] == [
        "accuracy vs latency", "optimisation history", "per-module sensitivity and latency"]
    for image in probe["images"]:
        shown = image["box"]["right"] - image["box"]["left"]
        assert image["complete"] and image["width"] > 300 and image["height"] > 200 and shown > 300, image
    chosen = probe["chosen"]
    assert chosen and chosen["box"]["bottom"] > chosen["box"]["top"] and "chosen" in chosen["text"]
    assert plan_id(result.plan) in chosen["text"]
    assert any("Baseline vs best" in h for h in probe["headings"]) and "Trials" in probe["headings"]


def test_a_chromium_screenshot_shows_the_page_and_the_chosen_star_on_the_plot(rendered):
    probe, pixels = rendered
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1000
    colours = {tuple(p) for p in (pixels.reshape(-1, 3) * 255).round().astype(int)[::7].tolist()}
    assert len(colours) > 200                   # text, tables and charts, not one flat colour
    plot = probe["images"][0]["box"]
    assert plot["bottom"] < pixels.shape[0], "the accuracy plot is below the screenshot"
    area = pixels[int(plot["top"]):int(plot["bottom"]), int(plot["left"]):int(plot["right"])]
    gold = (abs(area[..., 0] - 0xF2 / 255) < 0.03) & (abs(area[..., 1] - 0xB7 / 255) < 0.03) & (area[..., 2] < 0.15)
    assert gold.sum() > 50                      # the chosen plan's star (and its label's frame) on the plot


def test_a_score_too_small_for_four_decimals_shows_its_digits():
    """A mean squared error of 1.2e-4 (a lower-is-better eval_fn) read 0.0001 beside 0.0000 in the summary, show and
    the report."""
    from autotune.result import formatted
    assert formatted(1.2134e-4) == "0.0001213" and formatted(-0.0123) == "-0.0123"
    assert formatted(0.99609375) == "0.9961" and formatted(0.0) == "0.0000" and formatted(12.5) == "12.5000"
    assert formatted(None) == "-" and formatted(1.5, "{:.2f}x") == "1.50x"


def test_a_model_handed_over_in_bf16_has_a_bf16_baseline_on_the_page(tmp_path):
    """Its plan's "fp32" keeps modules in bf16, as the summary says: the page said "fp32 baseline"."""
    from test_parents import CastsToItsWeights, tune

    from autotune.report.page import html_report

    result, _ = tune(CastsToItsWeights().to(torch.bfloat16), f"sqlite:///{tmp_path}/s.db", ["int8", "fp32"])
    page = html_report(result.study)
    assert "bf16 baseline" in page and "speedup vs the bf16 baseline" in page and "fp32 baseline" not in page


def test_the_module_chart_of_a_study_whose_lowered_dtypes_were_all_pruned_is_drawn_without_a_log_axis():
    """fp16 slower than fp32 in every module (a CPU without native fp16): no sensitivity was measured but fp32's 0,
    and `autotune report` exited 1 with matplotlib's "Data cannot be log-scaled because all values are <= 0"."""
    from autotune.report.charts import module_chart

    sensitivity = {name: {"fp32": 0.0} for name in ("conv", "fc1", "fc2")}
    latency = {"conv": {"fp16": 0.94, "fp32": 0.20}, "fc1": {"fp16": 1.25, "fp32": 0.29}, "fc2": {"fp16": 0.04,
                                                                                              "fp32": 0.015}}
    drawn = module_chart(sensitivity, latency, {"conv": "fp32", "fc1": "fp32", "fc2": "fp32"})
    assert drawn.startswith("data:image/png;base64,") and len(base64.b64decode(drawn.split(",", 1)[1])) > 1000


def test_a_study_whose_trials_were_predicted_says_so_where_it_had_said_they_were_timed(tmp_path):
    """With `trial_timing: predicted` the legend said "in-trial timing" and the caption "timed once against fp32
    within that trial", of speedups no trial had timed."""
    page = html_report(tuned_study(tmp_path, trial_timing="predicted").study)
    assert "predicted for its plan from the per-module costs" in page
    assert "predicted from the per-module costs, no trial timed" in page
    assert "timed once against fp32 within that trial" not in page and "single timings taken" not in page


def test_what_the_tuner_stored_with_the_chosen_plan_reads_as_text_not_python(tuned):
    """The chosen plan's table showed `{'batch 4': 1.4957450051251806}`, a dict of what it was recorded with and
    `['channels_last']`."""
    _, out = tuned
    section = re.search(r"<h2 id='chosen'>.*?</table>", out.read_text(), re.S).group(0)
    assert "{" not in section and "['" not in section and "':" not in section, section
    assert re.search(r"<td>speedup by shape</td><td>-</td><td>[^<]*: \d+\.\d\dx</td>", section), section


def test_every_link_of_the_page_leads_to_a_section_it_has(tuned, tmp_path):
    """The navigation linked #plot, #history and #finalists on pages without them: a study with no timed trial has no
    plot nor history, one with no finalist no finalists."""
    _, out = tuned
    for page in (out.read_text(), html_report(tuned_study(tmp_path).study)):
        anchors = re.findall(r"<nav>(.*?)</nav>", page)[0]
        targets = re.findall(r"href='#([\w-]+)'", anchors)
        assert targets and all(f"id='{target}'" in page for target in targets), targets
    result = tuned_study(tmp_path / "bare")
    for attr in ("finalist_setup_s", "engines_dropped"):
        studies.set_attr(result.study, attr, None)
    page = html_report(result.study)
    assert "id='finalists'" not in page and "href='#finalists'" not in page


def test_speedups_are_said_timed_for_plans_that_passed_and_predicted_for_those_that_missed(tuned):
    """A study timing its trials predicts the speedup of a plan that missed the tolerance (it cannot be chosen), yet
    the legend said "missed tolerance: in-trial timing" and the caption that every point was timed."""
    result, out = tuned
    rows, _ = trial_rows(result.study)
    assert any(not r.passed and r.error is None for r in rows)    # the fixture's misses
    page = out.read_text()
    assert "a plan that missed the tolerance was not timed (it cannot be chosen), and its speedup is predicted" in page
    assert "and predicted from the per-module costs for plans that missed the tolerance" in page


def test_the_trials_table_of_several_shapes_names_the_shape_its_milliseconds_are_of(tuned):
    """Beside the weighted ratio over shapes, the milliseconds column showed the first shape's times unlabelled: a
    row read 0.792 (1.26x) beside 0.194 (0.122), which is 1.59x."""
    import dataclasses

    from autotune.report.page import trials_section
    result, _ = tuned
    rows, _ = trial_rows(result.study)
    shaped = [dataclasses.replace(row, by_shape={"batch 1": {"ratio": 1.0}, "batch 64": {"ratio": 1.0}})
              for row in rows]
    assert "latency/fp32 in trial, weighted over shapes (speedup)" in trials_section(shaped)
    assert "plan ms ± IQR (fp32 ms) in trial, at batch 1" in trials_section(shaped)
    assert "at batch" not in trials_section(rows) and "weighted" not in trials_section(rows)


def test_the_history_charts_trial_axis_has_whole_trial_numbers(tuned, monkeypatch):
    """Its axis read 0.25, 0.50 ... and 4.2, 4.4 for a few trials."""
    from autotune.report import charts
    drawn = []
    monkeypatch.setattr(charts, "_data_uri", lambda fig: drawn.append(fig) or "")
    result, _ = tuned
    rows, chosen = trial_rows(result.study)
    charts.history_chart(rows[:3], chosen)
    ticks = drawn[0].axes[0].get_xticks()
    assert len(ticks) and all(float(tick).is_integer() for tick in ticks), ticks


def test_a_study_scored_by_a_loss_names_its_score_so_in_the_summary_show_and_the_report(tmp_path):
    """An eval_fn returning a mean squared error (higher_is_better=False) had its numbers called "accuracy"."""
    from click.testing import CliRunner

    from autotune.cli import main

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval(), torch.randn(16, 8)
    storage = f"sqlite:///{tmp_path}/loss.db"
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["bf16", "fp32"]), repeats=3,
                          tolerable_loss=1.0, loss_kind="absolute", higher_is_better=False, max_trials=2,
                          storage=storage, study_name="mse")
    with torch.no_grad():
        result = autotune(model, config, lambda net: float(((net(x) - model(x)) ** 2).mean()), x)
    shown = CliRunner().invoke(main, ["show", "mse", "--storage", storage])
    assert shown.exit_code == 0, shown.output
    page = html_report(result.study)
    for text in (result.summary(), shown.output, page):
        assert "score (lower is better)" in text and "accuracy 0" not in text and "accuracy  " not in text
    assert "baseline score (lower is better) 0" in shown.output and "Baseline score (lower is better) 0" in page
