"""A worker: takes jobs from the queue and runs them, with the tuner's own trials, claims and heartbeats.

Several workers (on one machine or many) share a running job's study and budget. The first worker whose search
ends takes the study's "finish" lease and marks the job finishing: it waits for the job's trials still running
elsewhere, verifies the winner and marks the job done, while the other workers go on to other jobs (a finishing
job is handed out again only if its finisher dies). A job that cannot run (malformed YAML, a missing data file, an
import path its worker does not allow, an eval_fn that fails at the baseline) fails alone with its reason.
A database that stops answering (a server restart, a failover, a network cut) fails no job: a running trial's
reads and writes wait for it, so a score its eval_fn finished meanwhile is kept; elsewhere the worker waits for
it and takes its job up again where the study stands (a trial that the other workers' stale-trial check failed
meanwhile is lost, and its plan queued again).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from autotune.config import TuningConfig
from autotune.config.file import FileConfig, expand_env_everywhere, parse_config, read_yaml, without_storage
from autotune.errors import AutotuneError
from autotune.plan import summarize
from autotune.result import best_speedup
from autotune.search.trials import TrialRunner, fail_stale_trials
from autotune.service.jobs import (
    CANCELLED,
    DONE,
    FAILED,
    FINISH_LEASE,
    FINISHING,
    QUEUED,
    RUNNING,
    Job,
    JobQueue,
    LiveWorker,
)
from autotune.storage import study as studies
from autotune.storage.claims import lease
from autotune.storage.rdb import lost_connection, open_storage, wait_until_reachable
from autotune.tuner import finish, search, start_runner

log = logging.getLogger("autotune")
DEFAULT_ALLOW = ("autotune.workloads.*",)
IMPORT_FIELDS = (("model", "factory"), ("evaluation", "eval_fn"), ("example_inputs", "factory"),
                 ("calibration", "run_fn"))


class JobRefused(AutotuneError):
    """A job names an import path this worker does not allow; nothing of it was run. `named`: every (field, import
    path) it names."""

    def __init__(self, message: str, named: list[tuple[str, str]]):
        super().__init__(message)
        self.named = named


def import_paths(data: dict) -> list[tuple[str, str]]:
    """(field, import path) of every callable a config's raw mapping names."""
    found = []
    for section, key in IMPORT_FIELDS:
        value = data.get(section)
        if isinstance(value, dict) and isinstance(value.get(key), str):
            found.append((f"{section}.{key}", value[key]))
    tuning = data.get("tuning")
    shapes = tuning.get("latency_inputs") if isinstance(tuning, dict) else None
    for index, shape in enumerate(shapes if isinstance(shapes, list) else [shapes]):
        if isinstance(shape, dict) and isinstance(shape.get("factory"), str):
            found.append((f"tuning.latency_inputs.{index}.factory", shape["factory"]))
    return found


def refused_paths(named: list[tuple[str, str]], allow: tuple[str, ...]) -> list[str]:
    """"field: path" for each (field, import path) no `allow` pattern matches, as written or dotted ("mypkg.*"
    allows "mypkg:model" too, as a user reads it)."""
    return [f"{field}: {path}" for field, path in named
            if not any(fnmatchcase(name, pattern) for pattern in allow for name in (path, path.replace(":", ".")))]


def allowing(named: list[tuple[str, str]], workers: list[LiveWorker]) -> list[LiveWorker]:
    """The `workers` whose --allow patterns match every (field, import path) `named`."""
    return [worker for worker in workers if not refused_paths(named, worker.allow)]


def check_allowed(data: dict, allow: tuple[str, ...]) -> None:
    """Raises JobRefused naming each import path of the config's raw mapping that `allow` does not; runs none."""
    named = import_paths(data)
    if refused := refused_paths(named, allow):
        raise JobRefused(f"refused: {', '.join(refused)} not allowed on this worker (--allow {' '.join(allow)})",
                         named)


def job_config(job: Job, allow: tuple[str, ...]) -> FileConfig:
    """The job's config, validated on this worker once its import paths are known to be allowed (validating a
    config imports the modules it names)."""
    source = f"job {job.id} ({job.config_name})"
    data = without_storage(read_yaml(job.config_yaml, source))
    check_allowed(expand_env_everywhere(data), allow)
    return parse_config(data, Path(job.config_dir), source)    # expands the variables once ($$ stays a $)


class Worker:
    def __init__(self, storage: RDBStorage, storage_url: str, allow: tuple[str, ...] = DEFAULT_ALLOW):
        self.storage, self.storage_url, self.allow = storage, storage_url, allow
        self.queue = JobQueue(storage)
        # jobs other workers run, or may run, that this one may not, with the import paths they name: left to them
        self.leaving: dict[int, list[tuple[str, str]]] = {}
        self.id: str | None = None       # among the queue's live workers, while it runs

    def run(self, exit_when_idle: bool = False, poll_s: float = 2.0) -> int:
        """Runs jobs until none is open (with `exit_when_idle`) or forever; returns how many it worked on."""
        with self.queue.serving(self.allow) as self.id:
            return self._take_jobs(exit_when_idle, poll_s)

    def _take_jobs(self, exit_when_idle: bool, poll_s: float) -> int:
        worked: set[int] = set()
        while True:
            try:
                self._take_back_orphans()
                job = self.queue.take(self.leaving)
            except Exception as exc:
                self._wait_if_lost(exc)
                continue
            if job is None:
                if exit_when_idle:
                    return len(worked)
                time.sleep(poll_s)
                continue
            worked.add(job.id)
            self.queue.working_on(self.id, job.id)
            try:
                self.run_job(job)
            finally:
                self.queue.working_on(self.id, None)

    def run_job(self, job: Job) -> None:
        """Runs `job` to its end or fails it with its reason; where the database stopped answering, waits for it
        instead (the job is still running: the next `take` may hand it back)."""
        started = time.monotonic()
        storage = None
        try:
            config = job_config(job, self.allow)
            tuning = config.tuning.model_copy(update={"storage": self.storage_url})
            storage = open_storage(self.storage_url, tuning.heartbeat_interval, tuning.grace_period,
                                   waits_out_outages=True)
            self._run(job, config, tuning, storage, started)
        except JobRefused as exc:
            self._refused(job, exc)
        except Exception as exc:   # the user's code (factories, eval_fn) may raise anything: the job fails alone
            if lost_connection(exc, self.storage.engine):
                wait_until_reachable(self.storage.engine, exc)
            else:
                self._fail(job, str(exc) if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {exc}")
        finally:
            if storage is not None:   # its connections: left to the collector, they piled up job after job
                storage.engine.dispose()

    def _refused(self, job: Job, refused: JobRefused) -> None:
        """A job queued that no live worker allows fails with the paths it named; one that another live worker
        allows is left queued for it (a pool of workers with `--allow "mypkg.*"` beside default ones), and one a
        worker runs already is left to it: failing it would end that worker's work too."""
        if job.found == QUEUED:
            others = [worker for worker in self.queue.live_workers() if worker.id != self.id]
            if not (allowed_by := [worker.id for worker in allowing(refused.named, others)]):
                self._fail(job, f"{refused}; no live worker allows them")
                return
            self.queue.requeue(job.id, f"{refused}: left for workers that allow them ({', '.join(allowed_by)})")
        self.leaving[job.id] = refused.named
        log.info("job %d: %s; left to workers that allow them", job.id, refused)

    def _take_back_orphans(self) -> None:
        """Takes back a queued job this worker left for others that allow its imports once none of them is live any
        more, so that it fails with its reason (as a job no live worker allows does when taken): it stayed queued
        for workers that had stopped, for as long as this one ran. Forgets the jobs left that have ended: `take`
        hands out none of them, and each was read again at every poll."""
        if not self.leaving:
            return
        others = [worker for worker in self.queue.live_workers() if worker.id != self.id]
        for job_id, named in list(self.leaving.items()):
            if not allowing(named, others) and self.queue.get(job_id).state not in (RUNNING, FINISHING):
                del self.leaving[job_id]

    def _run(self, job: Job, config: FileConfig, tuning: TuningConfig, storage: RDBStorage, started: float) -> None:
        runner = start_runner(config.build_model(), tuning, config.evaluation.build(),
                              config.build_example_inputs(), run_fn=config.build_run_fn(), storage=storage)
        self.queue.set_study(job.id, runner.study.study_name)
        search(runner, started, should_stop=self._cancelled(job.id))   # it logs why it stopped
        state = self.queue.get(job.id).state
        if state in (RUNNING, FINISHING):
            if (best := studies.standing_best(runner.study, tuning)) is not None:
                self._already_tuned(job, runner.study, best)
            else:
                self._finish(job, runner, started)
        elif state == CANCELLED:
            _mark_cancelled(job, runner.study)

    def _wait_if_lost(self, exc: Exception) -> None:
        """Returns once the database answers again where `exc` came of losing it; else raises `exc`."""
        if not lost_connection(exc, self.storage.engine):
            raise exc
        wait_until_reachable(self.storage.engine, exc)

    def _cancelled(self, job_id: int) -> Callable[[], str | None]:
        def check() -> str | None:
            return "the job was cancelled" if self.queue.get(job_id).state == CANCELLED else None
        return check

    def _finish(self, job: Job, runner: TrialRunner, started: float) -> None:
        """The first worker here verifies the winner once no trial of the study runs elsewhere; the others go on."""
        self.queue.finishing(job.id)
        name = runner.study.study_name
        with lease(self.storage, name, FINISH_LEASE, ttl_s=runner.config.grace_period, wait=False) as held:
            if not held:
                log.info("job %d: another worker finishes it; going on", job.id)
                return
            while runner.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                time.sleep(1.0)
                fail_stale_trials(runner.study, runner.config.grace_period)
            if self.queue.get(job.id).state != FINISHING:
                return                 # cancelled, or finished by another worker meanwhile
            runner.refresh()
            # Another worker finishes it where this one's lease lapsed (a paused process), or it is cancelled:
            # its verified winner is then not recorded over theirs, and the job not said done.
            result = finish(runner, started, still_ours=lambda: self.queue.get(job.id).state == FINISHING)
            if self.queue.end(job.id, DONE, f"speedup {result.speedup:.2f}x, {summarize(result.plan, result.held)}, "
                                            f"{result.trials_evaluated} evaluated trials"
                                            + (f", {result.failed}" if result.failed else "")):
                log.info("job %d done: speedup %.2fx", job.id, result.speedup)
                return
            state = self.queue.get(job.id).state
            log.warning("job %d ended %s while this worker verified its winner: that result is dropped", job.id,
                        state)
            if state == CANCELLED:
                _mark_cancelled(job, runner.study)

    def _already_tuned(self, job: Job, study: optuna.Study, best: dict) -> None:
        """Ends a job whose study had its answer recorded before this job searched (the same config submitted
        again) with that answer: building and timing it anew gave the job a second, different speedup."""
        study_name = study.study_name
        earlier = [other.id for other in self.queue.of_study(study_name, (DONE,)) if other.id != job.id]
        by = f" by job {earlier[-1]}" if earlier else ""
        plan = summarize(best["plan"], studies.kept_dtype(study))
        if self.queue.end(job.id, DONE, f"study {study_name} was already tuned{by}: its recorded best is kept, "
                                        f"speedup {best_speedup(best)}, {plan}; {studies.SEARCHES_ON}"):
            log.info("job %d: study %s was already tuned%s; its recorded best is kept", job.id, study_name, by)

    def _fail(self, job: Job, reason: str) -> None:
        if self.queue.end(job.id, FAILED, reason):
            log.warning("job %d failed: %s", job.id, reason)


def _mark_cancelled(job: Job, study: optuna.Study) -> None:
    """Tells show, export and report the study's tuning was cancelled, not that it has not finished yet."""
    studies.set_attr(study, studies.CANCELLED_ATTR, f"job {job.id} tuning it was cancelled")
