"""Engines: how a whole plan is realised as a runnable model. `eager` swaps each module for its technique's
module (autotune.plan.apply_plan); `compiled` exports the model, quantises it with PyTorch 2 export
quantisation (torchao's X86InductorQuantizer, the plan's fp32 modules left out) and compiles it with inductor,
so adjacent int8 ops stay int8 and fuse; `inductor` compiles the eager plan whole with torch.compile; `lowp` runs
the whole model in the plan's low dtype with fp32 islands, compiled. Which one a plan runs in is decided by timing
them."""
from __future__ import annotations

from torch import nn

from autotune.engines.base import (
    CALLS_ITSELF,
    COMPILE_STATIC,
    ENTRIES,
    Calibration,
    Engine,
    EngineUnavailable,
    compile_model,
    why_not_written,
)
from autotune.engines.cache import CompileCache
from autotune.engines.eager import EagerEngine
from autotune.engines.inductor import InductorEngine
from autotune.engines.knobs import KNOBS, Knob, with_knobs
from autotune.engines.lowp import LowPrecisionEngine
from autotune.engines.pt2e import CompiledEngine
from autotune.plan import Plan

ENGINES: dict[str, Engine] = {"eager": EagerEngine(), "compiled": CompiledEngine(), "inductor": InductorEngine(),
                              "lowp": LowPrecisionEngine()}


def realise(fp32: nn.Module, plan: Plan, engine: str, calibration: Calibration) -> nn.Module:
    """`plan` on a copy of `fp32` in `engine`, reference numerics (what `apply` saves and accuracy is measured on).

    Raises:
        EngineUnavailable: the engine cannot realise this plan or run this model.
        KeyError: no engine has that name.
    """
    chosen = get_engine(engine)
    reason = chosen.unsupported(plan, fp32)
    if reason is not None:
        raise EngineUnavailable(reason)
    return chosen.build(fp32, plan, calibration)


def get_engine(name: str) -> Engine:
    """The engine called `name`.

    Raises:
        KeyError: no engine has that name.
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"no engine {name!r}; known: {sorted(ENGINES)}") from None


__all__ = ["CALLS_ITSELF", "COMPILE_STATIC", "ENTRIES", "Calibration", "CompileCache", "CompiledEngine", "EagerEngine",
           "Engine", "EngineUnavailable", "ENGINES", "compile_model", "InductorEngine", "KNOBS", "Knob",
           "LowPrecisionEngine", "get_engine", "realise", "why_not_written", "with_knobs"]
