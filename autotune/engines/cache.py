"""Finalists of compiling engines kept on disk between runs of a study, so a resumed study rebuilds and
recompiles nothing it did before: each finalist as built (saved the way `autotune apply` saves it), by engine
and plan, and the compiler's own artefacts (`torch.compiler.save_cache_artifacts`). Machine-local: compiled code
is specific to the CPU or GPU it was made for, so each machine keeps its own."""
from __future__ import annotations

import functools
import hashlib
import logging
import re
from pathlib import Path

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines.base import Calibration, Engine, why_not_written
from autotune.engines.knobs import with_knobs
from autotune.engines.quiet import library_notes_dropped
from autotune.errors import describe
from autotune.plan import Plan, plan_id

log = logging.getLogger("autotune")
COMPILER_ARTEFACTS = "compiler.bin"


@functools.cache
def code_version() -> str:
    """A hash of this package's source: a finalist built by other code (another release, a local change to how an
    engine builds) is built again, not read back as that code left it."""
    digest = hashlib.sha1()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


class CompileCache:
    def __init__(self, folder: Path | None):
        self.folder = folder   # None: nothing is kept
        self.unkept: list[str] = []   # finalists built but not kept: torch.save could not pickle them

    @classmethod
    def for_study(cls, root: str | None, study_name: str, built_from: str) -> CompileCache:
        """The folder of one study's finalists built from one model and its calibration batches (`built_from`,
        storage.study.built_from) by this code (`code_version`)."""
        folder = f"{built_from}-{code_version()}"
        safe = re.sub(r"[^\w.-]", "_", study_name)
        if set(safe) <= {"."}:    # "." or "..": the root itself, or out of it
            safe = "_" * len(safe)
        return cls(Path(root) / safe / folder if root else None)

    def build(self, engine: Engine, fp32: nn.Module, plan: Plan, calibration: Calibration,
              inputs: CallInputs, knobs: tuple[str, ...] = ()) -> nn.Module:
        """`plan` built in `engine` on `fp32` set with `knobs`: read back if this study built it before, else
        built and kept (the knobs are applied only when it is built)."""
        if self.folder is None or engine.name == "eager":    # eager builds cost less than reading them back
            return engine.build(with_knobs(fp32, knobs), plan, calibration)
        path = self.folder / ("-".join([engine.name, plan_id(plan), *knobs]) + ".built")
        if path.is_file():
            try:
                with library_notes_dropped():   # the line below says why it cannot be read
                    return engine.load(str(path))
            except Exception as exc:  # a file of another torch version, or cut short: build it again
                log.warning("compile cache: cannot read %s (%s); building again", path, describe(exc))
        built = engine.build(with_knobs(fp32, knobs), plan, calibration)
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        try:
            engine.save(built, inputs, str(partial))
        except Exception as exc:  # a model torch.save cannot pickle (parametrized modules, e.g. weight_norm)
            partial.unlink(missing_ok=True)
            if not self.unkept:    # the same for every finalist of the model: said once
                log.warning("compile cache: cannot keep this model's finalists (%s); a resumed run builds them "
                            "again", why_not_written(exc))
            self.unkept.append(path.name)
            return built
        partial.replace(path)
        return built

    def load_compiler_artefacts(self) -> bool:
        """Hands the compiler what it kept for this study; whether there was anything."""
        path = self.folder / COMPILER_ARTEFACTS if self.folder else None
        if path is None or not path.is_file():
            return False
        return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None

    def save_compiler_artefacts(self) -> None:
        """Keeps what the compiler made in this process (for this study's finalists, and whatever else it
        compiled here: the artefacts are not told apart by model)."""
        saved = torch.compiler.save_cache_artifacts() if self.folder else None
        if saved is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / (COMPILER_ARTEFACTS + ".partial")
        partial.write_bytes(saved[0])
        partial.replace(self.folder / COMPILER_ARTEFACTS)
