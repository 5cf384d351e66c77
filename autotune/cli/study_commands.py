"""The study commands: tune from a YAML file, inspect, export and report studies, re-apply a plan."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import optuna
import torch
import yaml
from pydantic import ValidationError

from autotune.backends import held_dtype
from autotune.capture import eval_fn_batches, example_or_batches, record_module_inputs, with_fed_batches
from autotune.cli.base import (
    CliError,
    load_study,
    main,
    missing_sqlite,
    open_existing_storage,
    storage_option,
    writable,
)
from autotune.clone import clone
from autotune.config import FileConfig, LatencyInput, TuningConfig, load_config
from autotune.config.file import load_yaml, yaml_error
from autotune.discovery import search_candidates, uncompiled
from autotune.engines import (
    CALLS_ITSELF,
    COMPILE_STATIC,
    ENGINES,
    ENTRIES,
    KNOBS,
    Calibration,
    get_engine,
    realise,
    with_knobs,
)
from autotune.engines.saving import save_built, saved_model_path
from autotune.errors import PlanError, SaveError, did_you_mean, listed
from autotune.interrupts import HELPER_FLAG, interrupts
from autotune.model_call import entry_paths
from autotune.plan import Plan, plan_id, shapes_differ, summarize, validate_plan
from autotune.result import BUSY_KEY, NOISE_KEY, best_speedup, counted, formatted, table
from autotune.search.scores import TIMED_CALLS_ATTR, compiled_in_place
from autotune.search.trials import TrialCallback
from autotune.storage import study as studies
from autotune.storage.rdb import open_storage, shown
from autotune.tuner import finish, search, start_runner, study_name_for, usable_device


def evaluated_so_far(model: torch.nn.Module, config: TuningConfig) -> tuple[str, int | None]:
    """(study name, evaluated trials already in it, None where there is no such study): what a resumed run starts
    from."""
    if missing_sqlite(config.storage):
        return study_name_for(model, config), None
    storage = open_storage(config.storage)
    name = study_name_for(model, config, storage=storage)
    if name not in optuna.get_all_study_names(storage):
        return name, None
    return name, len(studies.evaluated_trials(optuna.load_study(study_name=name, storage=storage)))


@contextmanager
def tuner_log(verbose: bool) -> Iterator[None]:
    """With `verbose`, the tuner's log lines (every trial, each finalist compiled) on stderr while the block runs."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("autotune")
    level = logger.level
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextmanager
def progress(total: int, done: int, verbose: bool) -> Iterator[list[TrialCallback]]:
    """Trial callbacks showing progress: a bar with ETA over evaluated trials; none with `verbose`, where the
    tuner's log lines (tuner_log) say it."""
    if verbose:
        yield []
        return
    # Counts only this run's trials: starting part-full would make click's ETA too optimistic.
    label = "evaluated trials" + (f" (after {done} earlier)" if done else "")
    if not sys.stdout.isatty():   # a log: click's bar would leave its label alone on a line
        counted = [0]

        def said(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if trial.user_attrs.get("evaluated"):
                counted[0] += 1
                click.echo(f"{label}: {counted[0]} of at most {max(total - done, 1)}")
        yield [said]
        return
    with click.progressbar(length=max(total - done, 1), label=label, show_eta=True, show_pos=True) as bar:
        def advance(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            if trial.user_attrs.get("evaluated"):
                bar.update(1)
        yield [advance]


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False))
@click.option("--storage", default=None, help="override tuning.storage")
@click.option("--study-name", default=None, help="override tuning.study_name")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="processes tuning the study at once on this machine; they share max_trials")
# A name no one types for `--workers`: a hidden `--worker` took that typo and ran a silent helper (no summary).
@click.option(HELPER_FLAG, "helper", is_flag=True, hidden=True, help="run trials only; the starting process reports")
@click.option("-v", "--verbose", is_flag=True, help="log every trial instead of a progress bar")
def tune(config_path: str, storage: str | None, study_name: str | None, workers: int, helper: bool,
         verbose: bool) -> None:
    """Tune the model of a YAML CONFIG (resumes its study)."""
    started = time.monotonic()
    config = load_config(config_path)
    tuning = config.tuning.model_copy()
    if storage:
        tuning.storage = storage
    if study_name:
        tuning.study_name = study_name
    model = config.build_model()
    eval_fn = config.evaluation.build()
    if helper:
        runner = start_runner(model, tuning, eval_fn, config.build_example_inputs(), run_fn=config.build_run_fn())
        search(runner, started)
        click.echo(f"worker {os.getpid()}: {counted(runner.eval_calls, 'eval_fn call')}")
        return
    usable_device(torch.device(tuning.device))    # before the study is said to be opened
    name, done = evaluated_so_far(model, tuning)
    # A run stopped before its first trial was evaluated kept its baseline and signals: a resumed study, not new.
    state = "new" if done is None else f"resuming after {counted(done, 'evaluated trial')}"
    done = done or 0
    click.echo(f"study {name!r} in {shown(tuning.storage)}: {state}"
               + (f"; {workers} workers" if workers > 1 else ""))
    # -P: the working directory is not put first on the import path, where a file in it named as a module of
    # Python's own (concurrent.py) took that module's place in the helpers alone; `main` adds it after.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    command = [sys.executable, *safe_path, "-m", "autotune", "tune", config_path, HELPER_FLAG, "--storage",
               tuning.storage, "--study-name", name]
    helpers = [subprocess.Popen(command, preexec_fn=_interrupted_with_parent if sys.platform == "linux" else None)
               for _ in range(workers - 1)]
    with tuner_log(verbose):
        try:
            with progress(tuning.max_trials, done, verbose) as callbacks:
                runner = start_runner(model, tuning, eval_fn, config.build_example_inputs(),
                                      callbacks=[*callbacks, interrupts.stop_if_received], run_fn=config.build_run_fn())
                stopped = search(runner, started)
            failed = [code for code in (helper.wait() for helper in helpers) if code != 0]
        finally:
            for helper in helpers:
                if helper.poll() is None:
                    helper.kill()
        if failed:
            raise CliError(f"{len(failed)} of {workers - 1} worker processes failed (exit codes {failed}); every "
                           "finished trial is kept: run the same command again to resume")
        if not verbose:   # with -v the tuner's log says it, and each finalist as it is compiled
            click.echo(f"search stopped: {stopped}")
            if (best := studies.standing_best(runner.study, tuning)) is not None:
                click.echo(f"the study's best plan ({best.get('finalist', 'fp32')}) was recorded after its last "
                           f"trial: it is built and timed again, not chosen again ({studies.SEARCHES_ON})")
            elif compiling := [engine for engine in tuning.engines if engine != "eager"]:
                click.echo(f"finalists: compiling the best plans in {', '.join(compiling)} (seconds to minutes a "
                           "plan; -v names each), then timing them together")
        result = finish(runner, started)
    click.echo(result.summary())
    click.echo(table([["module", "dtype"], *([n, d] for n, d in result.plan.items())]))


def _interrupted_with_parent() -> None:
    """In a helper process, before it runs: Linux sends it SIGINT (a Ctrl-C: it stops, its finished trials kept)
    when the `tune` that started it dies. A `tune --workers 2` killed with SIGKILL left its helper tuning on alone."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)   # 1: PR_SET_PDEATHSIG


@main.command()
@click.argument("study_name", metavar="STUDY")
@storage_option
def show(study_name: str, storage: str) -> None:
    """Trials of STUDY as a table, then its best plan."""
    study = load_study(study_name, storage)
    shapes = studies.get_attr(study, "latency_shapes") or {}
    by_shape = len(shapes) > 1
    score = studies.score_name(study)
    rows = [["#", "source", "plan id", "plan", score, "latency/fp32", *(["by shape"] if by_shape else []),
             "result"]]
    kept = studies.kept_dtype(study)     # a plan's "fp32" keeps a module in the dtype it was handed over in
    # A pareto study's front: the trials a user picks from (`export --trial N`)
    front = {trial.number for trial in study.best_trials} if len(study.directions) > 1 else set()
    for trial in study.trials:
        attrs = trial.user_attrs
        if attrs.get("duplicate"):
            outcome = "duplicate"
        elif trial.state == optuna.trial.TrialState.COMPLETE:
            outcome = ("pass" if attrs.get("passed") else "FAIL") + (" (front)" if trial.number in front else "")
        elif trial.state == optuna.trial.TrialState.FAIL:
            # "error": its eval_fn raised or its plan failed to run (said below), as the report says; beside the
            # "FAIL" of a plan that missed the tolerance, a "fail" told them apart by case alone
            outcome = "error" if "fail_reason" in attrs else "stopped"   # stopped: died mid-trial, plan queued again
        else:
            outcome = trial.state.name.lower()
        plan = studies.trial_plan(trial)
        rows.append([str(trial.number), attrs.get("source", "sampler"), plan_id(plan) if plan else "-",
                     summarize(plan, kept), formatted(attrs.get("accuracy")), _ratio(trial),
                     *([_per_shape(attrs.get("latency_by_shape"))] if by_shape else []), outcome])
    click.echo(table(rows))
    for reason, numbers in studies.failures(study).items():
        click.echo(f"{'trial' if len(numbers) == 1 else 'trials'} {', '.join(map(str, numbers))} failed: {reason}")
    if any(row[-1] == "stopped" for row in rows):
        click.echo("stopped: its process was interrupted or died mid-trial; its plan was queued again")
    baseline = studies.get_attr(study, studies.BASELINE_ATTR)
    click.echo(f"baseline {score} {formatted(baseline)}")
    best = studies.get_attr(study, "best")
    if best is None:
        click.echo(f"no best plan recorded yet ({studies.why_no_best(study)})")
        return
    click.echo(f"best: {score} {formatted(best['accuracy'])}, speedup {best_speedup(best)}, "
               f"{summarize(best['plan'], kept)}{_runs_as(best)}")
    if by_shape:
        click.echo("latency weighted over shapes " + ", ".join(f"{name} ×{weight:g}" for name, weight in shapes.items())
                   + "; best speedup by shape: " + ", ".join(f"{name} {speedup:.2f}x" for name, speedup
                                                            in best.get("speedup_by_shape", {}).items()))
    click.echo(table([["module", "dtype"], *([n, kept if d == "fp32" else d] for n, d in best["plan"].items())]))


def _runs_as(best: dict) -> str:
    """How the best plan runs, where that is more than its modules swapped: its engine and knobs."""
    engine, knobs = best.get("engine", "eager"), best.get("knobs") or []
    if engine == "eager" and not knobs:
        return ""
    return f", {engine} engine" + (f" with {', '.join(knobs)}" if knobs else "")


def _ratio(trial: optuna.trial.FrozenTrial) -> str:
    """The trial's latency ratio; `~` marks one predicted from module costs (a failing plan's, or every plan's
    with trial_timing: predicted)."""
    predicted = trial.user_attrs.get("latency_measured") is False
    return formatted(trial.values[0] if trial.values else None, "~{:.3f}" if predicted else "{:.3f}")


def _per_shape(by_shape: dict | None) -> str:
    return " · ".join(f"{name} {timing['ratio']:.3f}" for name, timing in by_shape.items()) if by_shape else "-"


@main.command()
@click.argument("study_name", metavar="STUDY")
@storage_option
@click.option("--format", "fmt", type=click.Choice(["json", "yaml"]), default=None,
              help="default: from --out's suffix, else json")
@click.option("--out", type=click.Path(dir_okay=False), default=None, callback=lambda _c, _p, v: v and writable(v),
              help="default: standard output")
@click.option("--trial", "trial_number", type=int, default=None,
              help="that trial's plan instead of the best (a point of a pareto study's front), in the eager engine")
def export(study_name: str, storage: str, fmt: str | None, out: str | None, trial_number: int | None) -> None:
    """The best plan of STUDY (input of `apply`)."""
    study = load_study(study_name, storage)
    best, baseline = studies.get_attr(study, "best"), studies.get_attr(study, studies.BASELINE_ATTR)
    if trial_number is not None:
        data = _trial_plan_file(study, trial_number, baseline)
    elif best is None:
        raise CliError(f"study {study_name!r} in {shown(storage)} has no best plan yet "
                       f"({studies.why_no_best(study)})")
    else:
        data = {"study": study_name, "baseline_accuracy": baseline,
                "accuracy": best["accuracy"], "speedup": best["speedup"], "engine": best.get("engine", "eager"),
                "knobs": best.get("knobs", []), "plan": best["plan"]}
        for doubt in (NOISE_KEY, BUSY_KEY):    # how far off the speedup may be: its timing was noisy, or busy
            if doubt in best:
                data[doubt] = best[doubt]
        if best.get("compile_static"):
            data["compile_static"] = True
    if compiled_in_place(study):    # eval_fn ran it through generate, or called its encoder apart
        data["compile_in_place"] = True
    # For `bench`, which times what tuning timed: the config's shapes, or the calls a generation was timed at.
    if timed := studies.get_attr(study, studies.LATENCY_INPUTS_ATTR) or studies.get_attr(study, TIMED_CALLS_ATTR):
        data["latency_inputs"] = timed
    if shapes := studies.get_attr(study, studies.MODULE_SHAPES_ATTR):   # for `apply` onto a model of other shapes
        data["module_shapes"] = shapes
    _written(data, fmt, out)


def _trial_plan_file(study: optuna.Study, number: int, baseline: float | None) -> dict:
    """What `export --trial` writes: the trial's plan, its score and its speedup in the trial (measured or
    predicted: `bench` times it), for the eager engine the search judged plans in."""
    trial = next((trial for trial in study.trials if trial.number == number), None)
    if trial is None:
        raise CliError(f"study {study.study_name!r} has no trial {number} (its trials are 0 to "
                       f"{len(study.trials) - 1}; `autotune show` lists them)")
    if trial.state != optuna.trial.TrialState.COMPLETE or not trial.values:
        raise CliError(f"trial {number} of study {study.study_name!r} has no result ({trial.state.name.lower()}): "
                       "export a trial `autotune show` lists as pass or FAIL")
    if not trial.user_attrs.get("passed"):
        click.echo(f"note: trial {number}'s plan missed the tolerance (loss {trial.user_attrs.get('accuracy_loss')})",
                   err=True)
    predicted = trial.user_attrs.get("latency_measured") is False    # as `show` marks it with ~
    return {"study": study.study_name, "trial": number, "baseline_accuracy": baseline,
            "accuracy": trial.user_attrs.get("accuracy"), "speedup": 1 / trial.values[0],
            **({"speedup_predicted": True} if predicted else {}), "engine": "eager", "knobs": [],
            "plan": studies.trial_plan(trial)}


def _written(data: dict, fmt: str | None, out: str | None) -> None:
    fmt = fmt or ("yaml" if out and Path(out).suffix in (".yaml", ".yml") else "json")
    text = json.dumps(data, indent=2) + "\n" if fmt == "json" else yaml.safe_dump(data, sort_keys=False)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}")
    else:
        click.echo(text, nl=False)


# What `export` writes beside the plan; `apply` and `bench` read engine, knobs, compile_in_place, compile_static,
# latency_inputs and module_shapes.
PLAN_FILE_KEYS = ("study", "trial", "baseline_accuracy", "accuracy", "speedup", "speedup_predicted", "engine", "knobs",
                  "plan", NOISE_KEY, BUSY_KEY, "compile_in_place", "compile_static", "latency_inputs", "module_shapes")


@dataclass(frozen=True)
class SavedPlan:
    plan: Plan
    engine: str
    knobs: tuple[str, ...]
    compile_in_place: bool
    latency_inputs: list[LatencyInput]    # the calls tuning timed where its config named none (a generation's)
    compile_static: bool = False          # compiled for each shape apart, as tuning had to (engines.COMPILE_STATIC)
    module_shapes: dict[str, str] | None = None   # the tuned model's (plan.module_shapes), where the file records them


def read_plan(path: str) -> SavedPlan:
    """A plan file from `autotune export` (JSON or YAML), or a bare {module: dtype} mapping (the eager engine, no
    knobs; a compiling engine compiles through torch.compile's wrapper)."""
    text = Path(path).read_text()
    try:
        data = load_yaml(text)  # YAML reads JSON too
    except yaml.YAMLError as exc:
        raise CliError(f"not a JSON or YAML plan file: {yaml_error(exc, path, text)}") from None
    plan = data.get("plan", data) if isinstance(data, dict) else data
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise CliError(f"{path}: expected a mapping of module name to dtype (or autotune export's output)")
    exported = data if "plan" in data else {}
    if unknown := [key for key in exported if key not in PLAN_FILE_KEYS]:    # a misspelt engine was dropped unsaid
        raise CliError(f"{path}: unknown key {unknown[0]!r}{did_you_mean(str(unknown[0]), PLAN_FILE_KEYS)}; a plan "
                       f"file holds {', '.join(PLAN_FILE_KEYS)}")
    engine = exported.get("engine", "eager")
    if engine not in ENGINES:
        raise CliError(f"{path}: unknown engine {engine!r}; known: {sorted(ENGINES)}")
    knobs = exported.get("knobs") or []
    if not isinstance(knobs, list) or not all(knob in KNOBS for knob in knobs):
        raise CliError(f"{path}: knobs must be a list of {sorted(KNOBS)}; got {knobs!r}")
    try:
        timed = [LatencyInput.model_validate(entry) for entry in exported.get("latency_inputs") or []]
    except ValidationError as exc:
        raise CliError(f"{path}: latency_inputs: {exc.errors()[0]['msg']}") from None
    shapes = exported.get("module_shapes")
    if shapes is not None and not (isinstance(shapes, dict) and all(isinstance(v, str) for v in shapes.values())):
        raise CliError(f"{path}: module_shapes must map module names to shapes (\"32x1x3x3 32\"), as export writes")
    return SavedPlan(plan, engine, tuple(knobs), exported.get("compile_in_place") is True, timed,
                     exported.get("compile_static") is True, shapes)


def tuning_batches(config: FileConfig, model: torch.nn.Module, engine: str) -> tuple[list, list]:
    """The batches the tuning timed the model on: the config's example inputs, then its run_fn's first batches;
    else the first batches its eval_fn feeds the model. With them, those it built `engine`'s finalists from: the
    same, but for example inputs without run_fn where the engine calibrates static ranges, which are followed by
    eval_fn's first batches called alike (capture.with_fed_batches), as TrialRunner.calibration_batches."""
    eval_fn, example, run_fn = config.evaluation.build(), config.build_example_inputs(), config.build_run_fn()
    copy = clone(model)    # what eval_fn and run_fn are handed: a call may change it
    batches = example_or_batches(copy, eval_fn, example, torch.device(config.tuning.device), run_fn)
    if example is not None and run_fn is None and get_engine(engine).calibrates_on_batches:
        return batches, with_fed_batches(batches, eval_fn_batches(copy, eval_fn))
    return batches, batches


@main.command(name="apply")
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="the YAML config the model comes from")
@click.option("--out", required=True, type=click.Path(dir_okay=False), callback=lambda _c, _p, v: writable(v),
              help="where to save the tuned model; with no suffix, the engine's (.pt2 for compiled, else .pt); the "
                   "command says how to load it")
def apply_command(plan_path: str, config_path: str, out: str) -> None:
    """Re-apply a saved PLAN to the config's model; save it."""
    out = saved_model_path(out, read_plan(plan_path).engine)    # checked before the plan is built
    applied = apply_saved_plan(load_config(config_path), plan_path)
    try:
        out, loads_with = save_built(applied.built, applied.engine, applied.batches[0], out)
    except SaveError as exc:
        raise CliError(str(exc) + ("; or apply the plan in another engine (its `engine:`)"
                                   if applied.engine == "compiled" else "")) from None
    knobs = f" with {', '.join(applied.knobs)}" if applied.knobs else ""
    plan = summarize(applied.plan, held_dtype(applied.fp32))
    click.echo(f"wrote {out}: {type(applied.fp32).__name__} with {plan} in the {applied.engine} engine{knobs}; load it "
               f"with {loads_with}")


@dataclass(frozen=True)
class AppliedPlan:
    plan: Plan
    engine: str
    knobs: tuple[str, ...]
    latency_inputs: list[LatencyInput]    # as the plan file recorded them
    fp32: torch.nn.Module
    built: torch.nn.Module     # the plan in its engine, reference numerics (what `apply` saves)
    batches: list              # the config's example inputs, or the first batches its eval_fn feeds the model


def apply_saved_plan(config: FileConfig, plan_path: str) -> AppliedPlan:
    """The config's model with the plan file's plan realised in its recorded engine."""
    saved = read_plan(plan_path)
    plan, engine, knobs = saved.plan, saved.engine, saved.knobs
    model = uncompiled(config.build_model()).eval().to(torch.device(config.tuning.device))
    if saved.compile_in_place:   # its own methods call it (generate): compiled in place, as tuning did
        setattr(model, CALLS_ITSELF, True)
    try:
        validate_plan(plan, candidates := search_candidates(model, config.tuning))
    except PlanError as exc:
        raise CliError(f"{plan_path}: {exc}") from None
    if saved.module_shapes and (differing := shapes_differ(saved.module_shapes, model)):
        more = f"; {len(differing) - 3} more" if len(differing) > 3 else ""
        click.echo(f"note: {plan_path} was tuned on a model of other shapes ({'; '.join(differing[:3])}{more}): its "
                   "accuracy and speed were measured on that model, not this one (`autotune tune` this config to "
                   "know them)", err=True)
    if unnamed := [name for name in candidates if name not in plan]:    # a plan file edited by hand, say
        click.echo(f"note: {plan_path} names {len(plan)} of the {len(candidates)} modules tuning searches in this "
                   f"model; {listed(unnamed)} {'stays' if len(unnamed) == 1 else 'stay'} as the model holds "
                   f"{'it' if len(unnamed) == 1 else 'them'} ({held_dtype(model)})", err=True)
    for knob, reason in ((knob, KNOBS[knob].supports(model)) for knob in knobs):
        if reason is not None:   # e.g. a plan tuned on a GPU, applied to a model configured for the CPU
            raise CliError(f"{plan_path}: knob {knob} does not apply to this model: {reason}")
    batches, calibrating = tuning_batches(config, model, engine)
    if saved.compile_in_place:
        setattr(model, ENTRIES, entry_paths(batches))   # generate's encoder, compiled in place as tuning did
    lowered = [name for name, dtype in plan.items() if dtype != "fp32"]
    calibration = Calibration(calibrating, record_module_inputs(model, lowered, batches[0]))
    built = realise(with_knobs(model, knobs), plan, engine, calibration)
    if saved.compile_static:
        setattr(built, COMPILE_STATIC, True)
    return AppliedPlan(plan, engine, knobs, saved.latency_inputs, model, built, batches)


@main.command(name="list")
@storage_option
def list_command(storage: str) -> None:
    """Studies in a storage, with trial counts."""
    summaries = optuna.get_all_study_summaries(open_existing_storage(storage), include_best_trial=False)
    if not summaries:
        click.echo(f"no studies in {shown(storage)}")
        return
    rows = [["study", "trials", "baseline", "best accuracy", "speedup"]]
    unstarted = []   # a run stopped in its set-up (a config error, eval_fn failing on the fp32 model) left them
    for summary in summaries:
        best = summary.user_attrs.get(studies.ATTR_PREFIX + "best") or {}
        baseline = summary.user_attrs.get(studies.ATTR_PREFIX + studies.BASELINE_ATTR)
        rows.append([summary.study_name, str(summary.n_trials), formatted(baseline),
                     formatted(best.get("accuracy")), best_speedup(best) if best else "-"])
        if not summary.n_trials and baseline is None:
            unstarted.append(summary.study_name)
    click.echo(table(rows))
    if unstarted:
        click.echo(f"no trial and no baseline yet: {', '.join(unstarted)} (a run stopped in its set-up; the same "
                   "tune command resumes one, keeping any per-module signals measured, and `autotune delete "
                   "STUDY` removes one)")


@main.command()
@click.argument("study_name", metavar="STUDY")
@storage_option
@click.option("--out", required=True, type=click.Path(dir_okay=False), callback=lambda _c, _p, v: writable(v),
              help="the HTML file to write")
def report(study_name: str, storage: str, out: str) -> None:
    """HTML report of STUDY: chosen plan, accuracy vs latency, trials, history, finalists, per-module signals."""
    from autotune.report import html_report

    Path(out).write_text(html_report(load_study(study_name, storage)))
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
