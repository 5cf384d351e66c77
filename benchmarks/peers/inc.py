"""Intel Neural Compressor 3.x as a peer: its `autotune(model, tune_config, eval_fn)` under our tolerance and budget.

    from benchmarks.peers.inc import run_inc
    out = run_inc(model, eval_fn, example_inputs, tolerable_loss=0.01, max_trials=20)
    out["model"], out["eval_calls"], out["wall_s"], out["config"], out["error"]

What INC 3.10 does, read from its source (neural_compressor/torch/quantization/{autotune,config}.py,
common/base_tuning.py) and checked on this project's CPU:

- `autotune` expands `TuningConfig.config_set` into whole-model configs and tries them **in order**; it evaluates
  the fp32 baseline once, then one eval_fn call per trial, and **stops at the first config whose score is
  >= baseline * (1 - tolerable_loss)** (relative loss, higher is better). If none passes within max_trials it
  returns the highest-scoring trial's model *even though it fails the tolerance* (re-quantizing it, no extra eval).
  `config_set` must be a list: a bare config raises `TypeError: 'MixedPrecisionConfig' object is not iterable`.
- `MixedPrecisionConfig` (its default tuning set is `dtype=["fp16", "bf16", "fp32"]`) wraps every nn.Linear /
  nn.Conv1d/2d/3d in `HalfPrecisionModuleWrapper`, i.e. `torch.autocast(device, dtype)` around the module with the
  output cast back to fp32. It needs no accelerator. Any dtype other than fp16/bf16 ("fp32", and "int8" too,
  silently) leaves the model unchanged. It only sees eager nn.Modules: on a torch.export'ed model it is a no-op.
- int8 without IPEX goes through PT2E: the model must first be `neural_compressor.torch.export.export`ed
  (torch.export), `StaticQuantConfig` / `DynamicQuantConfig` insert quantize/dequantize pairs (X86InductorQuantizer)
  and INC warns "Converted the model in qdq mode, please compile it to accelerate inference": eager the QDQ graph is
  slower than fp32; `torch.compile` (inductor) fuses it into int8 kernels. Static needs a calibration `run_fn`; we
  calibrate on `example_inputs`, as our tuner calibrates on the first batch it captures.

`configs` picks the config set (each is INC's own `get_config_set_for_tuning()`):
  "mixed_precision"   MixedPrecisionConfig(dtype=["fp16", "bf16", "fp32"])  (default; the literal counterpart of
                      `TuningConfig(config_set=[MixedPrecisionConfig(...)])`)
  "int8"              PT2E StaticQuantConfig set (act_sym x act_algo: 4) then DynamicQuantConfig set (4), exported model
  "int8+mixed_precision"  the int8 run; if its result misses the tolerance, the mixed-precision run with the trials left
                      (INC cannot put both in one `autotune` call: they need an exported vs an eager model). Counts,
                      wall time and trials add up over both runs; the higher-scoring result is returned.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune.capture import as_call_inputs
from autotune.engines import compile_model

INSTALL_HINT = (
    "Intel Neural Compressor is not importable in this environment. It lives in the benchmark venv "
    "(`make bench-install` does these steps):\n"
    "  python3 -m venv .venv-bench\n"
    "  .venv-bench/bin/python -m pip install -c constraints.txt -r requirements.txt\n"
    "  .venv-bench/bin/python -m pip install -c constraints.txt --no-deps -r requirements-nodeps.txt\n"
    "  .venv-bench/bin/python -m pip install -c constraints.txt --no-deps --no-build-isolation -e .\n"
    "  .venv-bench/bin/python -m pip install -c constraints.txt -r benchmarks/requirements-bench.txt\n"
    "and run the benchmark with .venv-bench/bin/python."
)
CONFIG_SETS = ("mixed_precision", "int8", "int8+mixed_precision")
_NOISE_KEYS = {"non_tunable_params", "white_list", "model_info", "excluded_precisions"}


def _import_inc():
    try:
        inc_q = importlib.import_module("neural_compressor.torch.quantization")
        # the module, not the `autotune` function the package re-exports under the same name
        inc_at = importlib.import_module("neural_compressor.torch.quantization.autotune")
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT}\n(import failed: {exc})") from exc
    return inc_q, inc_at


def _describe(config) -> str:
    """One line: the config class and its non-default-noise fields, e.g. `MixedPrecisionConfig(dtype=fp16)`."""
    try:
        fields = config.to_dict()
    except Exception:  # noqa: BLE001 - description only
        return repr(config)
    glob = fields.get("global", fields) if isinstance(fields, dict) else {}
    shown = ", ".join(f"{k}={v}" for k, v in glob.items() if not k.startswith("_") and k not in _NOISE_KEYS)
    local = fields.get("local") if isinstance(fields, dict) else None
    return f"{type(config).__name__}({shown})" + (f" local={local}" if local else "")


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _positional(model: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The example inputs as the positional tuple INC's export takes: keyword inputs (a transformers batch) bound
    to the model's forward parameters in order, as an INC user would pass `example_inputs=(input_ids, mask)`."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"the example inputs do not fit the model's forward: {exc}") from exc
    if bound.kwargs:
        raise ValueError(f"INC's int8 path (torch.export) takes positional inputs only; {sorted(bound.kwargs)} "
                         "cannot be passed by position")
    return bound.args


def _export(model: nn.Module, args: tuple, log: list[str]):
    """INC's export (torch.export), every dimension free where the model allows it (eval batches differ in size,
    token batches in length too), else the example's shapes."""
    from neural_compressor.torch.export import export

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and len(tensors) == len(args):
        dims = tuple({i: torch.export.Dim.AUTO for i in range(t.dim())} for t in tensors)
        try:
            return export(copy.deepcopy(model), args, dynamic_shapes=dims)
        except Exception as exc:  # noqa: BLE001 - retried with static shapes
            log.append(f"export with free dimensions failed ({_short(exc)}); exported with static shapes")
    return export(copy.deepcopy(model), args)


def _one_run(inc_q, inc_at, model: nn.Module, counted_eval: Callable, config_set: list, tolerable_loss: float,
             max_trials: int, *, args: tuple, run_fn: Callable | None) -> dict:
    """One INC `autotune` call; records every config it quantized with and the score of every eval call."""
    tried: list[str] = []
    real_quantize = inc_at.quantize

    def recording_quantize(model, quant_config, *a, **kw):
        tried.append(_describe(quant_config))
        return real_quantize(model, quant_config, *a, **kw)

    inc_at.quantize = recording_quantize  # autotune() calls the name bound in its own module
    try:
        tuned = inc_at.autotune(model, inc_q.TuningConfig(config_set=config_set, tolerable_loss=tolerable_loss,
                                                          max_trials=max_trials),
                                counted_eval, run_fn=run_fn, example_inputs=args)
    finally:
        inc_at.quantize = real_quantize
    # The last quantize() call built the returned model (autotune re-quantizes the best config when it differs).
    return {"model": tuned, "config": tried[-1] if tuned is not None and tried else None, "tried": tried,
            "tol": tolerable_loss}


def run_inc(model: nn.Module, eval_fn: Callable[[nn.Module], float], example_inputs: Any, tolerable_loss: float,
            max_trials: int, *, configs: str = "mixed_precision", compile_int8: bool = True,
            quiet: bool = True) -> dict:
    """Runs INC 3.x `autotune` on a deep copy of `model` (the caller's model is never touched).

    Returns {"model": the nn.Module INC returned (torch.compile'd for int8 when compile_int8) or None,
    "eval_calls": eval_fn calls counted around `eval_fn` (baseline included), "wall_s": everything from the copy to
    the returned model (export, calibration, compile and its warm-up included), "config": the picked config as text,
    "error": None or a short reason} plus diagnostics: "tried" (configs quantized, in order), "scores" (every eval_fn
    result, the first is INC's fp32 baseline), "passed" (INC's own rule on the returned config's score), "notes".
    """
    if configs not in CONFIG_SETS:
        raise ValueError(f"configs must be one of {CONFIG_SETS}; got {configs!r}")
    inc_q, inc_at = _import_inc()
    inc_logger = logging.getLogger("neural_compressor")
    previous_level = inc_logger.level
    if quiet:
        inc_logger.setLevel(logging.WARNING)

    scores: list[float] = []
    notes: list[str] = []

    def counted_eval(candidate):
        score = eval_fn(candidate)
        scores.append(float(score))
        return score

    out: dict = {"model": None, "eval_calls": 0, "wall_s": 0.0, "config": None, "error": None, "tried": [],
                 "scores": scores, "passed": None, "notes": notes}
    started = time.perf_counter()
    try:
        work = copy.deepcopy(model).eval()
        args, kwargs = as_call_inputs(example_inputs)
        runs: list[dict] = []
        budget = max_trials

        if configs in ("int8", "int8+mixed_precision"):
            budget = _int8_stage(inc_q, inc_at, work, args, kwargs, counted_eval, scores, notes, runs, tolerable_loss,
                                 budget, compile_int8, fall_back=configs != "int8")

        need_mixed = configs == "mixed_precision" or (
            configs == "int8+mixed_precision" and not (runs and _passes(runs[0])) and budget > 0)
        if need_mixed:
            first = len(scores)
            run = _one_run(inc_q, inc_at, work, counted_eval, [inc_q.get_default_mixed_precision_config_set()],
                           tolerable_loss, budget, args=args, run_fn=None)
            run["scores"] = scores[first:]
            runs.append(run)

        best = max((r for r in runs if r["model"] is not None), key=_final_score, default=None)
        out["tried"] = [c for r in runs for c in r["tried"]]
        if best is None:
            out["error"] = "INC autotune returned no model"
        else:
            out["model"], out["config"], out["passed"] = best["model"], best["config"], _passes(best)
    except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not a crash of the benchmark
        out["error"] = _short(exc)
    finally:
        out["wall_s"] = time.perf_counter() - started
        out["eval_calls"] = len(scores)
        inc_logger.setLevel(previous_level)
    return out


def _int8_stage(inc_q, inc_at, work, args, kwargs, counted_eval, scores, notes, runs, tolerable_loss, budget,
                compile_int8, fall_back) -> int:
    """INC's PT2E int8 run (export, static then dynamic config sets); returns the trial budget left. With fall_back,
    a failure is noted and the mixed-precision run goes on with the trials left instead of ending the whole run."""
    first = len(scores)
    try:
        args = _positional(work, args, kwargs)
        exported = _export(work, args, notes)
        int8_set = [inc_q.StaticQuantConfig.get_config_set_for_tuning(),
                    inc_q.DynamicQuantConfig.get_config_set_for_tuning()]
        run = _one_run(inc_q, inc_at, exported, counted_eval, int8_set, tolerable_loss, budget, args=args,
                       run_fn=lambda m: m(*args))
    except Exception as exc:  # noqa: BLE001
        if not fall_back:
            raise
        notes.append(f"int8 run failed, mixed precision only: {_short(exc)}")
        return budget - max(len(scores) - first - 1, 0)
    run["scores"] = scores[first:]
    runs.append(run)
    if run["model"] is not None and compile_int8:
        try:
            compiled = compile_model(run["model"], alone=True)
            with torch.inference_mode():
                compiled(*args)  # compile now, inside wall_s
            run["model"], run["config"] = compiled, run["config"] + " + torch.compile"
        except Exception as exc:  # noqa: BLE001 - the eager QDQ model is still INC's result
            notes.append(f"torch.compile of the int8 model failed, returned it eager: {_short(exc)}")
    return budget - (len(run["scores"]) - 1)  # trials spent (the baseline is not one)


def _final_score(run: dict) -> float:
    """Score of the model INC returned: INC stops at the first passing trial, else it returns the best trial."""
    trials = run["scores"][1:]
    return trials[-1] if _passes(run) else max(trials, default=float("-inf"))


def _passes(run: dict) -> bool:
    """INC's rule on the run's last trial: score >= baseline * (1 - tolerable_loss)."""
    if len(run["scores"]) < 2:
        return False
    baseline, last = run["scores"][0], run["scores"][-1]
    return last >= baseline * (1 - run["tol"])
