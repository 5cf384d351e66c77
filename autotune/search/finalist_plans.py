"""Which plans become finalists, per engine: the fastest passing trials, the uniform plans whose dtype can pay
(`too_slow`) and that their own trials did not miss by far, fp32 where the engine can make it faster; and which
model-level knobs are worth trying on them. `finalists` builds and races what these choose, each a `Finalist`."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from optuna.trial import FrozenTrial
from torch import nn

from autotune.config.tuning import TuningConfig
from autotune.engines import KNOBS, EagerEngine, Engine, Knob, get_engine
from autotune.engines.knobs import MATMUL_MODULES
from autotune.measure.module_latency import HOPELESS_RATIO
from autotune.plan import Plan, is_baseline, low_dtype, plan_key, plan_of_key, summarize, uniform_plan
from autotune.search.trials import TrialRunner
from autotune.storage import study as studies

log = logging.getLogger("autotune")

FAR_MISS = 2.0     # tolerances a uniform plan's own trial lost, from which no engine makes that plan a finalist
# The least share of the timed modules' fp32 time a knob's modules (Knob.acts_on) take for it to be tried: under it,
# even making them free gains less than the finalists' race tells apart. A ViT's patch convolution, 3 % of it, cost
# channels_last four finalists (25 s of a 220 s run) that raced no faster.
KNOB_MIN_SHARE = 0.05
# How many times a passing plan's time a uniform plan's modules took eagerly, where they took no less than their
# fp32 time, for it to be no finalist (without_outrun).
OUTRUN = 1.5
EDGE = 0.08        # share of the tolerance within which a trial's loss is near enough to miss compiled (_at_the_edge)


@dataclass
class Finalist:
    """A plan built in an engine (with knobs), ready to race and evaluate."""

    plan: Plan
    engine: str
    built: nn.Module        # the plan as built, before any compiling: what export / apply save
    runnable: nn.Module     # what is timed, evaluated and returned
    setup_s: float          # building it and its first calls (compilation) at every shape
    knobs: tuple[str, ...] = ()   # model-level knobs set before the plan was realised


def finalist_plans(runner: TrialRunner, engine: Engine, uniform: dict[str, Plan]) -> dict[str, Plan]:
    """Of the passing trials `engine` can realise: the fastest (_fastest_worth_building) and the fastest uniform plan,
    so the winner is never slower than the best uniform dtype in the re-timing (trial timings on a noisy host can rank
    them wrong). Chosen per engine: the fastest eager plans may hold dtypes a compiled engine cannot realise.

    The eager and compiled engines also get the fastest passing trial's parts of one dtype (dtype_parts) they can
    realise.
    The fastest uniform plan is one of a dtype `uniform` holds.
    Every engine also gets each plan of `uniform` (uniform_finalists) it can realise (an engine building plans as
    the trials ran them, those they did not evaluate): the search predicts costs from modules timed alone, which
    misses what they do to their neighbours (on MiniLM three bf16 modules predicted faster than int8 made the
    model slower than all-int8) and what a compiler fuses (int8 convolutions, slower alone, fused by inductor).
    Such a plan is re-evaluated before it can win, like every finalist."""
    passing = [t for t in studies.passing_trials(runner.study)
               if not is_baseline(plan := studies.trial_plan(t)) and engine.unsupported(plan, runner.fp32) is None]
    # Not of a dtype left out of `uniform` as unable to pay: on an AMX Xeon Seed-OSS's uniform fp16 passed its trial
    # at 1.04x fp32's time, and compiled in two engines for 20 s, raced behind fp32 compiled.
    uniform_keys = {plan_key(runner.space.expand(plan)) for plan in runner.space.uniform_plans()
                    if low_dtype(plan) in uniform}
    best_uniform = [t for t in passing if studies.trial_plan_key(t) in uniform_keys][:1]
    trials = _fastest_worth_building(passing, engine, runner.config.tolerable_loss) + best_uniform
    plans = {f"trial {t.number}": studies.trial_plan(t) for t in trials}
    known = {plan_key(plan) for plan in plans.values()}
    if builds_as_trials(engine):   # an evaluated plan is a finalist above by its outcome or not
        known |= {studies.trial_plan_key(t) for t in studies.evaluated_trials(runner.study)}
    takes_parts = engine.name == "eager" or not (builds_as_trials(engine) or engine.lowers_unplanned)  # dtype_parts
    more = {**(dtype_parts(runner) if takes_parts else {}), **{f"uniform {d}": plan for d, plan in uniform.items()}}
    for name, plan in more.items():
        if plan_key(plan) not in known and engine.unsupported(plan, runner.fp32) is None:
            plans[name] = plan
            known.add(plan_key(plan))
    return plans


def _fastest_worth_building(passing: list[FrozenTrial], engine: Engine, tolerance: float) -> list[FrozenTrial]:
    """Of the passing trials, fastest first, the three fastest; in an engine that compiles the eager plan (inductor),
    the fastest and the fastest whose plan holds no int8 module. Its int8 modules run eagerly between compiled graphs,
    so the search's near-twin plans rank there as their eager timings did (the eager engine times those), while each
    costs a compile: across 54 runs of the sweeps its trial-plan finalists took 646 s of compiling in 149 builds and
    won twice (the fastest trial, and a MobileNet's third, which held no int8), each by 1-12 % over the next.
    Where each of those lost within EDGE of the tolerance in its trial, inductor also gets the fastest that lost
    less (_at_the_edge)."""
    if engine.name == "eager" or not builds_as_trials(engine):
        return passing[:3]
    whole = [t for t in passing if "int8" not in studies.trial_plan(t).values()][:1]
    chosen = passing[:1] + [t for t in whole if t not in passing[:1]]
    if all(_at_the_edge(t, tolerance) for t in chosen):
        chosen += [t for t in passing if not _at_the_edge(t, tolerance)][:1]
    return chosen


def _at_the_edge(trial: FrozenTrial, tolerance: float) -> bool:
    """Whether a passing trial lost within EDGE of the tolerance: compiled, its plan rounds otherwise than eagerly,
    which moves its loss by about that much either way. In the sweeps' inductor finalists of bf16 plans, compiled
    losses were their trials' ±0.0007 (tolerance 0.01); the three whose trials lost 0.0093-0.0095 all missed by one to
    three predictions in 4096 (BitNet, Seed-OSS, GLM-4), and GLM-4 returned fp32 compiled where trials at 0.0073 and
    0.0081 had passed at 0.88x fp32's predicted time. Those at 0.0090 passed."""
    return trial.user_attrs.get("accuracy_loss", 0.0) > (1 - EDGE) * tolerance


def dtype_parts(runner: TrialRunner) -> dict[str, Plan]:
    """The fastest passing trial's plan with only the modules of one of its lowered dtypes lowered, the others fp32,
    for each dtype, where it mixes several ({"trial 8, int8 alone": plan}). Lowering fewer modules, each keeps the
    tolerance as the search assumes (its re-evaluation checks), and timed alone the dtypes' modules missed what they
    do to each other: on a ConvNeXt the search's best, bf16×12 int8×26 fp32×3, ran at 0.53x fp32 eagerly, its int8
    modules alone at 0.41x, and no engine realising int8 only (pt2e's kernels) got a plan to build. Each costs a
    compile in an engine that compiles, so they go to the eager engine and the compiled one: not to inductor, whose
    int8 modules run eagerly between graphs, as the eager engine times them, nor to lowp, which runs the whole model
    in bf16, broken by a part's fp32 modules (on a Swin, ConvNeXt and U-Net its bf16 part raced at 1.04-1.65x the time
    of lowp's fastest other finalist, after 7-33 s of compiling)."""
    passing = [t for t in studies.passing_trials(runner.study) if not is_baseline(studies.trial_plan(t))]
    if not passing:
        return {}
    fastest = studies.trial_plan(passing[0])
    lowered = sorted(set(fastest.values()) - {"fp32"})
    if len(lowered) < 2:
        return {}
    return {f"trial {passing[0].number}, {dtype} alone": {name: chosen if chosen == dtype else "fp32"
                                                           for name, chosen in fastest.items()}
            for dtype in lowered}


def uniform_finalists(candidates: dict[str, list[str]], latency: dict[str, dict[str, float]]) -> dict[str, Plan]:
    """{dtype: its uniform plan} for each lowered dtype `too_slow` finds no reason against."""
    plans = {}
    for dtype in sorted({d for options in candidates.values() for d in options} - {"fp32"}):
        reason = too_slow(candidates, latency, dtype)
        if reason is None:
            plans[dtype] = uniform_plan(candidates, dtype)
        else:   # int8: see own_int8
            log.info("uniform %s is not a finalist%s: %s", dtype,
                     " of the engines running eager modules" if dtype == "int8" else "", reason)
    return plans


def own_int8(candidates: dict[str, list[str]], uniform: dict[str, Plan]) -> dict[str, Plan]:
    """The uniform int8 plan where `uniform` lacks it for its eager timings, for the engines that run int8 in
    kernels of their own (the compiled engine: oneDNN's, fused with the quantisation around them), which those
    timings do not bound: a ShuffleNet's int8 modules took 2.2x their fp32 time eagerly, and its uniform int8 plan
    through pt2e and inductor ran 1.97x faster than fp32."""
    if "int8" in uniform or not any("int8" in options for options in candidates.values()):
        return {}
    return {"int8": uniform_plan(candidates, "int8")}


def without_far_misses(runner: TrialRunner, uniform: dict[str, Plan]) -> dict[str, Plan]:
    """`uniform` without the plans whose own trial lost FAR_MISS tolerances or more (each left out is logged). An
    engine realises a plan in numerics of its own (static activation ranges, the whole model in the low dtype), but
    not that much closer to fp32: on a MobileNet the compiled engine's uniform int8 lost 9 tolerances where its
    trial lost 19 (on an MLP 2.6 where its trial lost 2.9), and building it, with its knob's twin, cost 30 s of
    compiling and an eval_fn call to find that out. In the sweeps of unseen models, each compiled uniform int8
    whose int8 trials had lost 2.3-3.8 tolerances (Falcon, AST, SigLIP, U-Net, xLSTM) missed again, after 10-47 s
    of compiling."""
    runner.refresh()   # trials other workers ran
    kept = {}
    for dtype, plan in uniform.items():
        lost, tried = lost_by(runner, plan)
        if lost is not None and lost >= FAR_MISS:
            whose = "its trial" if tried == plan else f"{summarize(tried)}, a part of it,"
            log.info("uniform %s is not a finalist: %s lost %.1f tolerances", dtype, whose, lost)
        else:
            kept[dtype] = plan
    return kept


def without_outrun(runner: TrialRunner, uniform: dict[str, Plan], latency: dict[str, dict[str, float]]
                   ) -> dict[str, Plan]:
    """`uniform` without the plans of the float dtypes whose modules took no less than their fp32 time eagerly and
    OUTRUN times or more that of a lowered plan that passed its trial (each left out is logged). Such a dtype's
    kernels are no faster than fp32's: compiled, its plan runs about as the fp32 plan compiled does, far behind that
    passing plan. On an AMX Xeon (avx512_fp16, but fp16 matmuls at fp32's speed), ImageGPT's, ViTDet's and SigLIP-2's
    fp16 modules took 1.15-1.34x their fp32 time eagerly, 2.5-3.6x a passing plan's; their uniform fp16 plans,
    compiled in the inductor and lowp engines, raced at 0.86-1.18 of fp32's time, as fp32 compiled did (0.89-1.09),
    where the winners raced at 0.47-0.60, after 17-43 s of compiling. A dtype with faster kernels
    (bf16 where the CPU has them, fp16 on a GPU) stays: compiling can take it past a plan faster eagerly."""
    passing = [plan for key, outcome in runner.outcomes.items()
               if outcome.passed and not is_baseline(plan := plan_of_key(key))]
    if not passing:
        return uniform
    fastest = min(passing, key=lambda plan: _eager_ms(plan, latency))
    kept = dict(uniform)
    for dtype, plan in uniform.items():
        if dtype == "int8":   # compiled kernels of its own (own_int8)
            continue
        ms, fp32_ms = _eager_ms(plan, latency), _eager_ms({name: "fp32" for name in plan}, latency)
        ratio = ms / max(_eager_ms(fastest, latency), 1e-12)
        if ms >= fp32_ms and ratio >= OUTRUN:
            log.info("uniform %s is not a finalist: its modules took %.2fx their fp32 time eagerly, and %.1fx the "
                     "time of %s, which passed its trial", dtype, ms / fp32_ms, ratio, summarize(fastest))
            del kept[dtype]
    return kept


def _eager_ms(plan: Plan, latency: dict[str, dict[str, float]]) -> float:
    """The plan's tuned modules' summed eager time, each in its dtype (modules never timed count nothing)."""
    return sum(latency[name][dtype] for name, dtype in plan.items() if name in latency and dtype in latency[name])


def trial_missed(runner: TrialRunner, plan: Plan) -> bool:
    """Whether `plan`'s own trial missed the tolerance or a tried plan lowering only modules it lowers, each as it
    does (lost_by). An engine's numerics may still pass it, so it stays a finalist (short of FAR_MISS), but it is
    built after the others."""
    if (outcome := runner.outcomes.get(plan_key(plan))) is not None:
        return not outcome.passed
    lost, _ = lost_by(runner, plan)
    return lost is not None and lost > 1


def lost_by(runner: TrialRunner, plan: Plan) -> tuple[float | None, Plan | None]:
    """The tolerances `plan`'s own trial lost; where it was never tried, the most a tried plan lost that lowers
    only modules `plan` lowers, each to the dtype `plan` gives it: lowering more of them loses as much or more, as
    the search assumes (a Mamba's uniform int8, never tried, was compiled in three engines, where int8×7 fp32×3 had
    lost 20). With the plan tried (`plan` itself, or that part of it); (None, None) where none was."""
    outcome = runner.outcomes.get(plan_key(plan))
    if outcome is not None:
        return outcome.tolerances_lost, plan
    worst: tuple[float | None, Plan | None] = (None, None)
    for key, tried in runner.outcomes.items():
        part = plan_of_key(key)
        changed = [name for name, chosen in part.items() if chosen != "fp32"]
        if (changed and all(plan.get(name) == part[name] for name in changed)
                and tried.tolerances_lost is not None and tried.tolerances_lost > (worst[0] or 0.0)):
            worst = (tried.tolerances_lost, part)
    return worst


def below_a_missed_plan(runner: TrialRunner, engine: str, plan: Plan, knobs: tuple[str, ...] = ()) -> str | None:
    """Why `plan` in `engine` with `knobs` would miss: it lowers every module of a tried plan that missed, each as
    that plan did (lost_by), and lowering more loses as much or more, as the search assumes. An engine building
    plans as the trials ran them (eager, inductor) runs the plan itself: a SigLIP's uniform int8 was evaluated
    eagerly to lose 3.1 tolerances, as int8×40 fp32×1 had in its trial. The lowp engine runs the whole model but its
    fp32 islands in the plan's low dtype, a knob running matmuls low (autocast) every Linear and convolution
    (MATMUL_MODULES): on Falcon, Gemma-3, LFM2 and UperNet uniform bf16 missed its trial by 1.2-3.8 tolerances, and
    each of 11 such finalists (lowp's uniform bf16, the best plan with autocast, eagerly and compiled) was built,
    then cost an eval_fn call to miss by as much. None where no such plan missed, or where the engine runs the plan
    in numerics of its own (the compiled engine: see FAR_MISS)."""
    lowering = [(name, low) for name in knobs if (low := KNOBS[name].runs_in(runner.fp32)) is not None]
    if engine == "lowp":
        runs, how = plan, f" (and the lowp engine runs the modules outside the plan in {low_dtype(plan)} too)"
    elif lowering:
        (knob, dtype), modules = lowering[0], dict(runner.fp32.named_modules())
        runs = {name: dtype if chosen == "fp32" and isinstance(modules.get(name), MATMUL_MODULES) else chosen
                for name, chosen in plan.items()}
        how = f" ({knob} runs its Linear and convolution modules in {dtype})"
    elif builds_as_trials(get_engine(engine)):
        runs, how = plan, ""
    else:
        return None
    lost, tried = lost_by(runner, runs)
    if lost is None or lost <= 1:
        return None
    return (f"it runs every module {summarize(tried, runner.kept)} lowered as that plan did{how}, and that plan lost "
            f"{lost:.1f} tolerances in its trial")


def too_slow(candidates: dict[str, list[str]], latency: dict[str, dict[str, float]], dtype: str) -> str | None:
    """Why running the modules that may take `dtype` in it cannot pay, even compiled: it is not a dtype tuned
    here, or they took HOPELESS_RATIO times their fp32 time or more in all, run eagerly. Compiling fuses the casts
    and quantisation around a dtype's kernels, never makes the kernels themselves several times faster (bf16 and
    fp16 on a CPU that emulates them measure 4-25x slower: trying them costs a compile and seconds of timing)."""
    lowered = [name for name, options in candidates.items() if dtype in options]
    if not lowered:
        return f"{dtype} is not among the dtypes tuned"
    fp32_ms = sum(latency[n]["fp32"] for n in lowered)
    ratio = sum(latency[n][dtype] for n in lowered) / fp32_ms if fp32_ms > 0 else 1.0
    return f"its modules took {ratio:.1f}x their fp32 time in {dtype}, eagerly" if ratio >= HOPELESS_RATIO else None


def engine_plans(runner: TrialRunner, engine: Engine, uniform: dict[str, Plan], every: dict[str, Plan]
                  ) -> dict[str, Plan]:
    """`engine`'s finalist plans, fastest first, and fp32 in every engine but eager (the reference): an engine can
    make fp32 itself faster. In the engine compiling the eager plan (inductor) fp32 comes first: it is plain
    torch.compile of the model, the peer a user would pick without autotune, and it passes. Last, under a timeout
    the other finalists took the time, and a Mixtral returned fp32 eager where torch.compile ran it 2.4x faster."""
    plans = finalist_plans(runner, engine, uniform if builds_as_trials(engine) else every)
    for name, plan in list(plans.items()):
        if (below := below_a_missed_plan(runner, engine.name, plan)) is not None:
            log.info("%s (%s) is not a finalist: %s", name, engine.name, below)
            del plans[name]
    if engine.name == "eager" or engine.unsupported(fp32 := fp32_plan(runner), runner.fp32) is not None:
        return plans
    return {"fp32": fp32, **plans} if builds_as_trials(engine) else {**plans, "fp32": fp32}


def knobs_to_try(runner: TrialRunner, candidates: dict[str, list[str]], latency: dict[str, dict[str, float]]
                  ) -> list[str]:
    """The configured knobs the model has a use for; each other one's reason is logged and kept on the study
    (`knobs_not_tried`), e.g. the CUDA knobs on a CPU model, or autocast in a dtype `too_slow` rules out."""

    def why_not(knob: Knob) -> str | None:
        low = knob.runs_in(runner.fp32)
        return knob.supports(runner.fp32) or too_little_to_gain(knob, runner.fp32, latency) or (
            too_slow(candidates, latency, low) or kept_from_tuning(runner.config) if low else None)

    not_tried = {name: reason for name in runner.config.knobs if (reason := why_not(KNOBS[name]))}
    for name, reason in not_tried.items():
        log.info("knob %s is not tried: %s", name, reason)
    studies.set_attr(runner.study, "knobs_not_tried", not_tried)
    return [name for name in runner.config.knobs if name not in not_tried]


def too_little_to_gain(knob: Knob, model: nn.Module, latency: dict[str, dict[str, float]]) -> str | None:
    """Why `knob` is not worth its finalists: the modules it acts on take under KNOB_MIN_SHARE of the timed modules'
    fp32 time. None where it reaches the whole model, or where some of those modules were not timed (their share
    is then unknown)."""
    if not knob.acts_on:
        return None
    acting = [name for name, module in model.named_modules() if isinstance(module, knob.acts_on)]
    total = sum(costs["fp32"] for costs in latency.values())
    if not acting or total <= 0 or any(name not in latency for name in acting):
        return None
    share = sum(latency[name]["fp32"] for name in acting) / total
    if share >= KNOB_MIN_SHARE:
        return None
    kinds = "/".join(kind.__name__ for kind in knob.acts_on)
    return (f"its {kinds} modules take {100 * share:.1f} % of the timed modules' fp32 time, too little to gain "
            f"from (under {100 * KNOB_MIN_SHARE:g} %)")


def kept_from_tuning(config: TuningConfig) -> str | None:
    """Why an engine or knob that runs modules outside the plan in a low dtype (the lowp engine, autocast) is not
    tried: the config's include / exclude keep modules out of tuning, in fp32. None where they keep none out."""
    if any(mixed.include or mixed.exclude for mixed in config.config_set):
        return ("include / exclude keep modules out of tuning, in fp32, and it would run them in a low dtype too "
                "(the lowp engine: the whole model; autocast: every matmul)")
    return None


def builds_as_trials(engine: Engine) -> bool:
    """Whether `engine` builds plans as the trials ran them (modules swapped, eagerly), so that what accuracy is
    measured on is the same model: the eager engine, and the inductor engine, which compiles only what it times."""
    return type(engine).build is EagerEngine.build


def fp32_plan(runner: TrialRunner) -> Plan:
    return runner.space.expand({unit: "fp32" for unit in runner.space.choices})
