"""A recorded call of the model together with the submodule calls made apart from its forward just before it.

transformers' `generate` on an encoder-decoder runs the encoder (`self.get_encoder()(...)`) and then calls the
model with the encoder's output as an input: recorded alone, that call would hand the decoder the fp32 encoder's
output, and the encoder would be neither timed, calibrated nor measured for sensitivity. A `ModelCall` makes the
entries again, in order, and feeds their outputs in where the recorded call had them, so whatever runs a recorded
call (`capture.call`) runs and times the encoder as generate does, and lowering an encoder module shows in the
model's output.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune.tree import map_tensors, tensors

Entry = tuple[str, tuple[tuple[Any, ...], dict[str, Any]]]   # (submodule path, (args, kwargs))


Link = tuple[int, int, int]    # (entry, position of the tensor in tree.tensors(its output), times each row repeats)


class ModelCall(tuple):
    """(args, kwargs) of one call of the model, with `entries`: the (path, inputs) of the submodule calls made
    before it, in order, and `links`: {position of a tensor in tree.tensors((args, kwargs)): Link}, the inputs that
    were those entries' outputs, or those outputs with each row repeated (generate's beam search expands the
    encoder's output to one row per beam)."""
    entries: tuple[Entry, ...]
    links: dict[int, Link]

    def __new__(cls, pair: tuple, entries: tuple[Entry, ...] | list[Entry] = (),
                links: dict[int, Link] | None = None):
        made = super().__new__(cls, pair)
        made.entries, made.links = tuple(entries), dict(links or {})
        return made

    def remapped(self, fn: Callable[[Any], Any]) -> ModelCall:
        """A copy with its args, kwargs and every entry's inputs passed through `fn` (how tree.map_tensors walks
        it, so moving, resizing or cloning a recorded call does the same to its entries)."""
        return ModelCall((fn(self[0]), fn(self[1])), [(path, fn(inputs)) for path, inputs in self.entries],
                         self.links)


def entries_of(inputs: Any) -> tuple[Entry, ...]:
    return getattr(inputs, "entries", ())


def entry_paths(batches: list[Any]) -> tuple[str, ...]:
    """The submodules the recorded `batches` make entry calls of, once each, in the order first called."""
    return tuple(dict.fromkeys(path for batch in batches for path, _ in entries_of(batch)))


def linked(live: tuple, outputs: list[list[torch.Tensor]]) -> dict[int, Link]:
    """ModelCall.links for a call on `live` (args, kwargs) after entries that returned `outputs` (each as
    tree.tensors): the inputs that are one of those very tensors, or one of them with its rows repeated."""
    links = {}
    for position, t in enumerate(tensors(live)):
        for entry, found in enumerate(outputs):
            for index, out in enumerate(found):
                if t is out or _rows_repeated(t, out):
                    links.setdefault(position, (entry, index, t.shape[0] // out.shape[0]))
    return links


def _rows_repeated(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `t` is `out` with each row repeated k > 1 times (`Tensor.repeat_interleave(k, 0)`)."""
    if t.dim() == 0 or t.dim() != out.dim() or t.shape[1:] != out.shape[1:] or t.dtype != out.dtype:
        return False
    if out.shape[0] == 0 or t.shape[0] <= out.shape[0] or t.shape[0] % out.shape[0]:
        return False
    return torch.equal(t, out.repeat_interleave(t.shape[0] // out.shape[0], 0))


def after_entries(model: nn.Module, inputs: ModelCall) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Makes the entries' calls on `model` (the model the call is for: its submodules, lowered or not) and returns
    the call's (args, kwargs) with their outputs fed in where `links` says."""
    outputs = []
    for path, (args, kwargs) in inputs.entries:
        outputs.append(tensors(model.get_submodule(path)(*args, **kwargs)))
    position = itertools.count()

    def fed(t):
        link = inputs.links.get(next(position))
        if link is None:
            return t
        entry, index, repeats = link
        return outputs[entry][index] if repeats == 1 else outputs[entry][index].repeat_interleave(repeats, 0)
    return map_tensors((inputs[0], inputs[1]), fed)
