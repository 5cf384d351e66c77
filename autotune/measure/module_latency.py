"""A cheap per-module signal, no eval_fn call: how long each module takes in each dtype on the inputs it really
sees (boundary casts included).

A module timed alone can mislead: in the model, its output's layout, the next module and the allocator's state
change what a dtype costs (README, "How it searches", has a measured case). `confirm_in_context` checks such
verdicts against the whole model."""
from __future__ import annotations

import logging

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import failure_of
from autotune.measure.latency import measure_latency, timed_call_ms
from autotune.plan import apply_plan, lower_module, uniform_plan
from autotune.tree import map_tensors

HOPELESS_RATIO = 2.0   # a dtype this many times slower than fp32 on a module pays off nowhere: not timed in rounds
HOPELESS_MIN_MS = 1.0  # ... judged from one call only where it takes this long: a shorter one is too noisy
# A module's first call carries one-time costs (kernel generation, weight packing: milliseconds), so it is judged
# hopeless on its own only far past the bar, where it takes far longer than such costs, and where the dtype has run
# on an earlier module (what a dtype's first use in the process initialises is paid there).
FIRST_CALL_HOPELESS_RATIO = 4 * HOPELESS_RATIO   # times fp32's first call
FIRST_CALL_HOPELESS_MIN_MS = 20.0
# Modules holding less of the model's per-module fp32 time than this (a classifier head) cannot move a plan's time
# whatever the whole model says of them: their verdict alone stands, not worth a whole-model timing.
CONTEXT_MIN_SHARE = 0.01

log = logging.getLogger("autotune")


def module_latency(model: nn.Module, candidates: dict[str, list[str]], calibration: dict[str, CallInputs], *,
                   repeats: int, num_threads: int | None) -> dict[str, dict[str, float]]:
    """{module: {dtype: median ms of the module alone on its recorded inputs}}, dtypes interleaved per module.

    A dtype whose warm calls take HOPELESS_RATIO x fp32's (emulated bf16 / fp16 on a CPU without them runs
    5-25x), or whose first two calls already take FIRST_CALL_HOPELESS_RATIO x fp32's first, keeps the faster of
    those calls as its cost: timing it in rounds cost most of the signals' time and changes no verdict, since the
    search prunes any dtype slower than fp32."""
    timings: dict[str, dict[str, float]] = {}
    ran: set[str] = set()   # dtypes called on an earlier module
    twins: dict[tuple, str] = {}   # what decides a module's cost -> the first module timed with it
    for name, dtypes in candidates.items():
        original, inputs = model.get_submodule(name), calibration[name]
        key = _cost_key(original, inputs, dtypes)
        if key in twins:   # a repeated block's twin: its cost is measured once (a BERT-base's 72 Linears: 4 shapes)
            timings[name] = dict(timings[twins[key]])
            continue
        twins[key] = name
        variants = {dtype: lower_module(original, dtype, inputs) for dtype in dtypes}
        hopeless, first, warm = {}, {}, {}
        for dtype in sorted(dtypes, key=lambda d: d != "fp32"):   # fp32 first: the bars are relative to it
            first[dtype] = timed_call_ms(variants[dtype], inputs, num_threads)
            warm[dtype] = timed_call_ms(variants[dtype], inputs, num_threads)
            # Each verdict rests on two calls past its bar: on a busy host one call descheduled read an int8
            # Linear at 3.9 ms where it runs in 0.025, and pruned int8 from the whole search.
            if dtype in ran and _past(first, dtype, FIRST_CALL_HOPELESS_RATIO, FIRST_CALL_HOPELESS_MIN_MS) and _past(
                    {**first, dtype: warm[dtype]}, dtype, FIRST_CALL_HOPELESS_RATIO, FIRST_CALL_HOPELESS_MIN_MS):
                hopeless[dtype] = min(first[dtype], warm[dtype])
                continue
            if _past(warm, dtype, HOPELESS_RATIO, HOPELESS_MIN_MS):
                warm[dtype] = min(warm[dtype], timed_call_ms(variants[dtype], inputs, num_threads))
                if _past(warm, dtype, HOPELESS_RATIO, HOPELESS_MIN_MS):
                    hopeless[dtype] = warm[dtype]
        ran.update(dtypes)
        stats = measure_latency({d: v for d, v in variants.items() if d not in hopeless}, inputs,
                                warmup=0, repeats=repeats, num_threads=num_threads)
        timings[name] = {dtype: hopeless[dtype] if dtype in hopeless else stats[dtype].median_ms
                         for dtype in dtypes}
    if len(twins) < len(timings):
        log.info("%d modules timed alone as %d kinds: modules of one type, weight shapes and inputs cost alike",
                 len(timings), len(twins))
    return timings


def _cost_key(module: nn.Module, inputs: CallInputs, dtypes: list[str]) -> tuple:
    """What a module's cost alone depends on: its type and settings, its parameters' and buffers' shapes and
    dtypes, the shapes, dtypes and layout of its inputs (and their other arguments), and the dtypes timed."""
    def leaf(tensor: torch.Tensor) -> tuple:
        return tuple(tensor.shape), tensor.dtype, tensor.is_contiguous(), tensor.device.type

    held = tuple((name, *leaf(tensor)) for name, tensor in (*module.named_parameters(), *module.named_buffers()))
    return type(module), module.extra_repr(), held, repr(map_tensors(inputs, leaf)), tuple(dtypes)


def _past(call_ms: dict[str, float], dtype: str, ratio: float, min_ms: float) -> bool:
    """Whether `dtype`'s call took `ratio` times fp32's and at least `min_ms`."""
    return dtype != "fp32" and call_ms[dtype] >= max(ratio * call_ms["fp32"], min_ms)


def confirm_in_context(model: nn.Module, candidates: dict[str, list[str]], latency: dict[str, dict[str, float]],
                       inputs: CallInputs, calibration: dict[str, CallInputs], *, warmup: int, repeats: int,
                       num_threads: int | None) -> dict[str, dict[str, float]]:
    """`latency`, with a dtype kept where the module alone measured it slower than fp32 but the whole model in
    that dtype runs faster than fp32 (timed interleaved with fp32; only dtypes with mixed module verdicts, where
    the modules slower alone hold CONTEXT_MIN_SHARE of the fp32 time or more, and dtypes every module ran
    slower alone in, by less than HOPELESS_RATIO in all).

    With mixed verdicts, a kept module's cost in that dtype becomes its fp32 cost: no saving is predicted for it, so
    the knapsack and the fastest plan leave it in fp32, but the uniform plan of that dtype stays in the search space
    and is tried. Where every module was slower alone, each is predicted to save its share of the whole model's
    saving (its fp32 cost times the whole model's ratio), so that the search can fall back from the uniform plan;
    but one HOPELESS_RATIO slower alone (a small input layer or head), whose verdict stands.
    """
    slower = {d: [n for n, ds in candidates.items() if d in ds and latency[n][d] >= latency[n]["fp32"]]
              for d in {d for ds in candidates.values() for d in ds if d != "fp32"}}
    fp32_ms = sum(costs["fp32"] for costs in latency.values())
    every = {d: sum(d in ds for ds in candidates.values()) for d in slower}
    mixed = sorted(d for d, names in slower.items() if 0 < len(names) < every[d]
                   and sum(latency[n]["fp32"] for n in names) >= CONTEXT_MIN_SHARE * fp32_ms)
    # Slower alone on every module, but not by far: many small layers at batch 1, each timed alone with its weights
    # in cache, where the whole model streams them from memory (120 Linear(384)s: int8 1.4x fp32's time alone,
    # the whole model in int8 0.7x).
    modest = sorted(d for d, names in slower.items() if names and len(names) == every[d]
                    and sum(latency[n][d] for n in names) < HOPELESS_RATIO * sum(latency[n]["fp32"] for n in names))
    if not mixed and not modest:
        return latency
    uniform = {}
    for dtype in mixed + modest:
        candidate = apply_plan(model, uniform_plan(candidates, dtype), calibration)
        failure = failure_of(candidate, inputs)
        if failure:   # the sensitivity step names the module it fails with, and leaves that dtype out there
            log.info("the model does not run in uniform %s (%s): no whole-model check of it", dtype, failure)
        else:
            uniform[dtype] = candidate
    if not uniform:
        return latency
    timing = measure_latency({"fp32": model, **uniform}, inputs, warmup=warmup, repeats=repeats,
                             num_threads=num_threads)
    confirmed = {n: dict(costs) for n, costs in latency.items()}
    for dtype in uniform:
        ratio = timing[dtype].median_ms / timing["fp32"].median_ms
        if ratio < 1:
            # Where every module was slower alone, the whole model's saving is all there is to go by: each is
            # predicted to save its share of it. Where some were faster, those carry the saving.
            for name in slower[dtype]:
                if dtype not in modest:
                    confirmed[name][dtype] = latency[name]["fp32"]
                elif latency[name][dtype] < HOPELESS_RATIO * latency[name]["fp32"]:   # the far slower stay so
                    confirmed[name][dtype] = latency[name]["fp32"] * ratio
    return confirmed
