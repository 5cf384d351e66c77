"""Writing a realised plan to a file its engine's loader reads: what `autotune apply` and `TuningResult.save` do."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines import get_engine
from autotune.engines.base import why_not_written
from autotune.errors import SaveError


def saved_model_path(out: str, engine: str) -> str:
    """`out`, given the suffix the engine saves with where it has none (`.pt2`: the compiled engine's exported
    graph, for torch.export.load; `.pt`: the others' torch.save); a suffix the engine's loader cannot read is an
    error, since which engine wins differs from machine to machine.

    Raises:
        SaveError: `out`'s suffix is one the engine's loader cannot read.
    """
    if not Path(out).suffix:
        return out + (".pt2" if engine == "compiled" else ".pt")
    if Path(out).suffix == ".pt2" and engine != "compiled":
        raise SaveError(f"{out}: the {engine} engine saves the model with torch.save, which torch.export.load cannot "
                        f"read: name it {Path(out).with_suffix('.pt').name}, or give no suffix and let the engine "
                        "pick it (.pt2 is for the compiled engine's exported graph)")
    if Path(out).suffix != ".pt2" and engine == "compiled":    # a .pt, which a user hands to torch.load
        raise SaveError(f"{out}: the compiled engine saves the model as a torch.export graph, which torch.load cannot "
                        f"read: name it {Path(out).with_suffix('.pt2').name} (torch.export.load reads it), or give "
                        "no suffix and let the engine pick it")
    return out


def save_built(built: nn.Module, engine: str, inputs: CallInputs, out: str) -> tuple[str, str]:
    """Writes `built` (a plan as `engine` built it, before compiling) to `out` (saved_model_path), through a
    `.partial` file so a write cut short is never left at `out`; returns the path written and how to load it.

    Raises:
        SaveError: the name, or torch.save / torch.export.save refusing the model (each its own way).
    """
    out = saved_model_path(out, engine)
    partial = Path(out).with_name(Path(out).name + ".partial")
    try:
        loads_with = get_engine(engine).save(built, inputs, str(partial))
    except Exception as exc:
        partial.unlink(missing_ok=True)
        raise SaveError(f"cannot save the model in the {engine} engine: {why_not_written(exc)}") from exc
    partial.replace(out)
    return out, loads_with
