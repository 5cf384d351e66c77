"""Skipping what runs before a lowered module: sensitivity lowers one unit at a time, and every module that
finished before the unit's first call computes exactly what it computed in the fp32 reference forward.

`PrefixReplay.record` runs the reference forward with hooks: first the order in which modules enter and leave,
then the outputs of the modules some unit may skip. `replaying(members)` answers each module that finished before
the members start from that record (the largest such modules: a finished block is answered whole, not its layers),
so a forward with a late unit lowered computes only the rest. The errors are the same numbers as without it.

Only a module's `forward` is answered from the record; its parameters and attributes stay, so a parent that reads
them works as before. A model where answering from the record changes the output (a module with state, an
in-place op on a skipped module's input) is found by one check forward and never replayed.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.capture import call_hooked, detach_clone
from autotune.model_call import call, same_random_draws
from autotune.tree import map_tensors, tensors

log = logging.getLogger("autotune")

MAX_RECORDED_BYTES = 1 << 30   # outputs kept for replay: a model whose skipped outputs take more runs in full
MAX_CHECK_ERROR = 1e-6         # the check forward's error against the reference: beyond it, no replay


class PrefixReplay:
    def __init__(self, outputs: dict[int, list[Any]], skipped: dict[tuple[str, ...], list[nn.Module]]):
        self._outputs = outputs      # id(module) -> what each of its calls returned, in call order
        self._skipped = skipped      # unit members -> the modules finished before they start

    @classmethod
    def record(cls, model: nn.Module, inputs: CallInputs, units: Sequence[Sequence[str]],
               error: Callable[[Any, Any], float]) -> tuple[Any, PrefixReplay | None]:
        """The reference output of `model` on `inputs`, and the replay for `units`: None where no unit can skip
        anything, or skipping would keep too much, or would change the output by `error(reference, output)`.
        Runs the model two or three times (the third, replaying, skips much of it)."""
        with same_random_draws(model):   # each forward here draws what the others do
            order, output = _call_order(model, inputs)
        starts = {tuple(members): min((order[id(module)][0] for module in map(model.get_submodule, members)
                                       if id(module) in order), default=-1) for members in units}
        # Each module once: one registered under two parents is reached through both.
        skipped = {members: list({id(m): m for m in _finished_before(model, order, start)}.values())
                   for members, start in starts.items()}
        wanted = {id(module): module for found in skipped.values() for module in found}
        if not wanted:
            return output, None
        with same_random_draws(model):
            outputs = _record_outputs(model, inputs, list(wanted.values()))
        if outputs is None:
            log.debug("sensitivity runs every forward in full: the outputs to skip exceed %d bytes",
                      MAX_RECORDED_BYTES)
            return output, None
        replay = cls(outputs, skipped)
        try:
            with replay.replaying(max(starts, key=starts.__getitem__)), torch.inference_mode(), \
                    same_random_draws(model):
                differs = error(output, call(model, inputs))
            why = f"the check forward's output differs by {differs:.2g}" if differs > MAX_CHECK_ERROR else None
        except Exception as exc:   # e.g. a parent reading what a skipped module's forward would have set
            why = f"the check forward raised {type(exc).__name__}: {exc}"
        if why:
            log.debug("sensitivity runs every forward in full: %s", why)
            return output, None
        return output, replay

    @contextmanager
    def replaying(self, members: Sequence[str]) -> Iterator[None]:
        """Within it, the modules finished before `members` start answer from the record."""
        patched = []
        for module in self._skipped.get(tuple(members), []):
            patched.append((module, vars(module).get("forward")))
            module.forward = _answer(self._outputs[id(module)])
        try:
            yield
        finally:
            for module, own in patched:
                del module.forward
                if own is not None:
                    module.forward = own


def _answer(outputs: list[Any]):
    calls = itertools.cycle(outputs)   # each forward makes len(outputs) calls, in the reference's order

    def forward(*args, **kwargs):
        # A copy: the caller may change the result in place (`out += identity`), and the record serves again.
        return map_tensors(next(calls), torch.clone)
    return forward


def _call_order(model: nn.Module, inputs: CallInputs) -> tuple[dict[int, tuple[int, int]], Any]:
    """{id(module): (event of its first call's start, event of its last call's end)} over one forward, and the
    forward's output."""
    events = iter(range(1 << 62))
    order: dict[int, list[int]] = {}

    def started(module, args):
        order.setdefault(id(module), [next(events), -1])

    def ended(module, args, output):
        order[id(module)][1] = next(events)

    # A torch.jit.script module takes no Python hooks: it and what it holds are not in the order, so they are
    # run again in every forward rather than answered from a record.
    output = call_hooked(model, inputs, [h for module in model.modules()
                                         if not isinstance(module, torch.jit.ScriptModule) for h in (
        module.register_forward_pre_hook(started), module.register_forward_hook(ended))])
    return {key: (start, end) for key, (start, end) in order.items()}, output


def _finished_before(root: nn.Module, order: dict[int, tuple[int, int]], start: int) -> list[nn.Module]:
    """The largest modules under `root` whose every call ended before event `start`."""
    found: list[nn.Module] = []
    for child in root.children():
        first, last = order.get(id(child), (None, None))
        if first is None:   # never called itself (a ModuleList): its modules may have been
            found.extend(_finished_before(child, order, start))
        elif last < start:
            found.append(child)
        elif first < start:
            found.extend(_finished_before(child, order, start))
    return found


def _record_outputs(model: nn.Module, inputs: CallInputs, modules: list[nn.Module]) -> dict[int, list[Any]] | None:
    outputs: dict[int, list[Any]] = {id(module): [] for module in modules}
    size = [0]

    def keep(module, args, output):
        if size[0] > MAX_RECORDED_BYTES:
            return   # over the bound already: nothing more is kept (and the record is dropped)
        size[0] += sum(t.numel() * t.element_size() for t in tensors(output))
        outputs[id(module)].append(detach_clone(output))

    call_hooked(model, inputs, [module.register_forward_hook(keep) for module in modules])
    return outputs if size[0] <= MAX_RECORDED_BYTES else None
