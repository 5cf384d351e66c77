"""`autotune bench PLAN --config CONFIG`: a saved plan re-timed against fp32 at the shapes it will serve, with no
search and no eval_fn call past capturing inputs: what to run before deploying a tuned model."""
from __future__ import annotations

import click
import torch

from autotune.backends import held_dtype
from autotune.cli.base import CliError, main
from autotune.cli.study_commands import apply_saved_plan
from autotune.config import LatencyInput, load_config
from autotune.engines import get_engine
from autotune.measure.allocator import allocation_while_timing
from autotune.measure.latency import UNCERTAIN_RATIO
from autotune.measure.measurer import DeviceMeasurer, latency_by_shape, ratios_to_fp32
from autotune.measure.shapes import latency_shapes, weighted_ratio
from autotune.plan import summarize
from autotune.result import CONTENDED, MEDIANS_DISAGREE, medians_disagree


def batch_sizes(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = [int(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected batch sizes separated by commas, like 1,64; got {value!r}") from None
    if any(size < 1 for size in sizes):
        raise click.BadParameter(f"batch sizes must be at least 1; got {value!r}")
    return sizes


@main.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(exists=True, dir_okay=False))
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="the YAML config the model comes from")
@click.option("--shapes", callback=batch_sizes, default=None,
              help="batch sizes to time at, e.g. 1,64 (the captured batch resized) [default: the config's "
                   "latency_inputs, else the plan file's, else the captured batch]")
@click.option("--repeats", type=click.IntRange(min=3), default=None,
              help="most timing rounds per shape [default: the config's repeats]")
def bench(plan_path: str, config_path: str, shapes: list[int] | None, repeats: int | None) -> None:
    """Time a saved PLAN against fp32 at several input shapes (torch.utils.benchmark Compare table)."""
    config = load_config(config_path)
    tuning = config.tuning
    applied = apply_saved_plan(config, plan_path)
    if shapes is not None:
        tuning = tuning.model_copy(update={"latency_inputs": [LatencyInput(batch=size) for size in shapes]})
    elif not tuning.latency_inputs and applied.latency_inputs:    # the calls tuning chose to time (a generation's)
        tuning = tuning.model_copy(update={"latency_inputs": applied.latency_inputs})
    device = torch.device(tuning.device)
    at = latency_shapes(tuning, applied.batches, device, applied.fp32)
    plan_name = f"plan ({applied.engine})"
    models = {"fp32": applied.fp32, plan_name: get_engine(applied.engine).runnable(applied.built)}
    allocation_while_timing(tuning.steady_allocation)     # timed as the tuner timed it
    try:
        timing = latency_by_shape(DeviceMeasurer(tuning), models, at, repeats or tuning.repeats)
    except RuntimeError as exc:     # e.g. a factory's inputs the model cannot take
        raise CliError(f"timing failed: {type(exc).__name__}: {exc}") from None
    threads = tuning.num_threads or torch.get_num_threads()
    label = f"{type(applied.fp32).__name__} {summarize(applied.plan, held_dtype(applied.fp32))}"
    compare = torch.utils.benchmark.Compare([stats.measurement(label, shape, name, threads)
                                             for shape, by_model in timing.items()
                                             for name, stats in by_model.items()])
    # untrimmed: Compare trims to the digits a noisy timing's spread leaves, 30.4 and 14.6 ms showed as 30 and 10
    click.echo(str(compare).strip())
    ratios = ratios_to_fp32(timing, plan_name)
    for shape in at:
        t = timing[shape.name]
        off = t[plan_name].ratio_uncertainty(t["fp32"])
        noise = f" (±{100 * off:.0f} %: noisy timing; time it again on a quieter machine)" if off > UNCERTAIN_RATIO \
            else ""
        click.echo(f"{shape.name} (weight {shape.weight:g}): {1 / ratios[shape.name]:.2f}x fp32  "
                   f"(plan {t[plan_name].median_ms:.3f} ± {t[plan_name].spread_ms:.3f} ms, "
                   f"fp32 {t['fp32'].median_ms:.3f} ± {t['fp32'].spread_ms:.3f} ms, {t['fp32'].repeats} rounds){noise}")
        if medians_disagree(t[plan_name].median_ms / t["fp32"].median_ms, ratios[shape.name]):
            click.echo(f"  {MEDIANS_DISAGREE.format(where='in the table', what='plan')}")
    click.echo(f"weighted over the shapes: {1 / weighted_ratio(ratios, at):.2f}x fp32")
    if busy := [shape.name for shape in at if any(stats.contended for stats in timing[shape.name].values())]:
        click.echo(f"note: {CONTENDED.format(shapes=', '.join(busy), how='')}", err=True)
