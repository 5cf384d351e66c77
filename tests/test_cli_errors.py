"""Every failure a user can cause ends in one `Error: ...` line with a documented exit code (2 for bad input,
130 for Ctrl-C), never a traceback unless --debug; outputs are checked before any work starts."""
from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import torch
import yaml
from click.testing import CliRunner
from test_cli import SHIPPED, small_mnist, write_yaml
from test_resume_kill import study_exists

from autotune.cli import main
from autotune.interrupts import CLEAN_UP_S

UNREACHABLE_PG = "postgresql+psycopg://autotune@127.0.0.1:1/studies"     # port 1: nothing listens there


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def assert_one_error_line(result, code: int, *fragments: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def test_a_full_disk_is_said_so_with_what_to_do_not_as_an_outage_to_wait_out():
    """SQLite on a full tmpfs: "the study storage failed: database or disk is full; once it answers, run the command
    again", as if the database would answer by itself."""
    import sqlite3

    import sqlalchemy

    from autotune.storage.rdb import cannot_write
    for said in ("database or disk is full", "could not extend file: No space left on device"):
        error = sqlalchemy.exc.OperationalError("INSERT INTO trials ...", {}, sqlite3.OperationalError(said))
        assert cannot_write(error).startswith("free space on its disk, then run the command again")
    other = sqlalchemy.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked"))
    assert cannot_write(other) is None


@pytest.mark.parametrize("wal", [True, False])
def test_a_study_folder_that_cannot_be_written_is_said_to_be_read_only(tmp_path, wal):
    """SQLite writes beside the file to read it: on a read-only share `list` said only "unable to open database
    file" (autotune's WAL database, its last writer killed, copied without its -shm file), or called "attempt to
    write a readonly database" an outage to wait out (a database Optuna made)."""
    studies = tmp_path / "studies"
    studies.mkdir()
    url = f"sqlite:///{studies}/a.db"
    opened = "autotune.storage.rdb.open_storage(url)" if wal else "url"
    subprocess.run([sys.executable, "-c", f"import os, optuna, autotune.storage.rdb; url = {url!r}; "
                    f"optuna.create_study(study_name='kept', storage={opened}); os._exit(0)"], check=True, timeout=120)
    (studies / "a.db-shm").unlink(missing_ok=True)
    command = [sys.executable, "-m", "autotune", "list", "--storage", f"sqlite:///{studies}/a.db"]
    if os.geteuid() != 0:
        studies.chmod(0o555)
        listed = subprocess.run(command, capture_output=True, text=True, timeout=120)
        studies.chmod(0o755)
    else:   # root writes where the mode says not: a read-only mount, as a share would be
        mounted = f"mount --bind -o ro {studies} {studies} && exec \"$@\""
        listed = subprocess.run(["unshare", "-m", "sh", "-c", mounted, "sh", *command], capture_output=True,
                                text=True, timeout=120)
        if "mount:" in listed.stderr or "unshare:" in listed.stderr:
            pytest.skip(f"no read-only mount can be made here: {listed.stderr.strip()}")
    assert listed.returncode == 2 and "Traceback" not in listed.stderr, listed.stderr
    said = f"{studies} cannot be written here (read-only)" if wal else "the study storage cannot be written"
    assert said in listed.stderr and "SQLite writes beside the file even to read it" in listed.stderr, listed.stderr


def test_a_storage_url_that_does_not_parse(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    assert_one_error_line(run("tune", str(config), "--storage", "sqlite:/nope"), 2,
                          "cannot parse the storage URL 'sqlite:/nope'")
    assert_one_error_line(run("list", "--storage", "sqlite:/nope"), 2, "cannot parse the storage URL")
    # A port that is no number escaped as "unexpected ValueError", exit 1, and the password went unmasked.
    port = run("list", "--storage", "postgresql+psycopg://tuner:secret@127.0.0.1:1:2/studies")
    assert_one_error_line(port, 2, "cannot parse the storage URL 'postgresql+psycopg://tuner:***@127.0.0.1:1:2/studies'")
    assert "secret" not in port.output


@pytest.mark.parametrize(("password", "host"), [("p@ss/w:rd#1", "127.0.0.1:1"), ("hunter@2secret", "127.0.0.1:5432")])
def test_a_password_with_a_raw_at_sign_is_masked_whole_and_said_to_need_encoding(tmp_path, password, host):
    """The part after the password's '@' was read as the host and printed ('***@ss/w%3Ard...'), with no hint; or
    the driver's own error named it ("failed to resolve host '2secret@127.0.0.1'"), and a worker logged that every
    10 s, waiting for a server that would never answer such a URL."""
    url = f"postgresql+psycopg://team2:{password}@{host}/studies"
    for command in (["list", "--storage", url], ["worker", "--exit-when-idle"]):
        (tmp_path / "url").write_text(url)
        result = run(*command, env={**os.environ, "AUTOTUNE_STORAGE_FILE": str(tmp_path / "url")})
        assert_one_error_line(result, 2, f"postgresql+psycopg://team2:***@{host}/studies",
                              "must be percent-encoded (@ as %40")
        assert password.split("@", 1)[1] not in result.output, result.output


@pytest.mark.parametrize("command", [["list"], ["show", "mnist"], ["cancel", "1"]])
def test_a_storage_nothing_was_tuned_in_yet_says_what_makes_it_and_an_empty_queue_is_no_error(tmp_path, command):
    url = f"sqlite:///{tmp_path}/none.db"
    assert_one_error_line(run(*command, "--storage", url), 2, f"no study storage at {url}: nothing was tuned or "
                          "submitted there yet (`autotune tune CONFIG` or `autotune submit CONFIG` makes it)")
    listed = run("jobs", "--storage", url)
    assert listed.exit_code == 0 and listed.output.strip() == f"no jobs in {url}"
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_an_in_memory_sqlite_storage_is_refused_as_keeping_nothing(tmp_path, url):
    # It was reported as a database briefly down ("no such table: studies; once it answers, run the command again").
    config = write_yaml(tmp_path / "c.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    assert_one_error_line(run("tune", str(config), "--storage", url), 2,
                          "is an in-memory SQLite database, which keeps no study")


def test_tune_on_a_device_this_torch_lacks_says_so_before_opening_any_study(tmp_path):
    """device: mps printed "study ...: new", then "Error: unexpected RuntimeError: PyTorch is not linked with support
    for mps devices", exit 1."""
    if torch.backends.mps.is_available():
        pytest.skip("this torch runs on mps")
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["tuning"]["device"] = "mps"
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)))
    assert_one_error_line(result, 2, "Error: device 'mps' cannot be used here: this torch has no mps device here")
    assert "study" not in result.output and not (tmp_path / "s.db").exists()


def test_tune_worker_a_typo_of_workers_is_refused_with_the_option_it_meant(tmp_path):
    """`tune c.yaml --worker` ran a hidden helper mode: it printed "worker 21799: 7 eval_fn calls", exit 0, and no
    summary, no winner recorded."""
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)), "--worker")
    assert_one_error_line(result, 2, "No such option '--worker'. Did you mean '--workers'?")
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("command", [["list"], ["jobs"], ["tune", "CONFIG"]])
def test_an_sqlite_storage_naming_a_folder_says_to_name_a_file_in_it(tmp_path, command):
    """It read "no study storage at ...: nothing was tuned or submitted there yet", or "no jobs in" it."""
    config = write_yaml(tmp_path / "c.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    args = [str(config) if arg == "CONFIG" else arg for arg in command]
    assert_one_error_line(run(*args, "--storage", f"sqlite:///{tmp_path}"), 2,
                          f"names a folder, not a database file: name a file in it, e.g. "
                          f"sqlite:///{tmp_path}/autotune.db")


@pytest.mark.parametrize("command", [["list"], ["show", "mnist"], ["tune", "CONFIG"]])
def test_an_unreachable_postgresql_server(tmp_path, command):
    config = write_yaml(tmp_path / "c.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    args = [str(config) if arg == "CONFIG" else arg for arg in command]
    assert_one_error_line(run(*args, "--storage", UNREACHABLE_PG), 2, "cannot use the study storage",
                          "127.0.0.1", "refused")


@pytest.mark.parametrize("damage", [b"not a database at all " * 100, b"SQLite format 3\x00" + b"\xff" * 4096],
                         ids=["text", "broken-sqlite"])
def test_a_corrupt_study_database_is_named_and_left_as_it_is(tmp_path, damage):
    db = tmp_path / "s.db"
    db.write_bytes(damage)
    storage = f"sqlite:///{db}"
    for args in (["show", "mnist", "--storage", storage], ["list", "--storage", storage]):
        assert_one_error_line(run(*args), 2, "cannot use the study storage", "the file was left as it is")
    assert db.read_bytes() == damage


def test_another_applications_sqlite_database_is_refused_by_reading_commands_and_left_as_it_is(tmp_path):
    """`autotune list --storage sqlite:///app.db` said "no studies", added Optuna's 13 tables and switched the file
    to WAL for good."""
    import hashlib
    import sqlite3

    db = tmp_path / "app.db"
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE users (name TEXT)")
        connection.execute("INSERT INTO users VALUES ('ada')")
    connection.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    storage = f"sqlite:///{db}"
    for args in (["list"], ["show", "mnist"], ["jobs"], ["delete", "mnist", "--yes"]):
        assert_one_error_line(run(*args, "--storage", storage), 2, "is an SQLite database that holds no study "
                              "storage (no Optuna tables): it was left as it is")
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "app.db"]
    (tmp_path / "empty.db").touch()    # left by a run that died before writing its tables: not another's
    listed = run("list", "--storage", f"sqlite:///{tmp_path / 'empty.db'}")
    assert listed.exit_code == 0 and "no studies in" in listed.output, listed.output


@pytest.mark.parametrize("command", ["export", "report", "apply"])
def test_an_output_into_a_missing_folder_fails_before_any_work(tmp_path, command, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "marked_model.py").write_text(
        "from pathlib import Path\nfrom autotune.workloads import mnist\n\n\n"
        "def model():\n    Path('model-was-built').touch()\n    return mnist.model()\n")
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["model"] = {"factory": "marked_model:model"}
    config = write_yaml(tmp_path / "c.yaml", data)
    plan = tmp_path / "plan.json"
    plan.write_text('{"plan": {"features.0": "int8"}}')
    out = str(tmp_path / "missing" / "out.file")
    args = {"export": ["export", "mnist", "--storage", f"sqlite:///{tmp_path}/s.db", "--out", out],
            "report": ["report", "mnist", "--storage", f"sqlite:///{tmp_path}/s.db", "--out", out],
            "apply": ["apply", str(plan), "--config", str(config), "--out", out]}[command]
    assert_one_error_line(run(*args), 2, f"the folder {tmp_path / 'missing'} does not exist")
    assert not (tmp_path / "model-was-built").exists()


def test_a_module_beside_the_config_imports_and_one_that_raises_at_import_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_eval.py").write_text("raise RuntimeError('the dataset server is down')\n")
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["evaluation"] = {"eval_fn": "broken_eval:make"}
    assert_one_error_line(run("tune", str(write_yaml(tmp_path / "c.yaml", data))), 2, "evaluation.eval_fn",
                          "cannot import module 'broken_eval'", "RuntimeError: the dataset server is down")


def test_an_eval_fn_named_in_place_of_its_factory_is_said_so(tmp_path, monkeypatch):
    """evaluation.eval_fn names a factory of kwargs returning eval_fn(model); a user naming eval_fn(model) itself
    got "agreement() missing 1 required positional argument: 'model'" and no word of what was expected."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_eval.py").write_text("def agreement(model, seed=0):\n    return 1.0\n")
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["evaluation"] = {"eval_fn": "my_eval:agreement", "kwargs": {"seed": 1}}
    assert_one_error_line(run("tune", str(write_yaml(tmp_path / "c.yaml", data))), 2, "evaluation.eval_fn",
                          "missing 1 required positional argument: 'model'",
                          "(evaluation.eval_fn names a factory, called with its kwargs alone, that returns "
                          "eval_fn(model))")


def test_debug_shows_the_traceback(tmp_path):
    result = run("--debug", "list", "--storage", "sqlite:/nope")
    assert result.exit_code != 0 and result.exception is not None
    assert "cannot parse the storage URL" in str(result.exception)


def test_environment_variables_are_expanded_in_every_string_and_an_unset_one_is_named(tmp_path, monkeypatch):
    from autotune.config import load_config
    monkeypatch.setenv("TUNE_DIR", str(tmp_path))
    monkeypatch.setenv("STUDY", "from-env")
    data = small_mnist("sqlite:///${TUNE_DIR}/s.db")
    data["tuning"]["study_name"] = "${STUDY}"
    assert load_config(write_yaml(tmp_path / "c.yaml", data)).tuning.study_name == "from-env"
    data["evaluation"]["kwargs"]["label"] = "${AUTOTUNE_TEST_UNSET_LABEL}"
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)))
    assert_one_error_line(result, 2, "evaluation.kwargs.label", "AUTOTUNE_TEST_UNSET_LABEL is not set")


def test_a_dollar_in_a_variables_value_is_kept_and_dollar_dollar_writes_one(tmp_path, monkeypatch):
    """A password holding `$` was taken for another variable ("environment variable w0rd is not set"), with the
    URL, password and all, in the message; and no `$` could be written at all."""
    from autotune.config import load_config
    monkeypatch.setenv("AUTOTUNE_TEST_PASSWORD", "pa$w0rd")
    data = small_mnist("sqlite:///" + str(tmp_path / "s.db"))
    data["tuning"]["study_name"] = "${AUTOTUNE_TEST_PASSWORD}-$$1"
    assert load_config(write_yaml(tmp_path / "c.yaml", data)).tuning.study_name == "pa$w0rd-$1"
    data["tuning"]["storage"] = "postgresql+psycopg://tuner:se$cret@db.example/studies"
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)))
    assert_one_error_line(result, 2, "tuning.storage", "environment variable cret is not set")
    assert "se$cret" not in result.output and "tuner:***@db.example" in result.output and "write $$" in result.output


def test_a_ctrl_c_python_drops_in_a_finalizer_still_ends_the_command_as_interrupted(monkeypatch):
    # Python ignores an exception raised in __del__ or a weakref callback, KeyboardInterrupt too: a tune whose
    # Ctrl-C landed there (while compiled code was collected) ran to its end and exited 0.
    class SendsCtrlC:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)

    ran_on = []

    @main.command("ctrl-c-in-a-finalizer")
    def command():
        SendsCtrlC()           # collected at once; its KeyboardInterrupt is dropped
        ran_on.append(True)

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)    # Python's own: prints the traceback
    hook_before, handler_before = sys.unraisablehook, signal.getsignal(signal.SIGINT)
    try:
        result = run("ctrl-c-in-a-finalizer")
    finally:
        main.commands.pop("ctrl-c-in-a-finalizer")
    assert ran_on == [True], "the interrupt was not dropped: this test no longer shows the case"
    assert_one_error_line(result, 130, "interrupted; every finished trial is kept")
    assert "KeyboardInterrupt" not in result.output and "Exception ignored" not in result.output, result.output
    # The handlers are put back: Python's own, or SIG_IGN where the suite was started in the background (nohup).
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert sys.unraisablehook is hook_before


def test_a_ctrl_c_that_breaks_a_librarys_clean_up_ends_the_command_as_interrupted():
    """Optuna's trial clean-up reads a variable its KeyboardInterrupt left unset: the user saw 'unexpected
    UnboundLocalError' and exit 1 for a Ctrl-C."""
    @main.command("ctrl-c-in-a-clean-up")
    def command():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)      # the handler raises here
            state = "told"
        finally:
            print(state)       # noqa: F821 - unset: the interrupt came first

    try:
        result = run("ctrl-c-in-a-clean-up")
    finally:
        main.commands.pop("ctrl-c-in-a-clean-up")
    assert_one_error_line(result, 130, "interrupted; every finished trial is kept")
    assert "UnboundLocalError" not in result.output


class _FetchSendsCtrlC(sqlite3.Cursor):
    def fetchall(self):
        # Both connections closed under the fetch, as a study read's were found after its Ctrl-C: SQLAlchemy then
        # fails to close the cursor and logs it.
        self.connection.owner.close()
        self.connection.close()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)               # the handler raises here, inside SQLAlchemy's fetch


class _ConnectionSendsCtrlC(sqlite3.Connection):
    owner: sqlalchemy.Connection    # SQLAlchemy's connection over this one

    def cursor(self, factory=_FetchSendsCtrlC):
        return super().cursor(factory)


def test_a_ctrl_c_inside_a_database_query_shows_no_library_traceback(tmp_path, monkeypatch):
    """SQLAlchemy closes a connection a KeyboardInterrupt broke, then logs the cursor it cannot close, traceback and
    all: `tune --workers 3` printed that above its interrupted line when a Ctrl-C came during a study read."""
    monkeypatch.setattr(logging.root, "handlers", [])     # pytest's capture off: as a command line logs

    @main.command("ctrl-c-in-a-query")
    def command():
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp_path}/s.db",
                                          connect_args={"factory": _ConnectionSendsCtrlC})
        with engine.connect() as connection:
            connection.connection.dbapi_connection.owner = connection
            connection.execute(sqlalchemy.text("select 1")).all()

    try:
        result = run("ctrl-c-in-a-query")
    finally:
        main.commands.pop("ctrl-c-in-a-query")
    assert_one_error_line(result, 130, "interrupted; every finished trial is kept")
    assert "Error closing cursor" not in result.output, result.output


def test_a_librarys_error_log_is_still_shown_when_no_ctrl_c_came(monkeypatch):
    monkeypatch.setattr(logging.root, "handlers", [])

    @main.command("library-error-log")
    def command():
        logging.getLogger("sqlalchemy.pool.impl.QueuePool").error("Error closing cursor")

    try:
        result = run("library-error-log")
    finally:
        main.commands.pop("library-error-log")
    assert result.exit_code == 0 and "Error closing cursor" in result.output, result.output


@pytest.mark.parametrize("script", [False, True])
def test_a_ctrl_c_while_the_command_line_loads_is_one_line_and_exit_130(tmp_path, script):
    """Importing torch takes seconds: a Ctrl-C meanwhile printed Python's traceback through the import."""
    command = [str(Path(sys.executable).parent / "autotune")] if script else [sys.executable, "-m", "autotune"]
    for delay in (0.3, 1.0, 2.0):
        proc = subprocess.Popen([*command, "list", "--storage", f"sqlite:///{tmp_path}/s.db"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (delay, out, err)
        assert err == "Error: interrupted; every finished trial is kept: run the same command again to resume\n", \
            (delay, err)


STUCK_CLEAN_UP = """
import sys, threading, time
import click
from autotune.cli import main

@main.command("stuck")
@click.option("--as-helper", is_flag=True)
def stuck(as_helper):
    held = threading.Event()
    try:
        print("started", flush=True)
        time.sleep(60)
    finally:
        held.wait()       # a clean-up that never ends: a write waiting on a database lock that is never freed

main(prog_name="autotune")
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_a_ctrl_c_whose_clean_up_hangs_still_ends_the_process_soon_and_says_so_once(quiet):
    """`tune --workers 3` on SQLite once took over two minutes to stop after a Ctrl-C, its clean-up waiting on a
    locked database: the process now ends CLEAN_UP_S after the Ctrl-C (a helper process without a word)."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_CLEAN_UP, "stuck", *(["--as-helper"] if quiet else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=CLEAN_UP_S + 60)
    assert proc.returncode == 130 and CLEAN_UP_S - 1 < time.monotonic() - sent < CLEAN_UP_S + 30, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    if quiet:
        assert err == "", err
    else:
        assert errors == ["Error: interrupted; every finished trial is kept: run the same command again to resume"]
        assert "cut short: a trial it left running fails when the study resumes" in err, err


@pytest.mark.parametrize("sent,code,said", [
    (signal.SIGINT, 130, "interrupted"),
    (signal.SIGTERM, 143, "stopped by SIGTERM"),     # `docker stop`: it killed the process mid-trial, unsaid
])
def test_ctrl_c_during_tune_is_one_line_and_exit_130_and_the_run_resumes(tmp_path, sent, code, said):
    data = yaml.safe_load(SHIPPED.read_text())
    data["evaluation"]["kwargs"]["limit"] = 500
    data["tuning"].update(max_trials=2, repeats=3, warmup=1, storage=f"sqlite:///{tmp_path}/s.db")
    config = write_yaml(tmp_path / "c.yaml", data)
    command = [sys.executable, "-m", "autotune", "tune", str(config)]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not study_exists(tmp_path / "s.db", "mnist") and time.monotonic() < deadline:
        time.sleep(0.2)       # the study exists once imports are done: the baseline and trials follow
    time.sleep(1.0)
    proc.send_signal(sent)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Aborted" not in err, err
    assert [line for line in err.splitlines() if line.startswith("Error:")] == [
        f"Error: {said}; every finished trial is kept: run the same command again to resume"]
    study = optuna.load_study(study_name="mnist", storage=f"sqlite:///{tmp_path}/s.db")
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))    # the trial it stopped, said so
    resumed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "speedup" in resumed.stdout


def test_the_autotune_command_imports_modules_beside_it_and_leaves_no_file_in_the_temp_dir(tmp_path):
    """The console script (not python -m) finds a config's module in the working directory; plan claims live in
    the database, so nothing is written under TMPDIR for another local user to tamper with."""
    (tmp_path / "my_models.py").write_text("from autotune.workloads.mnist import model\n")
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["model"] = {"factory": "my_models:model"}
    data["tuning"]["max_trials"] = 1
    config = write_yaml(tmp_path / "c.yaml", data)
    temp = tmp_path / "tmp"
    temp.mkdir()
    script = Path(sys.executable).parent / "autotune"
    done = subprocess.run([str(script), "tune", str(config)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(temp)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(temp.iterdir()), f"files left under TMPDIR: {list(temp.iterdir())}"


def test_output_into_a_reader_that_went_away_ends_quietly(tmp_path):
    """`autotune show ... | head` ended with "unexpected BrokenPipeError" and exit code 1."""
    import optuna

    url = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="shown", storage=url)
    reader_gone = subprocess.Popen([sys.executable, "-m", "autotune", "list", "--storage", url],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()     # before the command, still importing, writes its table
    _, said = reader_gone.communicate(timeout=300)
    assert reader_gone.returncode == 141, said
    assert b"Error" not in said and b"BrokenPipe" not in said, said


def test_a_factory_argument_that_is_one_variable_takes_its_number_and_a_config_field_its_text(monkeypatch):
    """`kwargs: {sleep: "${EVAL_SLEEP}"}` passed "0.01", and the baseline failed on a str inside the user's code."""
    from autotune.config.file import expand_env_everywhere
    monkeypatch.setenv("AUTOTUNE_TEST_BATCH", "64")
    monkeypatch.setenv("AUTOTUNE_TEST_SLEEP", "0.01")
    data = {"evaluation": {"kwargs": {"batch": "${AUTOTUNE_TEST_BATCH}", "sleep": "$AUTOTUNE_TEST_SLEEP",
                                      "name": "run-${AUTOTUNE_TEST_BATCH}"}},
            "tuning": {"study_name": "${AUTOTUNE_TEST_BATCH}"}}
    assert expand_env_everywhere(data) == {"evaluation": {"kwargs": {"batch": 64, "sleep": 0.01, "name": "run-64"}},
                                           "tuning": {"study_name": "64"}}


@pytest.mark.parametrize("attrs, why", [
    # It said "tuning has not finished" of a study whose eval_fn had failed at the fp32 baseline, which no waiting
    # finishes ...
    ({}, "its fp32 baseline was never scored: eval_fn failed on it"),
    # ... and of a service job's cancelled study, pointing at `tune`.
    ({"baseline_accuracy": 0.9, "cancelled": "job 3 tuning it was cancelled"},
     "job 3 tuning it was cancelled before its search ended")], ids=["baseline-never-scored", "job-cancelled"])
def test_show_export_and_report_of_a_study_without_a_best_plan_say_why(tmp_path, attrs, why):
    import optuna

    from autotune.storage import study as studies
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="unfinished", storage=url)
    for key, value in attrs.items():
        studies.set_attr(study, key, value)
    assert_one_error_line(run("export", "unfinished", "--storage", url), 2, f"has no best plan yet ({why}")
    assert why in run("show", "unfinished", "--storage", url).output
    assert run("report", "unfinished", "--storage", url, "--out", str(tmp_path / "r.html")).exit_code == 0
    assert why in (tmp_path / "r.html").read_text()


def test_submit_refuses_what_a_worker_would_fail_the_job_for_without_importing_anything(tmp_path):
    """`max_trials: many` and a misspelt field were queued with exit 0 and failed on a worker later, their reason's
    lines spilling through the `jobs` table."""
    url = f"sqlite:///{tmp_path}/jobs.db"
    job = {"model": {"factory": "nowhere.to.be:found"}, "evaluation": {"eval_fn": "nowhere.to.be:scored"}}
    bad = write_yaml(tmp_path / "bad.yaml", {**job, "tuning": {"max_trials": "many", "tolerable_lose": 0.01}})
    assert_one_error_line(run("submit", str(bad), "--storage", url), 2, "bad.yaml: invalid config:",
                          "tuning.max_trials: Input should be a valid integer", "tuning.tolerable_lose: Extra inputs")
    one = write_yaml(tmp_path / "one.yaml", {**job, "tuning": {"tolerable_lose": 0.01}})    # worded as `tune` says it
    assert_one_error_line(run("submit", str(one), "--storage", url), 2,
                          "one.yaml: invalid config: tuning.tolerable_lose: Extra inputs are not permitted")
    typo = write_yaml(tmp_path / "typo.yaml", {**job, "tunning": {"max_trials": 3}})
    assert_one_error_line(run("submit", str(typo), "--storage", url), 2, "unknown section(s) tunning",
                          "did you mean 'tuning'?")
    # A variable only the workers' environment may set is left to them, as is the storage they replace.
    later = write_yaml(tmp_path / "later.yaml", {**job, "tuning": {"max_trials": "${AUTOTUNE_TEST_UNSET_VAR}"}})
    assert run("submit", str(later), "--storage", url).output == "job 1 queued\n"

    from autotune.service.jobs import JobQueue
    from autotune.storage.rdb import open_storage
    JobQueue(open_storage(url)).end(1, "failed", "job 1: invalid config:\n  tuning.max_trials: not a number")
    row = next(line for line in run("jobs", "--storage", url).output.splitlines() if line.startswith("1 "))
    assert row.endswith("job 1: invalid config: tuning.max_trials: not a number")


def test_a_storage_file_is_read_for_its_one_url_and_a_bad_one_is_named_by_its_variable(tmp_path):
    """A missing file read "cannot write or read PATH", naming no variable; a comment line in the file was taken
    into the URL (database "studies # prod db" does not exist)."""
    url = f"sqlite:///{tmp_path}/team.db"
    commented = tmp_path / "url"
    commented.write_text(f"# the team's study database\n\n{url}\n")
    import optuna
    optuna.create_study(study_name="team-study", storage=url)
    listed = run("list", env={"AUTOTUNE_STORAGE_FILE": str(commented)})
    assert listed.exit_code == 0 and "team-study" in listed.output, listed.output
    assert_one_error_line(run("list", env={"AUTOTUNE_STORAGE_FILE": str(tmp_path / "nope")}), 2,
                          f"AUTOTUNE_STORAGE_FILE names {tmp_path / 'nope'}, which cannot be read")
    commented.write_text(f"{url}\n{url}2\n")
    assert_one_error_line(run("list", env={"AUTOTUNE_STORAGE_FILE": str(commented)}), 2, "holds 2 lines",
                          "the storage URL alone")
