"""The house's lines, checked on the source: layers import only layers below them (so there is no import cycle),
no private module of optuna, torch or pydantic is imported, and no function runs over 60 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"

# Lowest first; a module may import modules of its own layer or of layers below it (README, "Architecture").
LAYERS = [
    ["autotune.errors", "autotune.tree", "autotune.clone", "autotune.timeout", "autotune.fused_paths"],
    ["autotune.backends"],
    ["autotune.config.tuning"],
    ["autotune.plan", "autotune.discovery", "autotune.capture", "autotune.model_call", "autotune.dataset_eval"],
    ["autotune.engines"],
    ["autotune.config"],
    ["autotune.storage"],
    ["autotune.measure"],
    ["autotune.search"],
    ["autotune.result", "autotune.tuner"],
    ["autotune.service"],
    ["autotune.report"],
    ["autotune.cli", "autotune.workloads", "autotune.__main__", "autotune"],
]
PRIVATE = re.compile(r"optuna\.[a-z_.]*\._|from optuna.*import _|\._storage|\._backend|__pydantic")
PRIVATE_MODULE = re.compile(r"^(optuna|torch|pydantic|pydantic_core)(\..*)?\._")
# The one exception, in one place (engines/frozen.py `_freezing`): inductor's `freezing` switch, which TorchDynamo
# reads from this module only (torch.compile's options reach inductor alone, and quantised graphs then fail to
# compile in torch 2.13); the x86 pt2e tutorial sets it there. Guarded: without it the engine runs unfrozen. The
# same module restores the pre-grad pass torchao's quantizer import sets for the whole process.
PRIVATE_ALLOWED = {"engines/frozen.py": {"torch._inductor", "torch._inductor.config"}}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer"
    return best[0]


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_every_module_imports_only_its_own_layer_or_those_below():
    known = modules()
    wrong = []
    for module, path in known.items():
        for target in imports(path):
            if target in known and layer(target) > layer(module):
                wrong.append(f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_within_a_layer():
    known = modules()
    graph = {module: {t for t in imports(path) if t in known and t != module} for module, path in known.items()}
    # a package's __init__ re-exports its modules; it is the importing side, never imported back by them
    graph = {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [module, target]))
            if target not in state:
                visit(target, trail + [module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_no_private_module_of_a_dependency_is_used():
    found = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        found += [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m in PRIVATE.finditer(text)]
        allowed = PRIVATE_ALLOWED.get(str(path.relative_to(PACKAGE)), set())
        found += [f"{path.name}: imports {name}" for name in imports(path)
                  if PRIVATE_MODULE.match(name) and name not in allowed]
    assert not found, "\n".join(found)


def test_no_function_runs_over_sixty_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
