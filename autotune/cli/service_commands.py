"""The service commands: submit jobs to the study database, run workers on them, list and cancel them."""
from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import click
import optuna

from autotune.cli.base import main, missing_sqlite, open_existing_storage, storage_option
from autotune.config.file import check_without_imports, read_yaml
from autotune.errors import ConfigError
from autotune.result import best_speedup, counted, table
from autotune.service.jobs import FINISHING, OPEN, QUEUED, RUNNING, Job, JobQueue, LiveWorker
from autotune.service.worker import DEFAULT_ALLOW, Worker, allowing, import_paths
from autotune.storage import study as studies
from autotune.storage.rdb import open_storage, open_storage_once_up, shown


@main.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(exists=True, dir_okay=False))
@storage_option
@click.option("--priority", type=int, default=0, show_default=True, help="higher runs first")
def submit(config_path: str, storage: str, priority: int) -> None:
    """Queue a tuning job: the YAML CONFIG, run by `autotune worker` processes on the same storage."""
    path = Path(config_path)
    text = path.read_text()
    # A syntax error, an unknown section or a bad tuning field is reported here, not by a worker later.
    data = read_yaml(text, str(path))
    check_without_imports(data, str(path))
    opened = open_storage(storage)
    queue = JobQueue(opened)
    tuning = data.get("tuning") if isinstance(data.get("tuning"), dict) else {}
    notes = _earlier_work(opened, queue, str(tuning["study_name"])) if tuning.get("study_name") else []
    if tuning.get("storage") not in (None, storage):
        notes.append(f"its tuning.storage ({shown(str(tuning['storage']))}) is not used: a job's study is kept where "
                     f"the job is queued ({shown(storage)}), whichever worker runs it")
    job_id = queue.submit(text, str(path.resolve().parent), path.name, priority)
    click.echo(f"job {job_id} queued")
    for note in notes:
        click.echo(f"note: {note}", err=True)


def _earlier_work(storage, queue: JobQueue, study_name: str) -> list[str]:
    """What a job naming `study_name` meets: the study tuned already, or other open jobs tuning it."""
    notes = [f"job {job.id} ({job.state}) tunes study {study_name} too: the two share its trials and budget"
             for job in queue.of_study(study_name, OPEN)]
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return notes
    if (best := studies.get_attr(study, "best")) is not None:
        notes.append(f"study {study_name} was tuned already ({len(studies.evaluated_trials(study))} evaluated "
                     f"trials, best {best_speedup(best)}): this job keeps its recorded best unless its max_trials is "
                     f"larger or its engines or knobs differ")
    return notes


@main.command()
@storage_option
@click.option("--allow", "allow", multiple=True, default=DEFAULT_ALLOW, show_default=True,
              help="fnmatch pattern of the import paths a job may name (repeatable); others are refused")
@click.option("--exit-when-idle", is_flag=True, help="stop once no job is queued or running")
@click.option("--poll", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="seconds between looks at an empty queue")
def worker(storage: str, allow: tuple[str, ...], exit_when_idle: bool, poll: float) -> None:
    """Run queued jobs (several workers share a job's study and budget)."""
    logger = logging.getLogger("autotune")
    if not logger.handlers:
        handler = logging.StreamHandler()
        # A long-running process: its log says when (an outage's length, a phase's), in UTC like the jobs table.
        formatter = logging.Formatter(f"%(asctime)s worker {os.getpid()}: %(message)s", "%Y-%m-%d %H:%M:%S UTC")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    worked = Worker(open_storage_once_up(storage), storage, tuple(allow)).run(exit_when_idle, poll)
    click.echo(f"worker {os.getpid()}: worked on {counted(worked, 'job')}; no job is open")


def _progress(storage, study_name: str | None) -> tuple[str, str]:
    """(evaluated trials, best speedup so far) of a job's study."""
    if study_name is None:
        return "-", "-"
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return "-", "-"
    best = studies.get_attr(study, "best")
    if best is not None:
        return str(len(studies.evaluated_trials(study))), best_speedup(best)
    passing = studies.passing_trials(study)
    ratio = passing[0].values[0] if passing else math.inf
    return str(len(studies.evaluated_trials(study))), f"{1 / ratio:.2f}x (in trial)" if passing else "-"


REASON_WIDTH = 100   # a job's reason in the table; `jobs JOB` gives a longer one in full


@main.command()
@click.argument("job_id", metavar="[JOB]", type=int, required=False)
@storage_option
def jobs(job_id: int | None, storage: str) -> None:
    """Jobs with their state, trials done and best speedup so far; with JOB, that one with its reason in full."""
    if missing_sqlite(storage):    # nothing submitted there yet: an empty queue, not an error
        click.echo(f"no jobs in {shown(storage)}")
        return
    rdb = open_existing_storage(storage)
    rows = [["job", "state", "priority", "config", "submitted UTC", "by", "study", "trials", "best", "reason"]]
    queue = JobQueue(rdb)
    live = queue.live_workers()
    listed = [queue.get(job_id)] if job_id is not None else queue.all()
    cut = []     # jobs whose reason is too long for the table
    for job in listed:
        trials, best = _progress(rdb, job.study_name)
        reason = " ".join((job.reason or "").split())    # one line in the table (a config error's has several)
        if len(reason) > REASON_WIDTH:
            cut.append(str(job.id))
            reason = reason[:REASON_WIDTH - 1] + "…"
        rows.append([str(job.id), _state(job, live), str(job.priority), job.config_name,
                     job.submitted_at.strftime("%Y-%m-%d %H:%M"), job.submitted_by, job.study_name or "-",
                     trials, best, reason])
    if len(rows) == 1:
        click.echo(f"no jobs in {shown(storage)}")
    elif job_id is not None:
        click.echo(table(rows) + (f"\nreason:\n{listed[0].reason}" if cut else ""))
        return
    else:
        click.echo(table(rows))
        if cut:    # in full, each would be repeated at every listing for as long as its job is kept
            click.echo(f"reasons cut short: `autotune jobs JOB` gives job {', '.join(cut)}'s in full")
    click.echo(f"live workers: {len(live)}" + "".join(
        f"\n  {worker.id} (--allow {' '.join(worker.allow)})" + (f" on job {worker.job_id}" if worker.job_id else "")
        for worker in live))


def _state(job: Job, live: list[LiveWorker]) -> str:
    """A job's state, with the live workers it waits for: a running job whose workers were all stopped (Ctrl-C,
    killed) stays running until a worker takes it up again, and read as if it were being worked on; a queued job
    that no live worker may run (the one it was left for stopped) read as if one would take it next."""
    if job.state == QUEUED:
        return f"{job.state} ({waits_for})" if (waits_for := _waits_for(job, live)) else job.state
    if job.state not in (RUNNING, FINISHING):
        return job.state
    on_it = sum(worker.job_id == job.id for worker in live)
    return f"{job.state} ({counted(on_it, 'worker')})" if on_it else f"{job.state} (no live worker)"


def _waits_for(job: Job, live: list[LiveWorker]) -> str | None:
    """Why no live worker will take a queued job, or None where one may."""
    if not live:
        return "no live worker"
    try:
        named = import_paths(read_yaml(job.config_yaml, f"job {job.id}"))
    except ConfigError:
        return None      # a worker fails it with its reason
    return None if allowing(named, live) else "no live worker allows it"


@main.command()
@click.argument("job_id", metavar="JOB", type=int)
@storage_option
def cancel(job_id: int, storage: str) -> None:
    """Cancel a queued or running JOB (workers on it stop after their current trial)."""
    JobQueue(open_existing_storage(storage)).cancel(job_id)
    click.echo(f"job {job_id} cancelled")
