"""Which study a run reuses: a study's trials hold for the weights they were evaluated on, so a retrained model of
the same class and search space is tuned afresh, while a model built again elsewhere (last bits apart) resumes."""
import sys
from pathlib import Path

import pytest
import torch

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.errors import StudyMismatchError
from autotune.storage.study import same_weights, weights_signature

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from simulator import SimWorkload  # noqa: E402


def tune(sim, model, storage, study_name=None, tolerable_loss=0.01, eval_fn=None, dtypes=("int8", "bf16", "fp32"),
         max_trials=4):
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=list(dtypes)),
                          tolerable_loss=tolerable_loss, max_trials=max_trials, repeats=3, storage=storage,
                          study_name=study_name)
    return autotune(model, config, eval_fn or sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())


def scaled(model, factor):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(factor)
    return model


def test_a_retrained_model_is_tuned_in_a_study_of_its_own_and_each_set_of_weights_resumes_its_own(storage):
    sim = SimWorkload(6, eval_cost_s=0)
    first = tune(sim, sim.model(), storage)
    name = first.study.study_name
    retrained = tune(sim, scaled(sim.model(), 1.01), storage)
    assert retrained.study.study_name == f"{name}.2"
    assert retrained.trials_evaluated >= 4 and retrained.eval_calls >= 4      # searched, not read back
    again = tune(sim, sim.model(), storage)
    assert again.study.study_name == name and again.trials_evaluated == first.trials_evaluated
    assert again.eval_calls < first.eval_calls                                 # resumed: no trial evaluated again
    rebuilt = tune(sim, scaled(sim.model(), 1 + 1e-7), storage)   # another CPU's last bits
    assert rebuilt.study.study_name == name


def test_a_named_study_tuned_on_other_weights_is_refused_with_the_reason(storage):
    sim = SimWorkload(6, eval_cost_s=0)
    tune(sim, sim.model(), storage, study_name="mine")
    with pytest.raises(StudyMismatchError, match=r"study 'mine' in .* was tuned on other weights of this model"):
        tune(sim, scaled(sim.model(), 1.01), storage, study_name="mine")


def test_a_named_study_resumed_with_other_dtypes_is_refused_saying_what_differs(storage):
    """It said "(6 modules there, 6 here)", which told nothing of what changed."""
    sim = SimWorkload(6, eval_cost_s=0)
    tune(sim, sim.model(), storage, study_name="mine")
    with pytest.raises(StudyMismatchError, match=r"was made for other modules or dtypes \(6 modules there, 6 here: "
                                                 r"\S+: int8/bf16/fp32 there, int8/fp32 here; .*; 3 more\)"):
        tune(sim, sim.model(), storage, study_name="mine", dtypes=("int8", "fp32"))


def test_a_named_study_resumed_with_another_accuracy_requirement_is_refused_with_the_reason(storage):
    """Its trials' pass or fail was judged against the first requirement: `show` then marked one plan at one score
    passing in one trial and failing in another."""
    sim = SimWorkload(6, eval_cost_s=0)
    tune(sim, sim.model(), storage, study_name="mine")
    with pytest.raises(StudyMismatchError, match=r"study 'mine' in .* was tuned to another accuracy requirement "
                                                 r"\(\{'tolerable_loss': 0.01, .*here \{'tolerable_loss': 0.05"):
        tune(sim, sim.model(), storage, study_name="mine", tolerable_loss=0.05)


def test_a_study_resumed_on_another_thread_count_is_warned_of_and_the_report_names_both(storage, caplog):
    """A study tuned on 1 thread and resumed on 2 said nothing, and its report read "threads while timing: 2" for
    trials all timed on 1."""
    import logging

    from autotune.report import html_report
    sim = SimWorkload(6, eval_cost_s=0)

    def run(threads, max_trials):
        config = TuningConfig(engines=["eager"], max_trials=max_trials, repeats=3, storage=storage,
                              study_name="mine", num_threads=threads)
        return autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())
    run(1, 3)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        result = run(2, 5)
    assert ("study 'mine' holds timings taken on 1 thread; this run times on 2 threads, and its latency ratios are "
            "compared with those (num_threads: 1 keeps them alike)") in caplog.text
    settings = result.study.user_attrs["autotune.settings"]
    assert settings["num_threads"] == 2 and settings["num_threads_earlier"] == [1]
    assert "threads while timing in earlier runs" in html_report(result.study)


def test_a_tuned_study_run_again_on_data_that_scores_otherwise_is_refused_not_handed_back(storage, caplog):
    """The study is named after the model and config, not eval_fn's data: run again on other data, it handed back
    the plan judged against the old scores, with the old baseline score as the baseline's, in no eval_fn call."""
    sim = SimWorkload(6, eval_cost_s=0)
    first = tune(sim, sim.model(), storage)
    again = tune(sim, sim.model(), storage)
    assert again.study.study_name == first.study.study_name and again.plan == first.plan
    with pytest.raises(StudyMismatchError, match=f"eval_fn scores the fp32 model .* where study "
                                                 f"'{first.study.study_name}' recorded .* its data or metric changed"):
        tune(sim, sim.model(), storage, eval_fn=lambda model: sim.eval_fn(model) * 0.9)
    with caplog.at_level("WARNING", logger="autotune"):
        near = tune(sim, sim.model(), storage, eval_fn=lambda model: sim.eval_fn(model) * 0.999)
    assert near.plan == first.plan and ("within the tolerance: this process judges plans against the score now (and "
                                        "scores a recorded best again)") in caplog.text
    # What it reports is scored on the data now: the baseline and the plan both, not the study's old figures.
    assert near.baseline.accuracy == pytest.approx(sim.eval_fn(sim.model()) * 0.999)
    assert near.best.accuracy == pytest.approx(sim.eval_fn(near.model) * 0.999)


def test_a_study_whose_search_goes_on_on_data_that_scores_otherwise_is_refused_before_any_trial(storage, caplog):
    """Resumed with a larger max_trials on another eval set, its new plans were judged against the old baseline's
    score: all failed, for good, and the recorded best was overwritten by fp32."""
    from autotune.storage.study import evaluated_trials

    sim = SimWorkload(6, eval_cost_s=0)
    first = tune(sim, sim.model(), storage, max_trials=3)
    made = len(first.study.trials)
    with pytest.raises(StudyMismatchError, match="its data or metric changed since"):
        tune(sim, sim.model(), storage, max_trials=6, eval_fn=lambda model: sim.eval_fn(model) * 0.9)
    assert len(first.study.trials) == made                         # refused before any trial
    calls = []
    with caplog.at_level("WARNING", logger="autotune"):
        near = tune(sim, sim.model(), storage, max_trials=6,
                    eval_fn=lambda model: calls.append(1) or sim.eval_fn(model) * 0.999)
    assert "within the tolerance: this process judges plans against the score now" in caplog.text
    fp32 = sim.eval_fn(sim.model()) * 0.999
    new = [t for t in evaluated_trials(near.study) if t.number >= made]
    assert new and near.baseline.accuracy == pytest.approx(fp32) and near.eval_calls == len(calls)
    assert all(TuningConfig().passes(fp32, t.user_attrs["accuracy"]) == t.user_attrs["passed"] for t in new)
    assert any(t.user_attrs["passed"] for t in new)


@pytest.mark.parametrize("stopped", ["after its baseline", "during its signals", "run again when done"])
def test_a_study_resumed_at_any_point_on_data_that_scores_otherwise_is_refused(storage, stopped):
    """A count of trials told one run from the next: a study stopped before its first trial, or run again once done
    (no trial added) and then resumed with a larger max_trials, was not checked, and its new plans failed against
    the old score. Where its signals were still to be measured, the baseline was read back unchecked."""
    from autotune.storage import study as studies
    from autotune.tuner import start_runner

    sim = SimWorkload(6, eval_cost_s=0)
    if stopped == "run again when done":
        tune(sim, sim.model(), storage, max_trials=3)
        study = tune(sim, sim.model(), storage, max_trials=3).study
    else:
        config = TuningConfig(engines=["eager"], max_trials=3, repeats=3, storage=storage)
        study = start_runner(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer()).study
        if stopped == "during its signals":
            for signal in ("sensitivity", "module_latency_ms"):
                studies.set_attr(study, signal, None)
    made = len(study.trials)
    assert studies.get_attr(study, studies.BASELINE_ATTR) is not None
    with pytest.raises(StudyMismatchError, match="its data or metric changed since"):
        tune(sim, sim.model(), storage, max_trials=6, eval_fn=lambda model: sim.eval_fn(model) * 0.9)
    assert len(study.trials) == made


def test_a_recorded_best_that_misses_the_tolerance_on_data_scoring_otherwise_is_not_handed_back(storage, caplog):
    """Resumed on a changed eval set where fp32 scored within the tolerance of its recorded score, the recorded
    best was handed back with its old scores shown as current; scored on the new data it lost 1.15 % where 1 %
    was tolerable."""
    sim = SimWorkload(6, eval_cost_s=0)
    first = tune(sim, sim.model(), storage)
    top = sim.eval_fn(sim.model())

    def harsher(model):   # fp32 within the tolerance of its old score; every loss four times as large
        score = sim.eval_fn(model)
        return score * 0.999 - 3 * (top - score)
    config = TuningConfig(tolerable_loss=0.01)
    assert not config.passes(harsher(sim.model()), harsher(first.model)), "the old best misses on the new data"
    with caplog.at_level("WARNING", logger="autotune"):
        again = tune(sim, sim.model(), storage, eval_fn=harsher)
    assert "its finalists are chosen again" in caplog.text
    assert again.baseline.accuracy == pytest.approx(harsher(sim.model()))
    assert again.best.accuracy == pytest.approx(harsher(again.model))
    assert config.passes(again.baseline.accuracy, again.best.accuracy)


def test_weights_signatures_tell_models_apart_by_their_values_names_and_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    signature = weights_signature(model)
    assert set(signature) == set(model.state_dict())          # buffers too (running statistics)
    assert same_weights(signature, weights_signature(scaled(model, 1 + 1e-8)))
    assert not same_weights(signature, weights_signature(scaled(model, 1 + 1e-3)))
    model[1].running_var.fill_(2.0)
    assert not same_weights(signature, weights_signature(model))
    renamed = {f"x.{name}": value for name, value in signature.items()}
    assert not same_weights(signature, renamed)


def test_complex_weights_are_told_apart_by_their_imaginary_parts_too(recwarn):
    """A Fourier layer's complex weights were summed as their real parts (with torch's warning that the imaginary
    part is discarded): models differing there only read as the same weights."""
    def spectral(imaginary: float) -> torch.nn.Module:
        model = torch.nn.Module()
        model.weights = torch.nn.Parameter(torch.complex(torch.ones(4, 4), torch.full((4, 4), imaginary)))
        return model
    assert not same_weights(weights_signature(spectral(0.0)), weights_signature(spectral(5.0)))
    assert same_weights(weights_signature(spectral(5.0)), weights_signature(spectral(5.0)))
    assert not [w for w in recwarn if "imaginary" in str(w.message)]


def test_a_bf16_copy_of_a_model_is_another_set_of_weights(storage):
    """Its sums are the fp32 weights' to about 1e-6, within what tells a model built again elsewhere; its trials'
    scores are not theirs, so it is tuned in a study of its own (and a named fp32 study refuses it)."""
    from autotune.storage.rdb import open_storage
    from autotune.tuner import study_name_for

    torch.manual_seed(0)
    wide = torch.nn.Linear(2048, 2048, bias=False)   # 4M values: their rounding errors average out in the sums
    assert not same_weights(weights_signature(wide), weights_signature(wide.to(torch.bfloat16)))
    sim = SimWorkload(20, tolerable_loss=0.01)
    first = tune(sim, sim.model(), storage)
    half = sim.model().to(torch.bfloat16)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01)
    # (Its modules take no bf16 cast either, being bf16 already: its name differs from the first's at the root.)
    assert study_name_for(half, config, storage=open_storage(storage)) != first.study.study_name


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x, use_b=False):
        x = self.a(x)
        return self.b(x) if use_b else x


def test_resuming_a_study_whose_signals_lack_a_module_called_now_keeps_that_module_as_it_is(storage, caplog):
    """The study's signals were measured when eval_fn never reached `b`; a later run of it that does reach `b` tunes
    what the study knows and says what it leaves (it crashed with a KeyError)."""
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(32, 64)

    def agreement(use_b):
        reference = model(x, use_b=use_b).argmax(-1)
        return lambda m: float((m(x, use_b=use_b).argmax(-1) == reference).float().mean())
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.5, max_trials=2, repeats=3, study_name="branchy", storage=storage)
    autotune(model, config, agreement(False))
    resumed = autotune(model, config, agreement(True))
    assert "b" not in resumed.plan and type(resumed.model.b) is torch.nn.Linear
    assert "1 module(s) the study has no signals for stay as they are (b)" in caplog.text
