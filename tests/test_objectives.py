"""objective: pareto keeps latency and accuracy loss as two objectives, so the study holds the Pareto front."""
import sys
from pathlib import Path

import pytest

from autotune import MixedPrecisionConfig, TuningConfig, autotune
from autotune.errors import StudyMismatchError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from simulator import SimWorkload  # noqa: E402


def tune(sim, storage, objective, study_name="objectives"):
    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=16, repeats=3, objective=objective, storage=storage, study_name=study_name)
    return autotune(sim.model(), config, sim.eval_fn, sim.example_inputs(), measurer=sim.measurer())


def test_pareto_study_holds_the_front_and_still_returns_the_fastest_passing_plan(storage):
    sim = SimWorkload(20, eval_cost_s=0)
    result = tune(sim, storage, "pareto")
    study = result.study
    assert len(study.directions) == 2
    front = study.best_trials
    assert front
    points = [(t.values[0], t.values[1]) for t in study.trials if t.values]
    for trial in front:   # no evaluated point beats a front point on both objectives
        assert not any(p[0] < trial.values[0] and p[1] < trial.values[1] for p in points)
    assert sim.passes(result.plan)
    passing = [t.values[0] for t in study.trials if t.values and t.user_attrs.get("passed")]
    assert result.speedup == pytest.approx(sim.speedup(result.plan), rel=0.05)
    assert min(passing) == pytest.approx(1 / sim.speedup(result.plan), rel=0.05)


def test_a_study_made_for_one_objective_is_not_reused_for_the_other_and_both_are_named(storage):
    """It said "was made for another objective (1 objectives)"."""
    sim = SimWorkload(6, eval_cost_s=0)
    tune(sim, storage, "latency", study_name="shared")
    with pytest.raises(StudyMismatchError, match="was made for objective latency, not pareto; use another study_name"):
        tune(sim, storage, "pareto", study_name="shared")
