"""The tuning service on a real PostgreSQL server: workers coming up together on an empty database, plan
claims shared by workers that share no file system state, and the job queue."""
from __future__ import annotations

import collections
import datetime
import multiprocessing
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import optuna
import pytest
import resume_workload
import worker_workload
import yaml
from conftest import refusing_connections
from optuna.storages import RDBStorage
from test_resume_kill import cli_env

from autotune.plan import plan_key
from autotune.search.trials import RUNNER_ATTR
from autotune.service.jobs import JobQueue
from autotune.storage.claims import PlanClaims
from autotune.storage.rdb import open_storage
from autotune.storage.study import evaluated_trials, trial_plan

WORKERS = 4


def _come_up(url: str, barrier) -> str:
    barrier.wait()
    try:
        import optuna
        storage = open_storage(url)
        JobQueue(storage)
        optuna.create_study(study_name="s", storage=storage, load_if_exists=True)
        PlanClaims(storage, "s").claim("plan", 0)
        return "ok"
    except BaseException:
        return traceback.format_exc()


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_workers_started_at_once_on_an_empty_database_all_come_up(database, request, tmp_path):
    url = f"sqlite:///{tmp_path}/new.db" if database == "sqlite" else request.getfixturevalue("postgres")
    context = multiprocessing.get_context("spawn")
    barrier = context.Manager().Barrier(WORKERS)
    with context.Pool(WORKERS) as pool:
        answers = pool.starmap(_come_up, [(url, barrier)] * WORKERS)
    assert answers == ["ok"] * WORKERS, "\n".join(a for a in answers if a != "ok")


MAX_TRIALS = 10


def tune_command(config: Path, storage: str) -> list[str]:
    return [sys.executable, "-m", "autotune", "tune", str(config), "--storage", storage]


def separate_machine_env(tmp_path: Path, index: int) -> dict[str, str]:
    """Another TMPDIR and home: what two machines would not share (no lock file could join them)."""
    home = tmp_path / f"machine{index}"
    (home / "tmp").mkdir(parents=True)
    return {**cli_env(), "TMPDIR": str(home / "tmp"), "HOME": str(home)}


def logged_calls(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


def test_two_workers_sharing_nothing_but_postgresql_evaluate_each_plan_once(tmp_path, postgres):
    log = tmp_path / "evals.log"
    config = resume_workload.write_config(
        tmp_path, "shared", {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log),
                                                                                "delay_s": 0.3}},
        max_trials=MAX_TRIALS, patience=100, repeats=3)
    procs = [subprocess.Popen(tune_command(config, postgres), cwd=tmp_path, env=separate_machine_env(tmp_path, i),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(outputs)
    assert not any("Traceback" in out for out in outputs)

    study = optuna.load_study(study_name="shared", storage=postgres)
    evaluated = evaluated_trials(study)
    keys = [plan_key(trial_plan(t)) for t in evaluated]
    assert len(keys) == len(set(keys)), "a plan was evaluated in two trials"
    assert MAX_TRIALS <= len(evaluated) < MAX_TRIALS + 2      # one budget for both
    lowered = collections.Counter(plan for _, plan in logged_calls(log) if "8" in plan)
    # each lowered plan once in a trial; each worker re-evaluates its winner once when it finishes
    assert sum(lowered.values()) <= len(evaluated) + 2 and len(lowered) == len(evaluated), lowered
    assert len({pid for pid, _ in logged_calls(log)}) == 2, "both workers evaluated plans"
    assert study.user_attrs["autotune.best"]["plan"] == resume_workload.expected_plan()


def trial_in_eval_fn(storage: str, name: str, pid: int, within_s: float = 0.2) -> int | None:
    """The number of a trial process `pid` runs and started under `within_s` ago: inside its eval_fn call (0.5 s in
    the kill test), so a kill now interrupts it (a worker between trials, or timing one, may end it before the
    kill lands). None where there is none."""
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return None
    now = datetime.datetime.now()
    return next((trial.number for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                 if f":{pid}:" in trial.user_attrs.get(RUNNER_ATTR, "") and trial.datetime_start
                 and (now - trial.datetime_start).total_seconds() < within_s), None)


def test_a_worker_killed_mid_trial_loses_nothing_and_repeats_nothing(tmp_path, postgres):
    log = tmp_path / "evals.log"
    config = resume_workload.write_config(
        tmp_path, "killed", {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log),
                                                                                "delay_s": 0.5}},
        max_trials=MAX_TRIALS, patience=100, repeats=3, heartbeat_interval=1, grace_period=3)
    procs = [subprocess.Popen(tune_command(config, postgres), cwd=tmp_path, env=separate_machine_env(tmp_path, i),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while len(logged_calls(log)) < 3 or trial_in_eval_fn(postgres, "killed", procs[0].pid) is None:   # some trials done
        assert time.monotonic() < deadline, "the first worker was never seen inside an eval_fn call"
        time.sleep(0.05)
    procs[0].send_signal(signal.SIGKILL)
    survivor = procs[1].communicate(timeout=600)[0]
    procs[0].wait()
    assert procs[1].returncode == 0 and "Traceback" not in survivor, survivor

    study = optuna.load_study(study_name="killed", storage=postgres)
    evaluated = evaluated_trials(study)
    keys = [plan_key(trial_plan(t)) for t in evaluated]
    assert len(keys) == len(set(keys)), "a plan was evaluated in two trials"
    assert len(evaluated) >= MAX_TRIALS
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING))
    interrupted = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL
                   and "fail_reason" not in t.user_attrs]
    assert interrupted, "the kill interrupted no trial"
    assert study.user_attrs["autotune.best"]["plan"] == resume_workload.expected_plan()


def write_job(tmp_path: Path, name: str, evaluation: dict, **tuning) -> Path:
    return resume_workload.write_config(tmp_path, name, evaluation, max_trials=4, patience=100, repeats=3,
                                        **tuning)


def queued_jobs(tmp_path: Path, monkeypatch, *names: str) -> tuple[str, RDBStorage, JobQueue, list[int]]:
    """A SQLite job queue holding a job per name (the resume workload, fidelity eval_fn), the first of highest
    priority: its URL, storage, queue and the jobs' ids."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    url = f"sqlite:///{tmp_path}/jobs.db"
    storage = open_storage(url)
    queue = JobQueue(storage)
    fidelity = {"eval_fn": "resume_workload:fidelity_eval"}
    ids = [queue.submit(write_job(tmp_path, name, fidelity).read_text(), str(tmp_path), f"{name}.yaml",
                        len(names) - index) for index, name in enumerate(names)]
    return url, storage, queue, ids


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, env=env or cli_env(),
                          capture_output=True, text=True, timeout=600)


def test_jobs_run_once_each_a_broken_one_fails_alone_and_a_cancelled_one_never_runs(tmp_path, postgres):
    log = tmp_path / "evals.log"
    logged = {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log), "delay_s": 0.2}}
    configs = [write_job(tmp_path, "good-a", logged),
               write_job(tmp_path, "broken", {"eval_fn": "worker_workload:broken_eval"}),
               write_job(tmp_path, "good-b", logged),
               write_job(tmp_path, "cancelled", logged)]
    env = {**cli_env(), "AUTOTUNE_STORAGE": postgres}
    ids = []
    for config in configs:
        submitted = run_cli("submit", str(config), cwd=tmp_path, env=env)
        assert submitted.returncode == 0, submitted.stderr
        ids.append(int(submitted.stdout.split()[1]))
    assert run_cli("cancel", str(ids[3]), cwd=tmp_path, env=env).returncode == 0
    allow = ["--allow", "resume_workload:*", "--allow", "worker_workload:*"]
    workers = [subprocess.Popen([sys.executable, "-m", "autotune", "worker", "--exit-when-idle", "--poll", "0.2",
                                 *allow], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [worker.communicate(timeout=600)[0] for worker in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    assert not any("Traceback" in out for out in outputs), "\n".join(outputs)

    jobs = {job.id: job for job in JobQueue(open_storage(postgres)).all()}
    assert [jobs[i].state for i in ids] == ["done", "failed", "done", "cancelled"]
    assert "the fp32 baseline evaluation failed" in jobs[ids[1]].reason and "dataset server" in jobs[ids[1]].reason
    sensitive = {resume_workload.module_name(block) for block in resume_workload.SENSITIVE}
    for job_id in (ids[0], ids[2]):
        study = optuna.load_study(study_name=jobs[job_id].study_name, storage=postgres)
        keys = [plan_key(trial_plan(t)) for t in evaluated_trials(study)]
        assert keys and len(keys) == len(set(keys)), "a plan of a job was evaluated twice"
        # two workers time plans on two cores at once, so which passing plan measured fastest is not asked here
        best = study.user_attrs["autotune.best"]["plan"]
        assert plan_key(best) in keys
        assert {name for name, dtype in best.items() if dtype == "fp32"} >= sensitive, best
    assert "cancelled" not in {jobs[i].study_name for i in ids if jobs[i].study_name}
    listed = run_cli("jobs", cwd=tmp_path, env=env).stdout
    assert all(state in listed for state in ("done", "failed", "cancelled")), listed


def test_a_job_naming_an_import_path_the_worker_does_not_allow_runs_nothing(tmp_path, postgres):
    marker = tmp_path / "ran"
    config = write_job(tmp_path, "system", {"eval_fn": "worker_workload:logged_eval"})
    data = yaml.safe_load(config.read_text())
    data["model"] = {"factory": "os:system", "kwargs": {"command": f"touch {marker}"}}
    config.write_text(yaml.safe_dump(data))
    env = {**cli_env(), "AUTOTUNE_STORAGE": postgres}
    assert run_cli("submit", str(config), cwd=tmp_path, env=env).returncode == 0
    worker = run_cli("worker", "--exit-when-idle", "--allow", "worker_workload:*", cwd=tmp_path, env=env)
    assert worker.returncode == 0 and "Traceback" not in worker.stderr, worker.stderr
    job = JobQueue(open_storage(postgres)).all()[0]
    assert job.state == "failed" and "model.factory: os:system" in job.reason and "not allowed" in job.reason
    assert not marker.exists()


def outage_config(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A config whose eval_fn logs its calls (the log's path, the config's), with a 3 s grace period."""
    log = tmp_path / "evals.log"
    evaluation = {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log), "delay_s": 0.3}}
    return log, resume_workload.write_config(tmp_path, name, evaluation, max_trials=MAX_TRIALS, patience=100,
                                             repeats=3, heartbeat_interval=1, grace_period=3)


def cut_off_mid_search(process: subprocess.Popen, log: Path, server: str, url: str) -> str:
    """Once the process has evaluated some plans, its database refuses every connection for 3 s; its output."""
    deadline = time.monotonic() + 120
    while len(logged_calls(log)) < 3:   # the baseline and some trials done
        assert time.monotonic() < deadline and process.poll() is None, "the process never got to its trials"
        time.sleep(0.05)
    with refusing_connections(server, url):
        time.sleep(3)
    return process.communicate(timeout=600)[0]


def assert_each_plan_once_to_the_expected_winner(url: str, name: str) -> None:
    study = optuna.load_study(study_name=name, storage=url)
    keys = [plan_key(trial_plan(t)) for t in evaluated_trials(study)]
    assert len(keys) == len(set(keys)) and len(keys) >= MAX_TRIALS
    assert study.user_attrs["autotune.best"]["plan"] == resume_workload.expected_plan()


def test_a_worker_waits_out_a_database_outage_and_its_job_ends_done(tmp_path, postgres_server, postgres):
    log, config = outage_config(tmp_path, "outage")
    env = {**cli_env(), "AUTOTUNE_STORAGE": postgres}
    assert run_cli("submit", str(config), cwd=tmp_path, env=env).returncode == 0
    worker = subprocess.Popen([sys.executable, "-m", "autotune", "worker", "--exit-when-idle", "--poll", "0.2",
                               "--allow", "resume_workload:*", "--allow", "worker_workload:*"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = cut_off_mid_search(worker, log, postgres_server, postgres)
    assert worker.returncode == 0 and "Traceback" not in output, output
    assert "the study storage is unreachable" in output and "answers again" in output, output
    job = JobQueue(open_storage(postgres)).all()[0]
    assert job.state == "done", job.reason
    assert_each_plan_once_to_the_expected_winner(postgres, "outage")


def test_a_tuning_run_that_loses_its_database_says_so_in_one_line_and_resumes(tmp_path, postgres_server, postgres):
    log, config = outage_config(tmp_path, "cut")
    run = subprocess.Popen(tune_command(config, postgres), cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    output = cut_off_mid_search(run, log, postgres_server, postgres)
    # A trial takes ~0.4 s, so the run queried the database within the 3 s it refused connections.
    assert run.returncode != 0 and "Traceback" not in output, output
    assert "Error: the study storage failed: connection failed" in output and "run the command again" in output
    resumed = subprocess.run(tune_command(config, postgres), cwd=tmp_path, env=cli_env(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0 and "resuming after" in resumed.stdout, resumed.stdout + resumed.stderr
    assert_each_plan_once_to_the_expected_winner(postgres, "cut")


def test_an_allow_pattern_matches_a_top_level_modules_path_read_with_a_dot():
    """`--allow "mypkg.*"` refused `mypkg:model`, the path of a module's own attribute."""
    from autotune.service.worker import JobRefused, check_allowed

    job = {"model": {"factory": "mypkg:model"}, "evaluation": {"eval_fn": "mypkg.scores:accuracy"}}
    check_allowed(job, ("mypkg.*",))
    with pytest.raises(JobRefused, match=r"refused: model.factory: mypkg:model not allowed"):
        check_allowed(job, ("mypkg.scores*",))
    with pytest.raises(JobRefused, match="os:system"):
        check_allowed({"model": {"factory": "os:system"}}, ("mypkg.*",))


def test_a_job_reads_its_variables_once_and_leaves_the_storage_field_to_the_worker(tmp_path, monkeypatch):
    """`storage: ...${DB_PW}...` failed the job on a worker without DB_PW, though the worker uses its own URL; and
    the job's variables were expanded twice, so `$$HOME` became the home folder rather than `$HOME`."""
    from autotune.service.worker import DEFAULT_ALLOW, job_config

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delenv("DB_PW", raising=False)
    path = write_job(tmp_path, "cost$$HOME", {"eval_fn": "resume_workload:fidelity_eval"})
    data = yaml.safe_load(path.read_text())
    data["tuning"]["storage"] = "postgresql+psycopg://tuner:${DB_PW}@db-host/studies"
    queue = JobQueue(open_storage(f"sqlite:///{tmp_path}/jobs.db"))
    job = queue.get(queue.submit(yaml.safe_dump(data), str(tmp_path), path.name))
    config = job_config(job, (*DEFAULT_ALLOW, "resume_workload*"))
    assert config.tuning.study_name == "cost$HOME"


def test_jobs_cuts_a_long_reason_and_gives_it_in_full_for_the_job_asked_about(tmp_path):
    """The table cut a failed job's reason mid-word, and nothing showed the rest; then every listing repeated every
    old failure's reason in full below the table."""
    from click.testing import CliRunner

    from autotune.cli import main
    from autotune.cli.service_commands import REASON_WIDTH
    url = f"sqlite:///{tmp_path}/jobs.db"
    queue = JobQueue(open_storage(url))
    long_reason = "eval_fn failed at the fp32 baseline:\n" + "the dataset server answered 503 " * 5
    assert len(long_reason) > REASON_WIDTH
    queue.end(queue.submit("model: {}", str(tmp_path), "long.yaml"), "failed", long_reason)
    queue.end(queue.submit("model: {}", str(tmp_path), "short.yaml"), "failed", "a short reason")
    listed = CliRunner().invoke(main, ["jobs", "--storage", url]).output
    one_line = " ".join(long_reason.split())
    assert one_line[:REASON_WIDTH - 1] + "…" in listed and long_reason not in listed and "a short reason" in listed
    assert "reasons cut short: `autotune jobs JOB` gives job 1's in full" in listed
    first = CliRunner().invoke(main, ["jobs", "1", "--storage", url])
    assert first.exit_code == 0 and first.output.endswith(f"reason:\n{long_reason}\n"), first.output
    assert "short.yaml" not in first.output and "live workers" not in first.output
    second = CliRunner().invoke(main, ["jobs", "2", "--storage", url]).output
    assert "a short reason" in second and "reason:\n" not in second
    missing = CliRunner().invoke(main, ["jobs", "3", "--storage", url])
    assert missing.exit_code != 0 and "Error: no job 3 in this storage; `autotune jobs` lists them" in missing.output


def test_the_trials_left_to_run_after_a_search_start_none_once_the_job_is_cancelled():
    """A queued trial ran 10 s after its job was cancelled: the cancel was asked only when nothing was queued."""
    from types import SimpleNamespace

    from autotune.search.trials import TrialRunner
    ran = []
    runner = SimpleNamespace(study=optuna.create_study(), config=SimpleNamespace(grace_period=30),
                             refresh=lambda: SimpleNamespace(waiting=1 - len(ran), running=0),
                             start_next=lambda queued_only: ran.append(1))
    TrialRunner.run_the_rest(runner, should_stop=lambda: "the job was cancelled")
    assert ran == []


def test_a_workers_log_lines_and_the_jobs_table_say_when_in_utc(tmp_path):
    """Worker lines had no time, so an outage's or a phase's length could not be read from them; the jobs table
    kept each submitter's local time without saying so."""
    import re
    env = {**cli_env(), "AUTOTUNE_STORAGE": f"sqlite:///{tmp_path}/jobs.db"}
    config = write_job(tmp_path, "refused", {"eval_fn": "worker_workload:logged_eval"})
    assert run_cli("submit", str(config), cwd=tmp_path, env=env).returncode == 0
    before = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None, second=0, microsecond=0)
    done = run_cli("worker", "--exit-when-idle", cwd=tmp_path, env=env)    # the default --allow refuses the job
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC worker \d+: job 1 failed: refused", done.stderr, re.M), \
        done.stderr
    listed = run_cli("jobs", cwd=tmp_path, env=env).stdout
    assert "submitted UTC" in listed
    submitted = datetime.datetime.strptime(re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", listed).group(), "%Y-%m-%d %H:%M")
    assert before - datetime.timedelta(minutes=2) <= submitted <= before + datetime.timedelta(minutes=2)


def test_a_worker_started_before_its_database_answers_waits_for_it_and_one_refused_for_good_exits(
        tmp_path, postgres_server, postgres):
    """A worker started while the server did not answer yet exited at once (exit 2), where a running one waits out
    the same outage: after a reboot, workers that came up before PostgreSQL were gone."""
    env = {**cli_env(), "AUTOTUNE_STORAGE": postgres}
    command = [sys.executable, "-m", "autotune", "worker", "--exit-when-idle", "--poll", "0.2"]
    with refusing_connections(postgres_server, postgres):
        worker = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        time.sleep(6.0)
        assert worker.poll() is None, worker.communicate()[0]
    output = worker.communicate(timeout=120)[0]
    assert worker.returncode == 0, output
    assert "not currently accepting connections" in output and "waiting for it" in output
    assert "worked on 0 jobs" in output and "Traceback" not in output

    missing = {**env, "AUTOTUNE_STORAGE": postgres.replace("/t_", "/no_such_", 1)}
    started = time.monotonic()
    refused = run_cli("worker", "--exit-when-idle", cwd=tmp_path, env=missing)
    assert refused.returncode == 2 and "does not exist" in refused.stderr, refused.stderr
    assert time.monotonic() - started < 30


def test_a_job_past_its_search_sends_other_workers_to_the_next_job_unless_its_finisher_died(tmp_path, monkeypatch):
    """Workers whose search had ended waited while one worker verified the winner, with other jobs queued; a job is
    now handed out again only when its finisher's lease has expired."""
    from autotune.service.jobs import FINISH_LEASE
    from autotune.service.worker import Worker
    from autotune.storage.claims import lease

    url, storage, queue, (first, second) = queued_jobs(tmp_path, monkeypatch, "first", "second")
    worker = Worker(storage, url, allow=("resume_workload:*",))
    with lease(storage, "first", FINISH_LEASE, ttl_s=60) as held:    # a finisher elsewhere, alive
        assert held
        assert worker.run(exit_when_idle=True) == 2
        assert [queue.get(first).state, queue.get(second).state] == ["finishing", "done"]
        assert queue.take() is None
    assert queue.take().id == first                      # its finisher gone: the job needs a worker again
    assert worker.run(exit_when_idle=True) == 1
    assert queue.get(first).state == "done"
    assert optuna.load_study(study_name="first", storage=url).user_attrs["autotune.best"]["plan"] == \
        resume_workload.expected_plan()


def test_a_worker_not_allowed_a_running_jobs_imports_leaves_it_to_the_workers_running_it(tmp_path, monkeypatch):
    """A default worker beside workers allowed `probe_*` took their running job (running jobs are shared) and
    failed it at once as refused: the worker running it searched on to max_trials and the job never got a winner.
    A queued job it may not run still fails with the reason, as no worker has run anything of it."""
    from autotune.service.worker import Worker

    url, storage, queue, (running, queued) = queued_jobs(tmp_path, monkeypatch, "running", "queued")
    assert queue.take().id == running                     # taken by a worker allowed its imports
    assert Worker(storage, url).run(exit_when_idle=True) == 2      # the default --allow: autotune.workloads.*
    assert queue.get(running).state == "running" and queue.get(running).reason is None
    assert queue.get(queued).state == "failed" and "evaluation.eval_fn: resume_workload:fidelity_eval" in \
        queue.get(queued).reason


def test_a_queued_job_another_live_worker_allows_is_left_queued_for_it_and_jobs_lists_the_workers(tmp_path,
                                                                                                   monkeypatch):
    """In a pool of workers allowed `mypkg.*` beside default ones, a default worker that took a queued mypkg job
    first failed it for good: the user had to submit it again, and again, until an allowed worker took it first."""
    from click.testing import CliRunner

    from autotune.cli import main
    from autotune.service.worker import Worker

    url, storage, queue, (job,) = queued_jobs(tmp_path, monkeypatch, "mine")
    with queue.serving(("resume_workload:*",)) as allowed:     # a worker allowed its imports, busy elsewhere
        assert Worker(storage, url).run(exit_when_idle=True) == 1    # the default --allow: autotune.workloads.*
        waiting = queue.get(job)
        assert waiting.state == "queued" and waiting.reason == (
            "refused: model.factory: resume_workload:model, evaluation.eval_fn: resume_workload:fidelity_eval, "
            "example_inputs.factory: resume_workload:example_inputs not allowed on this worker (--allow "
            f"autotune.workloads.*): left for workers that allow them ({allowed})")
        listed = CliRunner().invoke(main, ["jobs", "--storage", url]).output
        assert listed.endswith(f"live workers: 1\n  {allowed} (--allow resume_workload:*)\n"), listed
        assert re.search(rf"^{job}\s+queued\s+\d+ ", listed, re.M), listed
    assert queue.live_workers() == []     # it left the queue's workers as it stopped
    # The worker it was left for stopped: `jobs` says that none will take it, where it read plain `queued`.
    listed = CliRunner().invoke(main, ["jobs", "--storage", url]).output
    assert re.search(rf"^{job}\s+queued \(no live worker\)", listed, re.M), listed
    with queue.serving(("autotune.workloads.*",)):
        listed = CliRunner().invoke(main, ["jobs", "--storage", url]).output
        assert re.search(rf"^{job}\s+queued \(no live worker allows it\)", listed, re.M), listed
    assert Worker(storage, url).run(exit_when_idle=True) == 1
    assert queue.get(job).state == "failed" and queue.get(job).reason.endswith("; no live worker allows them")


def test_a_running_worker_fails_a_queued_job_it_left_once_no_live_worker_allows_it(tmp_path, monkeypatch):
    """A default worker left a mypkg job queued for the one worker allowed it; that worker stopped, and the job
    stayed queued for as long as the default worker ran: it never looked at a job it had left again."""
    from autotune.service.worker import Worker

    url, storage, queue, (job,) = queued_jobs(tmp_path, monkeypatch, "mine")
    worker = Worker(storage, url)                                 # the default --allow: autotune.workloads.*
    with queue.serving(("resume_workload:*",)):
        assert worker.run(exit_when_idle=True) == 1
        assert worker.run(exit_when_idle=True) == 0              # its allowed worker is live: still left to it
        assert queue.get(job).state == "queued"
    assert worker.run(exit_when_idle=True) == 1                  # the same worker, polling on
    assert queue.get(job).state == "failed" and queue.get(job).reason.endswith("; no live worker allows them")


def test_jobs_shows_the_live_workers_on_each_running_job_and_a_running_job_none_works_on(tmp_path, monkeypatch):
    """After Ctrl-C of its only worker a job stayed `running`, and nothing told it from one being worked on."""
    from click.testing import CliRunner

    from autotune.cli import main

    url, storage, queue, (job, _) = queued_jobs(tmp_path, monkeypatch, "first", "second")
    assert queue.take().id == job

    def state_of(listed: str) -> str:
        row = next(line for line in listed.splitlines() if line.split()[0] == str(job))
        return re.match(rf"{job}\s+(\S+( \(.*?\))?)", row).group(1)
    assert state_of(CliRunner().invoke(main, ["jobs", "--storage", url]).output) == "running (no live worker)"
    with queue.serving(("resume_workload:*",)) as worker:
        queue.working_on(worker, job)
        listed = CliRunner().invoke(main, ["jobs", "--storage", url]).output
        assert state_of(listed) == "running (1 worker)"
        assert listed.endswith(f"live workers: 1\n  {worker} (--allow resume_workload:*) on job {job}\n"), listed
        # A script reading a job's state by its id in the first column reads one line: the workers' lines start
        # otherwise (`make docker`'s smoke test read "done" and "live", and waited out its timeout).
        assert [line.split()[1] for line in listed.splitlines() if line.split()[:1] == [str(job)]] == ["running"]


@pytest.mark.parametrize("ended", ["cancelled", "done"])
def test_a_finisher_whose_job_ended_meanwhile_records_nothing_and_does_not_say_done(tmp_path, monkeypatch, caplog,
                                                                                 ended):
    """A job cancelled while its winner was verified was logged "done" and its best written anyway; a finisher paused
    past its lease, whose job another worker finished meanwhile, wrote its own best over that one's, so the job's
    reason named one plan and `show` / `export` another."""
    import logging

    from autotune.service import worker as workers

    url, storage, queue, (job,) = queued_jobs(tmp_path, monkeypatch, "ending")
    finish = workers.finish

    def ended_meanwhile(runner, started, **kwargs):    # as the winner is verified, elsewhere:
        if ended == "cancelled":
            queue.cancel(job)
        else:
            queue.end(job, "done", "speedup 1.13x, finished by another worker")
        return finish(runner, started, **kwargs)
    monkeypatch.setattr(workers, "finish", ended_meanwhile)
    with caplog.at_level(logging.INFO, logger="autotune"):
        assert workers.Worker(storage, url, allow=("resume_workload:*",)).run(exit_when_idle=True) == 1
    study = optuna.load_study(study_name="ending", storage=url)
    assert queue.get(job).state == ended and "autotune.best" not in study.user_attrs
    assert f"job {job} ended {ended} while this worker verified its winner" in caplog.text
    assert f"job {job} done" not in caplog.text
    assert ("autotune.cancelled" in study.user_attrs) == (ended == "cancelled")


def test_the_same_config_submitted_twice_is_noted_and_its_second_job_keeps_the_recorded_best(tmp_path, monkeypatch):
    """The second job of one study rebuilt and timed the recorded winner anew, and `jobs` showed the study's
    recorded speedup beside a second, different one in that job's reason."""
    from click.testing import CliRunner

    from autotune.cli import main
    from autotune.result import best_speedup
    from autotune.service.worker import Worker

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    url = f"sqlite:///{tmp_path}/jobs.db"
    config = str(write_job(tmp_path, "twice", {"eval_fn": "resume_workload:fidelity_eval"}))
    submit = ["submit", config, "--storage", url]
    # The config names a storage of its own, which a job does not use: said, where it was dropped without a word.
    assert CliRunner().invoke(main, submit).output == (
        f"job 1 queued\nnote: its tuning.storage (sqlite:///{tmp_path}/s.db) is not used: a job's study is kept where "
        f"the job is queued ({url}), whichever worker runs it\n")
    second = CliRunner().invoke(main, submit)
    assert second.exit_code == 0 and "job 2 queued" in second.output, second.output
    assert "note: job 1 (queued) tunes study twice too" in second.output

    storage = open_storage(url)
    assert Worker(storage, url, allow=("resume_workload:*",)).run(exit_when_idle=True) == 2
    queue = JobQueue(storage)
    best = optuna.load_study(study_name="twice", storage=url).user_attrs["autotune.best"]
    assert queue.get(1).state == queue.get(2).state == "done"
    assert queue.get(2).reason.startswith(f"study twice was already tuned by job 1: its recorded best is kept, "
                                          f"speedup {best_speedup(best)}, int8×3 fp32×2")
    third = CliRunner().invoke(main, submit)
    assert "job 1" not in third.output and "note: study twice was tuned already" in third.output, third.output


def test_a_queued_job_whose_yaml_cannot_be_read_does_not_stop_another_job_being_submitted(tmp_path, monkeypatch):
    """Submitting looks for other open jobs of the same study in their YAML: a job queued through the Python API
    with broken YAML made every later `submit` fail with that job's syntax error."""
    from click.testing import CliRunner

    from autotune.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    url = f"sqlite:///{tmp_path}/jobs.db"
    queue = JobQueue(open_storage(url))
    broken = queue.submit("tuning: [study_name: x", str(tmp_path), "broken.yaml")
    named = queue.submit(yaml.safe_dump({"tuning": {"study_name": "shared"}}), str(tmp_path), "named.yaml")
    config = str(write_job(tmp_path, "shared", {"eval_fn": "resume_workload:fidelity_eval"}))
    result = CliRunner().invoke(main, ["submit", config, "--storage", url])
    assert result.exit_code == 0, result.output
    assert f"note: job {named} (queued) tunes study shared too" in result.output
    assert f"job {broken}" not in result.output
    assert [job.id for job in queue.of_study("shared", ("queued",))] == [named, named + 1]


def test_a_worker_running_job_after_job_keeps_its_database_connections_to_what_it_holds(tmp_path, postgres):
    """Each job's storage kept its pooled connections after the job: 2 more on the server per job, until PostgreSQL
    refused a long-running worker's next connection ("too many clients")."""
    import sqlalchemy

    from autotune.service.worker import Worker

    storage = open_storage(postgres)
    queue = JobQueue(storage)
    counter = sqlalchemy.create_engine(postgres)

    def connections() -> int:
        with counter.connect() as connection:
            return connection.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()").scalar()
    counts = []
    for index in range(3):
        config = write_job(tmp_path, f"study{index}", {"eval_fn": "resume_workload:fidelity_eval"})
        queue.submit(config.read_text(), str(tmp_path), config.name)
        assert Worker(storage, postgres, allow=("resume_workload:*",)).run(exit_when_idle=True) == 1
        counts.append(connections())
    counter.dispose()
    assert [queue.get(job).state for job in (1, 2, 3)] == ["done"] * 3
    assert counts[2] == counts[0], counts


def test_tables_changed_by_hand_or_by_an_old_optuna_are_said_so_without_the_url_or_a_jobs_config(tmp_path, postgres):
    """A column dropped by hand read as an outage ("once it answers, run the command again"), a refused row was
    quoted with the job's config in it, and Optuna's schema-version error was an "unexpected" exit 1 whose hint
    put the URL, password and all, on a command line."""
    import sqlalchemy
    from click.testing import CliRunner

    from autotune.cli import main
    config = write_job(tmp_path, "secret", {"eval_fn": "worker_workload:logged_eval", "kwargs": {"key": "s3cr3t"}})
    runner = CliRunner()
    assert runner.invoke(main, ["jobs", "--storage", postgres]).exit_code == 0    # the tables, as autotune writes them
    optuna.create_study(study_name="s", storage=postgres)
    engine = sqlalchemy.create_engine(postgres)
    damage = {"ALTER TABLE autotune_jobs ADD COLUMN team text NOT NULL": ["submit", str(config)],
              "ALTER TABLE autotune_jobs DROP COLUMN priority": ["jobs"],
              "UPDATE alembic_version SET version_num = 'v3.0.0.d'": ["list"]}
    outputs = []
    for statement, command in damage.items():
        with engine.begin() as connection:
            connection.exec_driver_sql(statement)
        result = runner.invoke(main, [*command, "--storage", postgres])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "once it answers" not in result.output and "s3cr3t" not in result.output, result.output
        outputs.append(result.output)
    assert "refused a statement" in outputs[0] and "team" in outputs[0] and "no longer match" in outputs[0]
    assert "refused a statement" in outputs[1] and "priority" in outputs[1] and "LINE 1" not in outputs[1]
    password = sqlalchemy.engine.make_url(postgres).password
    assert "os.environ['AUTOTUNE_STORAGE']" in outputs[2] and "upgrade()" in outputs[2], outputs[2]
    assert not password or password not in outputs[2]
    command = outputs[2].split("execute python -c ")[1].split(" (with AUTOTUNE_STORAGE")[0].strip('"')
    upgraded = subprocess.run([sys.executable, "-c", command], env={**cli_env(), "AUTOTUNE_STORAGE": postgres},
                              capture_output=True, text=True, timeout=120)
    assert upgraded.returncode == 0, upgraded.stderr
    assert runner.invoke(main, ["list", "--storage", postgres]).exit_code == 0     # the hint did what it said


def test_a_score_finished_while_the_database_was_away_is_kept_not_evaluated_again(tmp_path, postgres_server, postgres):
    """A blip of a few seconds threw away the trial whose eval_fn was running: its score, finished while the server
    came back, was never written, and its plan was evaluated again once the heartbeat check failed it."""
    log = tmp_path / "evals.log"
    config = resume_workload.write_config(
        tmp_path, "blip", {"eval_fn": "worker_workload:logged_eval", "kwargs": {"log_path": str(log), "delay_s": 2.0}},
        max_trials=4, patience=100, repeats=3, heartbeat_interval=1, grace_period=10)
    env = {**cli_env(), "AUTOTUNE_STORAGE": postgres}
    assert run_cli("submit", str(config), cwd=tmp_path, env=env).returncode == 0
    worker = subprocess.Popen([sys.executable, "-m", "autotune", "worker", "--exit-when-idle", "--poll", "0.2",
                               "--allow", "resume_workload:*", "--allow", "worker_workload:*"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while (cut := trial_in_eval_fn(postgres, "blip", worker.pid, within_s=0.8)) is None:
        assert time.monotonic() < deadline and worker.poll() is None, "the worker was never seen in an eval_fn call"
        time.sleep(0.05)
    with refusing_connections(postgres_server, postgres):
        time.sleep(4)        # the eval_fn call ends in the outage
    output = worker.communicate(timeout=600)[0]
    assert worker.returncode == 0 and "Traceback" not in output, output
    assert "the study storage is unreachable" in output and "answers again" in output, output
    study = optuna.load_study(study_name="blip", storage=postgres)
    assert study.trials[cut].state == optuna.trial.TrialState.COMPLETE, output
    assert not [t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL], output
    evaluated = [plan for _, plan in logged_calls(log)]
    winner = worker_workload.plan_code(resume_workload.expected_plan())
    repeated = {plan for plan in evaluated if evaluated.count(plan) > (2 if plan == winner else 1)}
    assert not repeated, evaluated
