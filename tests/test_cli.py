"""The YAML config + CLI layer: one small real MNIST tuning run shared by the command tests, then bad inputs."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn

from autotune.backends.cast import CastWrapper
from autotune.backends.int8_conv import StaticInt8Conv2d
from autotune.backends.int8_linear import DynamicInt8Linear
from autotune.cli import main
from autotune.cli.study_commands import PLAN_FILE_KEYS
from autotune.config.file import load_config, load_yaml
from autotune.dataset_eval import macro_f1, score
from autotune.errors import ConfigError
from autotune.measure.latency import UNCERTAIN_RATIO
from autotune.result import BUSY_KEY, NOISE_KEY
from autotune.workloads.mnist import accuracy_eval, digits
from autotune.workloads.mnist import model as mnist_model

SHIPPED = Path(__file__).parent.parent / "configs" / "mnist.yaml"


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def small_mnist(storage: str) -> dict:
    """The shipped config with a small budget: 500 digits, 3 trials, few timing repeats."""
    data = yaml.safe_load(SHIPPED.read_text())
    data["evaluation"]["kwargs"]["limit"] = 500
    data["tuning"].update(max_trials=3, repeats=3, warmup=1, storage=storage, engines=["eager"])  # no compiling
    return data


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    config = write_yaml(folder / "mnist.yaml", small_mnist("sqlite:///${TUNE_DIR}/s.db"))
    result = CliRunner().invoke(main, ["tune", str(config)], env={"TUNE_DIR": str(folder)})
    return folder, config, f"sqlite:///{folder}/s.db", result


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def test_shipped_config_validates():
    config = load_config(SHIPPED)
    assert config.tuning.study_name == "mnist" and config.model.factory == "autotune.workloads.mnist:model"


def test_tune_prints_summary_and_expands_env_in_storage(tuned):
    folder, _, _, result = tuned
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and "study 'mnist'" in result.output and "new" in result.output
    assert "search stopped: " in result.output      # why it ended, when that is before max_trials too
    assert (folder / "s.db").is_file()


def test_tune_into_a_log_says_each_evaluated_trial_on_a_line_of_its_own(tuned):
    """Without a terminal, click's progress bar printed its label alone ("evaluated trials") and nothing more."""
    _, _, _, result = tuned
    counted = re.findall(r"^evaluated trials: (\d+) of at most \d+$", result.output, re.MULTILINE)
    evaluated = int(re.search(r"(\d+) evaluated trials?\b", result.output).group(1))
    assert counted == [str(n) for n in range(1, evaluated + 1)], result.output
    assert "evaluated trials\n" not in result.output


def test_tune_again_resumes_the_study(tuned):
    folder, config, _, first = tuned
    # Pruning by measured latency can leave fewer plans than max_trials, so read how many the first run made.
    evaluated = re.search(r"(\d+) evaluated trials?\b", first.output).group(1)
    result = run("tune", str(config), env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert re.search(rf"resuming after {evaluated} evaluated trials?\b", result.output)


def test_a_study_stopped_before_its_first_trial_resumes_and_is_not_called_new(tmp_path):
    """A run killed while its first finalist compiled left its baseline and signals, and no evaluated trial: the
    next run said the study was new."""
    from autotune.tuner import start_runner

    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["tuning"]["max_trials"] = 1
    config = write_yaml(tmp_path / "c.yaml", data)
    loaded = load_config(config)
    start_runner(loaded.build_model(), loaded.tuning, loaded.evaluation.build(), loaded.build_example_inputs())
    result = run("tune", str(config))
    assert result.exit_code == 0, result.output
    assert "study 'mnist' in sqlite:///" in result.output and ": resuming after 0 evaluated trials" in result.output


def test_show_lists_trials_and_best(tuned):
    _, _, storage, _ = tuned
    result = run("show", "mnist", "--storage", storage)
    assert result.exit_code == 0, result.output
    assert "latency/fp32" in result.output and "guided" in result.output and "best: accuracy" in result.output
    rows = [line.split() for line in result.output.splitlines() if line[:1].isdigit()]
    evaluated = [row for row in rows if row[-1] in ("pass", "FAIL")]
    assert evaluated and len({row[2] for row in evaluated}) == len(evaluated)   # one plan id per evaluated plan


def test_a_trial_of_a_pareto_front_is_marked_by_show_and_exported_for_apply(tmp_path):
    """A user could not pick a point of a pareto study's front: show did not mark it, and export wrote the best plan
    alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from simulator import SimWorkload

    from autotune import MixedPrecisionConfig, TuningConfig, autotune
    sim, storage = SimWorkload(6, eval_cost_s=0), f"sqlite:///{tmp_path}/p.db"
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          max_trials=8, repeats=3, storage=storage, study_name="front", objective="pareto")
    study = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer()).study
    front = sorted(trial.number for trial in study.best_trials)
    shown = run("show", "front", "--storage", storage).output
    marked = sorted(int(line.split()[0]) for line in shown.splitlines() if line.endswith(" (front)"))
    assert front and marked == front, shown
    picked = study.trials[front[-1]]
    out = tmp_path / "picked.yaml"
    assert run("export", "front", "--storage", storage, "--trial", str(picked.number), "--out", str(out)).exit_code == 0
    exported = yaml.safe_load(out.read_text())
    assert exported["trial"] == picked.number and exported["engine"] == "eager"
    assert exported["plan"] == picked.user_attrs["plan"] and exported["speedup"] == pytest.approx(1 / picked.values[0])
    assert "speedup_predicted" not in exported and picked.user_attrs["latency_measured"] is True
    assert_clear_error(run("export", "front", "--storage", storage, "--trial", "99"),
                       "Error: study 'front' has no trial 99 (its trials are 0 to")


def test_a_trial_whose_speedup_was_predicted_is_exported_saying_so(tmp_path):
    """`export --trial N` wrote the speedup `show` marks `~` (predicted from module costs, never timed) as if timed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from simulator import SimWorkload

    from autotune import MixedPrecisionConfig, TuningConfig, autotune
    sim, storage = SimWorkload(6, eval_cost_s=0), f"sqlite:///{tmp_path}/p.db"
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          max_trials=3, repeats=3, storage=storage, study_name="guess", trial_timing="predicted")
    study = autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer()).study
    trial = next(t for t in study.trials if t.values and not t.user_attrs.get("duplicate"))
    out = tmp_path / "guess.yaml"
    assert run("export", "guess", "--storage", storage, "--trial", str(trial.number), "--out", str(out)).exit_code == 0
    exported = yaml.safe_load(out.read_text())
    assert exported["speedup_predicted"] is True and exported["speedup"] == pytest.approx(1 / trial.values[0])
    assert f"~{trial.values[0]:.3f}" in run("show", "guess", "--storage", storage).output


@pytest.mark.parametrize(("engine", "knobs", "runs_as"), [("lowp", ["fold_bn"], ", lowp engine with fold_bn"),
                                                           ("compiled", [], ", compiled engine"), ("eager", [], "")])
def test_show_says_which_engine_and_knobs_the_best_plan_runs_with(tmp_path, engine, knobs, runs_as):
    import optuna

    from autotune.storage import study as studies

    storage = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=storage)
    studies.set_attr(study, studies.BASELINE_ATTR, 0.99)
    studies.set_attr(study, "best", {"plan": {"a": "bf16", "b": "bf16"}, "accuracy": 0.99, "speedup": 2.171,
                                     "engine": engine, "knobs": knobs})
    result = run("show", "s", "--storage", storage)
    assert result.exit_code == 0, result.output
    assert f"best: accuracy 0.9900, speedup 2.17x, bf16×2{runs_as}\n" in result.output


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_export_best_plan(tuned, fmt):
    folder, _, storage, _ = tuned
    out = folder / f"plan.{fmt}"
    result = run("export", "mnist", "--storage", storage, "--format", fmt, "--out", str(out))
    assert result.exit_code == 0, result.output
    exported = json.loads(out.read_text()) if fmt == "json" else yaml.safe_load(out.read_text())
    assert set(exported["plan"]) == {"features.0", "features.3", "classifier.0", "classifier.2"}
    assert exported["study"] == "mnist" and exported["speedup"] > 0


def test_apply_saves_a_model_that_matches_the_plan(tuned):
    folder, config, storage, _ = tuned
    plan_file, out = folder / "best.json", folder / "tuned.pt"
    assert run("export", "mnist", "--storage", storage, "--out", str(plan_file)).exit_code == 0
    result = run("apply", str(plan_file), "--config", str(config), "--out", str(out), env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output

    tuned_model = torch.load(out, weights_only=False)
    expected = {("int8", nn.Conv2d): StaticInt8Conv2d, ("int8", nn.Linear): DynamicInt8Linear}
    reference = mnist_model()
    for name, dtype in json.loads(plan_file.read_text())["plan"].items():
        original = type(reference.get_submodule(name))
        want = original if dtype == "fp32" else expected.get((dtype, original), CastWrapper)
        assert type(tuned_model.get_submodule(name)) is want, name
    accuracy = accuracy_eval(*digits(500))(tuned_model)
    assert accuracy >= 0.99 * accuracy_eval(*digits(500))(reference)
    assert "note:" not in result.output


@pytest.mark.parametrize("engine, out, said", [
    # An eager plan was written with torch.save under the name the README keeps for exported graphs.
    ("eager", "m.pt2", ["m.pt2: the eager engine saves the model with torch.save", "name it m.pt, or give no suffix"]),
    # `apply --out unet_tuned.pt` of a compiled plan wrote a torch.export file under torch.save's name, unsaid.
    ("compiled", "m.pt", ["m.pt: the compiled engine saves the model as a torch.export graph", "name it m.pt2"]),
])
def test_apply_refuses_a_file_name_the_engines_saved_model_cannot_be_loaded_by(tuned, engine, out, said):
    folder, config, storage, _ = tuned
    plan_file = folder / f"{engine}.json"
    plan_file.write_text(json.dumps({"plan": {"features.0": "int8"}, "engine": engine}))
    result = run("apply", str(plan_file), "--config", str(config), "--out", str(folder / out),
                 env={"TUNE_DIR": str(folder)})
    assert_clear_error(result, *said)
    assert not (folder / out).exists()


def test_apply_to_a_name_without_suffix_saves_with_the_suffix_of_the_engine_the_plan_runs_in(tuned, monkeypatch):
    """The README's `--out mnist_tuned.pt2` failed wherever the winner was not the compiled engine's, after the plan
    was built; which engine wins differs from machine to machine. A wrong suffix is refused before any work."""
    from autotune.cli import study_commands

    folder, config, _, _ = tuned
    plan_file = folder / "eager-plan.json"
    plan_file.write_text(json.dumps({"plan": {"features.0": "int8"}, "engine": "eager"}))
    result = run("apply", str(plan_file), "--config", str(config), "--out", str(folder / "tuned"),
                 env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert f"wrote {folder / 'tuned.pt'}:" in result.output and not (folder / "tuned").exists()
    assert isinstance(torch.load(folder / "tuned.pt", weights_only=False).features[0], StaticInt8Conv2d)
    assert study_commands.saved_model_path("m", "compiled") == "m.pt2"
    monkeypatch.setattr(study_commands, "apply_saved_plan", lambda *a: pytest.fail("built before the name was checked"))
    assert_clear_error(run("apply", str(plan_file), "--config", str(config), "--out", str(folder / "m.pt2"),
                           env={"TUNE_DIR": str(folder)}), "name it m.pt")


def test_a_plan_file_with_a_key_apply_does_not_know_is_refused_naming_the_closest(tuned):
    """`engin: inductor` and `knob: [channels_last]` beside `plan:` were dropped without a word: the plan was saved
    in the eager engine, without the knob."""
    folder, config, storage, _ = tuned
    plan = {"features.0": "int8", "features.3": "int8", "classifier.0": "int8", "classifier.2": "fp32"}
    for key, said in (("engin", "unknown key 'engin'; did you mean 'engine'?"), ("colour", "unknown key 'colour'; a")):
        plan_file = folder / f"{key}.json"
        plan_file.write_text(json.dumps({key: "inductor", "plan": plan}))
        result = run("apply", str(plan_file), "--config", str(config), "--out", str(folder / "m.pt"),
                     env={"TUNE_DIR": str(folder)})
        assert_clear_error(result, f"Error: {plan_file}: {said}")
    # Every key export writes is read back, the noisy timing's too.
    exported = folder / "all.json"
    assert run("export", "mnist", "--storage", storage, "--out", str(exported)).exit_code == 0
    data = {**json.loads(exported.read_text()), NOISE_KEY: 0.3, BUSY_KEY: True, "compile_in_place": False, "trial": 0,
            "speedup_predicted": True, "compile_static": False}
    assert set(data) == set(PLAN_FILE_KEYS) - {"latency_inputs"}
    exported.write_text(json.dumps(data))
    result = run("apply", str(exported), "--config", str(config), "--out", str(folder / "m.pt"),
                 env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output


def test_apply_of_a_plan_that_leaves_modules_out_says_which_stay_as_they_are(tuned):
    """A plan file edited by hand with modules deleted was applied without a word: they stayed fp32."""
    folder, config, storage, _ = tuned
    plan_file, out = folder / "part.json", folder / "part.pt"
    plan_file.write_text(json.dumps({"features.0": "int8", "classifier.2": "fp32"}))
    result = run("apply", str(plan_file), "--config", str(config), "--out", str(out), env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert (f"note: {plan_file} names 2 of the 4 modules tuning searches in this model; features.3, classifier.0 "
            "stay as the model holds them (fp32)") in result.output


WIDER_HEAD = """from torch import nn

from autotune.workloads.mnist import model as mnist_model


def model():
    net = mnist_model()
    net.classifier[2] = nn.Linear(net.classifier[2].in_features, 12)
    return net
"""


def test_apply_onto_a_model_of_other_shapes_says_so(tuned, tmp_path, monkeypatch):
    """A plan applied to a wider model, or a 5x5 convolution where it was 3x3, was saved without a word, though its
    accuracy and speed were measured on another model: the plan file recorded no shapes to compare with."""
    folder, config, storage, _ = tuned
    plan_file = folder / "shapes.json"
    assert run("export", "mnist", "--storage", storage, "--out", str(plan_file)).exit_code == 0
    recorded = json.loads(plan_file.read_text())["module_shapes"]
    assert set(recorded) == {"features.0", "features.3", "classifier.0", "classifier.2"}
    inner = recorded["classifier.2"].split()[0].split("x")[1]    # the head's in_features
    same = run("apply", str(plan_file), "--config", str(config), "--out", str(tmp_path / "same.pt"),
               env={"TUNE_DIR": str(folder)})
    assert same.exit_code == 0 and "other shapes" not in same.output, same.output
    (tmp_path / "wider_head.py").write_text(WIDER_HEAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = yaml.safe_load(config.read_text())
    data["model"]["factory"] = "wider_head:model"
    wider = write_yaml(tmp_path / "wider.yaml", data)
    result = run("apply", str(plan_file), "--config", str(wider), "--out", str(tmp_path / "wider.pt"),
                 env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert (f"note: {plan_file} was tuned on a model of other shapes (classifier.2 held 10x{inner} 10 there, "
            f"12x{inner} 12 here): its accuracy and speed were measured on that model") in result.output
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({**json.loads(plan_file.read_text()), "module_shapes": [3, 3]}))
    assert_clear_error(run("apply", str(broken), "--config", str(config), "--out", str(tmp_path / "b.pt"),
                           env={"TUNE_DIR": str(folder)}), "module_shapes must map module names to shapes")


def test_bench_times_a_saved_plan_against_fp32_at_each_shape(tuned, monkeypatch):
    from autotune.cli import bench_command
    folder, config, storage, _ = tuned
    plan_file = folder / "bench.json"
    assert run("export", "mnist", "--storage", storage, "--out", str(plan_file)).exit_code == 0
    from autotune.measure.measurer import latency_by_shape
    timed, order = {}, []

    def recorded(*args):
        order.append("timing")
        timed.update(latency_by_shape(*args))
        return timed
    monkeypatch.setattr(bench_command, "latency_by_shape", recorded)
    monkeypatch.setattr(bench_command, "allocation_while_timing", lambda steady: order.append(f"allocation {steady}"))
    result = run("bench", str(plan_file), "--config", str(config), "--shapes", "1,8", "--repeats", "3",
                 env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert "MNISTNet" in result.output and "fp32" in result.output    # torch.utils.benchmark's Compare table
    lines = {line.split(" (weight")[0]: line for line in result.output.splitlines() if "(weight 1)" in line}
    assert set(lines) == {"batch 1", "batch 8"}
    for shape, line in lines.items():
        speedup, plan_ms, fp32_ms = map(float, re.search(
            r": ([\d.]+)x fp32 +\(plan ([\d.]+) ± [\d.]+ ms, fp32 ([\d.]+) ± [\d.]+ ms, 3 rounds\)", line).groups())
        fp32, plan = timed[shape]["fp32"], next(stats for name, stats in timed[shape].items() if name != "fp32")
        assert (plan_ms, fp32_ms) == (pytest.approx(plan.median_ms, abs=6e-4), pytest.approx(fp32.median_ms, abs=6e-4))
        per_round = [p / f for p, f in zip(plan.samples_ms, fp32.samples_ms)]   # the speedup: their median's inverse
        assert speedup == pytest.approx(1 / sorted(per_round)[1], abs=6e-3)
        # a timing too noisy to trust says so, as the tuner's does (3 rounds on a busy host often are)
        assert ("noisy timing" in line) == (plan.ratio_uncertainty(fp32) > UNCERTAIN_RATIO)
    assert "weighted over the shapes:" in result.output
    assert order == ["allocation True", "timing"]     # timed as the tuner timed it: the config's steady allocation
    # The table gives each median to a tenth of its unit: trimmed to a noisy timing's spread, 30.4 and 14.6 ms read
    # 30 and 10, a 3x speedup where the lines below it said 2.1x.
    unit = {"microseconds (us)": 1e-3, "milliseconds (ms)": 1.0, "seconds (s)": 1e3}[
        re.search(r"Times are in (\w+ \(\w+\))", result.output).group(1)]
    # where the table's medians tell another story than the rounds, a line under the shape's says so
    from autotune.result import medians_disagree
    told = 0
    for by_model in timed.values():
        fp32, plan = by_model["fp32"], next(stats for name, stats in by_model.items() if name != "fp32")
        per_round = sorted(p / f for p, f in zip(plan.samples_ms, fp32.samples_ms))[1]   # 3 rounds: the median
        told += medians_disagree(plan.median_ms / fp32.median_ms, per_round)
    assert result.output.count("the medians in the table disagree with the speedup") == told
    for shape in ("batch 1", "batch 8"):
        row = next(line for line in result.output.splitlines() if line.strip().startswith(f"{shape} "))
        shown = [float(cell) * unit for cell in row.split("|")[1:]]
        medians = [stats.median_ms for stats in timed[shape].values()]
        assert shown == [pytest.approx(median, abs=0.051 * unit) for median in medians], row


def test_bench_times_the_calls_the_plan_file_names_where_the_config_names_none(tuned):
    """`export` writes the calls a study chose to time (a generation's first call and steps); bench times those."""
    folder, config, storage, _ = tuned
    plan_file = folder / "timed-calls.json"
    assert run("export", "mnist", "--storage", storage, "--out", str(plan_file)).exit_code == 0
    exported = json.loads(plan_file.read_text())
    assert "latency_inputs" not in exported       # MNIST's eval_fn calls the model itself
    plan_file.write_text(json.dumps({**exported, "latency_inputs": [{"call": 0, "weight": 2}]}))
    result = run("bench", str(plan_file), "--config", str(config), "--repeats", "3", env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert re.search(r"^call 0, batch \d+ \(weight 2\): ", result.output, re.MULTILINE), result.output
    plan_file.write_text(json.dumps({**exported, "latency_inputs": [{"call": -1}]}))
    result = run("bench", str(plan_file), "--config", str(config), env={"TUNE_DIR": str(folder)})
    assert_clear_error(result, "latency_inputs", "greater than or equal to 0")


@pytest.mark.parametrize("shapes", ["0,8", "one", "1,,2"])
def test_bench_refuses_shapes_that_are_not_batch_sizes(tuned, shapes):
    folder, config, _, _ = tuned
    plan = write_yaml(folder / "fp32plan.yaml", {"features.0": "fp32"})
    result = run("bench", str(plan), "--config", str(config), "--shapes", shapes, env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 2 and "--shapes" in result.output and "Traceback" not in result.output, result.output


def test_list_shows_studies_with_trial_counts(tuned):
    _, _, storage, _ = tuned
    result = run("list", "--storage", storage)
    assert result.exit_code == 0, result.output
    name, trials = result.output.splitlines()[1].split()[:2]
    assert name == "mnist" and int(trials) >= 1


def test_list_names_the_studies_a_run_stopped_in_its_set_up_left_and_how_to_resume_or_remove_them(tmp_path):
    """Studies of runs that stopped at a config or baseline error were listed "0 - - -" beside tuned ones, unsaid."""
    import optuna
    storage = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="stopped", storage=storage)
    tuned = optuna.create_study(study_name="tuned", storage=storage)
    tuned.set_user_attr("autotune.baseline_accuracy", 0.9)
    listed = run("list", "--storage", storage).output
    assert "no trial and no baseline yet: stopped (a run stopped in its set-up; the same tune command resumes" in listed
    assert "`autotune delete STUDY` removes one" in listed and "tuned (" not in listed


def test_report_writes_html_with_the_plot(tuned):
    folder, _, storage, _ = tuned
    out = folder / "report.html"
    result = run("report", "mnist", "--storage", storage, "--out", str(out))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert '<img alt="accuracy vs latency" src="data:image/png;base64,' in page
    assert "features.0" in page and "Baseline vs best" in page


# ---- bad inputs: one clear message, exit code 2, no traceback ----

def assert_clear_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def test_a_study_deleted_while_its_tuning_runs_ends_that_run_with_one_line_saying_so(tmp_path, monkeypatch):
    """`autotune delete` between trials (or optuna-dashboard's) left the run to end on "unexpected KeyError: 'Record
    does not exist.'"."""
    import optuna

    from autotune import tuner
    storage = f"sqlite:///{tmp_path}/s.db"
    config = write_yaml(tmp_path / "c.yaml", small_mnist(storage))
    chosen = tuner.verified_winner

    def deleted_first(runner, *args, **kwargs):
        optuna.delete_study(study_name=runner.study.study_name, storage=storage)
        return chosen(runner, *args, **kwargs)

    monkeypatch.setattr(tuner, "verified_winner", deleted_first)
    assert_clear_error(run("tune", str(config)), "Error: the study's records are gone from its storage: it was "
                                                 "deleted while this command ran")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  factory: autotune.workloads.mnist:model\ntuning: {max_trials: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:4:"):
        load_config(bad)
    assert_clear_error(run("tune", str(bad)), "bad.yaml:4:", "YAML syntax error")
    # A plan file's too, in one line: it was pyyaml's seven, quoting the text.
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan:\n  conv: int8\n  fc1: [int8\n")
    good = write_yaml(tmp_path / "good.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    result = run("apply", str(plan), "--config", str(good), "--out", str(tmp_path / "m.pt"))
    assert_clear_error(result, f"Error: not a JSON or YAML plan file: {plan}:4:1: YAML syntax error: expected ','")
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_key_given_twice_is_named_with_both_lines_in_a_config_and_a_plan_file(tmp_path):
    """pyyaml keeps the last of two equal keys: a second `model:` ran with the first dropped, and a plan file's second
    `plan:` replaced its first without a word."""
    good = small_mnist(f"sqlite:///{tmp_path}/s.db")
    text = yaml.safe_dump(good, sort_keys=False)
    twice = tmp_path / "twice.yaml"
    twice.write_text(text + "model: {factory: 'x:y'}\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml:\d+:1: YAML error: 'model' is given twice in one mapping "
                                          r"\(first on line 1\)"):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text(text.replace("tuning:\n", "tuning:\n  max_trials: 2\n  max_trials: 3\n", 1))
    assert_clear_error(run("tune", str(nested)), "'max_trials' is given twice")
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan: {conv: int8}\nengine: eager\nplan: {fc1: int8}\n")
    config = write_yaml(tmp_path / "good.yaml", good)
    result = run("apply", str(plan), "--config", str(config), "--out", str(tmp_path / "m.pt"))
    assert_clear_error(result, f"Error: not a JSON or YAML plan file: {plan}:3:1: YAML error: 'plan' is given twice")
    # A key set again over one merged in with `<<` is YAML's way to override it, no duplicate.
    assert load_yaml("base: &b {a: 1, b: 2}\nmine: {<<: *b, a: 3}\n")["mine"] == {"a": 3, "b": 2}


def test_unknown_key_names_the_field_path(tmp_path):
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["tuning"]["max_trial"] = 3
    assert_clear_error(run("tune", str(write_yaml(tmp_path / "c.yaml", data))),
                       "tuning.max_trial", "Extra inputs are not permitted")


def test_wrong_type_names_the_field_path(tmp_path):
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["tuning"]["max_trials"] = "three"
    data["evaluation"]["kwargs"] = "many"
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)))
    assert_clear_error(result, "c.yaml", "tuning.max_trials", "valid integer", "evaluation.kwargs")


def test_import_path_that_does_not_resolve(tmp_path):
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["model"]["factory"] = "autotune.workloads.mnist:no_such_model"
    data["evaluation"]["eval_fn"] = "no_such_package.evals:make"
    assert_clear_error(run("tune", str(write_yaml(tmp_path / "c.yaml", data))),
                       "model.factory", "no_such_model", "evaluation.eval_fn", "no_such_package")


def test_a_misspelt_import_path_names_the_attribute_it_is_close_to(tmp_path):
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["model"]["factory"] = "autotune.workloads.mnist:modle"
    assert_clear_error(run("tune", str(write_yaml(tmp_path / "c.yaml", data))),
                       "model.factory", "has no attribute 'modle'; did you mean 'model'?")


def test_factory_that_raises_is_a_config_error(tmp_path):
    data = small_mnist(f"sqlite:///{tmp_path}/s.db")
    data["model"] = {"factory": "torch.nn:Linear", "kwargs": {"in_features": 4}}
    assert_clear_error(run("tune", str(write_yaml(tmp_path / "c.yaml", data))),
                       "model.factory: torch.nn:Linear", "TypeError")


def test_unset_environment_variable(tmp_path):
    data = small_mnist("sqlite:///${AUTOTUNE_TEST_UNSET_DIR}/s.db")
    assert_clear_error(run("tune", str(write_yaml(tmp_path / "c.yaml", data))),
                       "tuning.storage", "AUTOTUNE_TEST_UNSET_DIR is not set")


def dataset_config(files, **evaluation) -> dict:
    return {"model": {"factory": "autotune.workloads.mnist:model"},
            "evaluation": {"dataset": {"files": files}, "inputs": "image", "input_shape": [1, 28, 28],
                           "label": "label", **evaluation}}


def test_missing_dataset_file_is_named(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", dataset_config("${AUTOTUNE_TEST_DATA}/digits.parquet"))
    result = run("tune", str(config), env={"AUTOTUNE_TEST_DATA": str(tmp_path / "data")})
    assert_clear_error(result, "evaluation.dataset.files", f"dataset file not found: {tmp_path}/data/digits.parquet")


@pytest.mark.parametrize("command", ["show", "export", "report"])
def test_unknown_study_name(tuned, tmp_path, command):
    _, _, storage, _ = tuned
    extra = ["--out", str(tmp_path / "r.html")] if command == "report" else []
    assert_clear_error(run(command, "no-such-study", "--storage", storage, *extra),
                       "no study named 'no-such-study'", storage)


def test_missing_storage_is_not_created(tmp_path):
    storage = f"sqlite:///{tmp_path}/missing.db"
    assert_clear_error(run("show", "mnist", "--storage", storage), storage)
    assert not (tmp_path / "missing.db").exists()


def test_plan_naming_modules_the_model_lacks(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"plan": {"features.0": "int8", "encoder.layer.9": "int8"}}))
    config = write_yaml(tmp_path / "c.yaml", small_mnist(f"sqlite:///{tmp_path}/s.db"))
    assert_clear_error(run("apply", str(plan), "--config", str(config), "--out", str(tmp_path / "m.pt")),
                       "encoder.layer.9", "plan.json")
    assert not (tmp_path / "m.pt").exists()


# ---- the built-in dataset evaluator ----

def test_builtin_evaluator_on_a_parquet_file_matches_accuracy_eval(tmp_path):
    import datasets

    images, labels = digits(300)
    datasets.Dataset.from_dict({"image": images.reshape(300, -1).numpy(), "label": labels.numpy()}) \
        .to_parquet(str(tmp_path / "digits.parquet"))
    config = load_config(write_yaml(tmp_path / "c.yaml", dataset_config("digits.parquet", batch_size=100)))
    net = mnist_model()
    assert config.evaluation.build()(net) == pytest.approx(accuracy_eval(images, labels)(net))


def test_builtin_evaluator_csv_columns_and_mse_direction(tmp_path):
    (tmp_path / "rows.csv").write_text("a,b,y\n1,2,3\n2,0,2\n0,1,1\n")
    data = {"model": {"factory": "torch.nn:Linear", "kwargs": {"in_features": 2, "out_features": 1}},
            "evaluation": {"dataset": {"files": "rows.csv"}, "inputs": ["a", "b"], "label": "y", "metric": "mse"}}
    config = load_config(write_yaml(tmp_path / "c.yaml", data))
    assert config.tuning.higher_is_better is False
    net = config.build_model()
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 1.0]]))
        net.bias.zero_()
    assert config.evaluation.build()(net) == pytest.approx(0.0)


def test_metrics():
    labels = torch.tensor([0, 1, 1, 2])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 2]), 3).float()
    assert score("accuracy", logits, labels) == pytest.approx(0.75)
    assert macro_f1(torch.tensor([0, 1, 2, 2]), labels) == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    assert score("accuracy", torch.tensor([[2.0], [-1.0]]), torch.tensor([1, 1])) == pytest.approx(0.5)


@pytest.mark.parametrize(("mistake", "named"), [
    ("input_shape", ["evaluation.input_shape: [1, 7, 7] does not hold a row of ['image'] (64 values)"]),
    ("zero_shape", ["evaluation.input_shape.1", "greater than or equal to 1"]),
    ("text_labels", ["evaluation", "column 'label' is not numbers"]),
    ("not_parquet", ["evaluation.dataset.files: cannot read", "as parquet: ArrowInvalid"]),
    ("empty_csv", ["evaluation.dataset.files: cannot read", "as csv: EmptyDataError"]),
    # A missing label read as NaN became -9223372036854775808 in .long(): a miss in every score, unsaid.
    ("missing_label", ["evaluation.label: column 'label' has 1 missing values (rows 3): drop those rows"]),
    ("fractional_labels", ["evaluation.label: column 'label' holds fractional values, not class numbers"]),
    ("shape_with_mapping", ["evaluation: input_shape reshapes the one positional input"]),
    ("mse_of_class_scores", ["the fp32 baseline evaluation failed", "metric mse compares one output per row with its "
                             "label; the model gives 10 per row (shape (20, 10))"]),
])
def test_a_dataset_the_evaluator_cannot_use_is_a_config_error_naming_it(tmp_path, mistake, named):
    """Mistakes a user makes in the built-in evaluator's section, each one `Error:` line, not an unexpected error."""
    import datasets

    images = torch.rand(20, 64).numpy()
    labels = [str(i % 10) for i in range(20)] if mistake == "text_labels" else list(range(10)) * 2
    if mistake == "missing_label":
        labels[3] = None
    elif mistake == "fractional_labels":
        labels = [label + 0.5 for label in labels]
    datasets.Dataset.from_dict({"image": images, "label": labels}).to_parquet(str(tmp_path / "digits.parquet"))
    files, shape, extra = "digits.parquet", [1, 8, 8], {}
    if mistake == "input_shape":
        shape = [1, 7, 7]
    elif mistake == "zero_shape":
        shape = [1, 0]
    elif mistake == "not_parquet":
        (tmp_path / "notes.parquet").write_text("these are not parquet bytes\n")
        files = "notes.parquet"
    elif mistake == "empty_csv":
        (tmp_path / "empty.csv").write_text("")
        files = "empty.csv"
    elif mistake == "shape_with_mapping":
        extra = {"inputs": {"x": "image"}}
    elif mistake == "mse_of_class_scores":
        extra, shape, images = {"metric": "mse"}, [1, 28, 28], torch.rand(20, 784).numpy()
        datasets.Dataset.from_dict({"image": images, "label": labels}).to_parquet(str(tmp_path / "digits.parquet"))
    data = {**dataset_config(files, input_shape=shape, **extra), "tuning": {"storage": f"sqlite:///{tmp_path}/s.db"}}
    result = run("tune", str(write_yaml(tmp_path / "c.yaml", data)))
    assert_clear_error(result, *named)
    assert "Generating train split" not in result.output     # datasets' progress bars


@pytest.mark.parametrize("in_place", [False, True])
def test_apply_says_to_compile_in_place_a_plan_of_a_model_its_own_methods_call(tuned, in_place):
    """A study whose eval_fn ran the model through its own methods (generate) exports `compile_in_place`, and the
    saved model is to be compiled so (`model.compile()`): torch.compile's wrapper would not reach generate's calls."""
    folder, config, storage, _ = tuned
    plan_file, out = folder / f"inductor-{in_place}.json", folder / f"inductor-{in_place}.pt"
    assert run("export", "mnist", "--storage", storage, "--out", str(plan_file)).exit_code == 0
    exported = json.loads(plan_file.read_text())
    assert "compile_in_place" not in exported     # MNIST's eval_fn calls the model itself
    plan_file.write_text(json.dumps({**exported, "engine": "inductor", "compile_in_place": in_place}))
    result = run("apply", str(plan_file), "--config", str(config), "--out", str(out), env={"TUNE_DIR": str(folder)})
    assert result.exit_code == 0, result.output
    assert ("model.compile()" in result.output) is in_place
    assert ("torch.compile(torch.load(" in result.output) is not in_place


def test_delete_removes_a_study_with_its_claims_and_refuses_one_with_a_trial_running(tmp_path):
    """The only way to reuse a study's name for another model was Optuna's own CLI; and a new study of that name
    would have found its plans claimed by the old one's trials."""
    import optuna
    import sqlalchemy

    from autotune import TuningConfig, autotune
    from autotune.storage.claims import PlanClaims
    from autotune.storage.rdb import open_storage
    storage = f"sqlite:///{tmp_path}/s.db"
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    result = autotune(model, TuningConfig(engines=["eager"], max_trials=3, repeats=3, storage=storage,
                                          study_name="old"), lambda m: 1.0, example_inputs=torch.randn(8, 16))
    PlanClaims(open_storage(storage), "old").claim("a plan", 0)     # as a trial of it claims its plan
    claimed = "SELECT count(*) FROM autotune_plan_claims WHERE study_name = 'old'"
    engine = sqlalchemy.create_engine(storage)
    with engine.connect() as connection:
        assert connection.exec_driver_sql(claimed).scalar() >= 1
    asked = CliRunner().invoke(main, ["delete", "old", "--storage", storage], input="n\n")   # asked; no: kept
    assert asked.exit_code == 0 and "delete study 'old' (" in asked.output and "evaluated trial" in asked.output
    assert "kept study 'old': nothing deleted" in asked.output and "Aborted" not in asked.output
    assert "old" in run("list", "--storage", storage).output
    running = optuna.load_study(study_name="old", storage=storage).ask()   # another process tuning it
    refused = run("delete", "old", "--storage", storage, "--yes")
    assert_clear_error(refused, "study 'old' has 1 trial running: stop the tuning first",
                       "counts as running until it has been silent for 30 s (grace_period)")
    # Its process killed: the trial stays running until a run fails it, and delete was refused for good.
    from autotune.storage import study as studies
    studies.set_attr(result.study, "settings", {**studies.get_attr(result.study, "settings"), "grace_period": 2})
    time.sleep(2.5)
    trials = len(result.study.trials)
    declined = CliRunner().invoke(main, ["delete", "old", "--storage", storage], input="n\n")
    assert declined.exit_code == 0 and len(result.study.trials) == trials     # declined: nothing failed or queued
    assert running.number in [t.number for t in result.study.get_trials(states=(optuna.trial.TrialState.RUNNING,))]
    deleted = run("delete", "old", "--storage", storage, "--yes")
    assert deleted.exit_code == 0 and "deleted study 'old'" in deleted.output
    assert run("list", "--storage", storage).output.strip() == f"no studies in {storage}"
    with engine.connect() as connection:
        assert connection.exec_driver_sql(claimed).scalar() == 0
    assert_clear_error(run("delete", "old", "--storage", storage, "--yes"), "no study named 'old'")
