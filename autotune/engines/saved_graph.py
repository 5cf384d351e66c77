"""A compiled-engine graph in a file. torch.export's graph takes its inputs only as it was exported on them, these by
position and those by keyword ("kwarg keyword mismatch" otherwise). So it is written on the inputs as eval_fn passed
them, which makes the file a drop-in for the model, called as eval_fn calls it, and that arrangement is written beside
it: read back here, the graph takes any call that binds to its parameters."""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import cached_property
from typing import IO

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.engines.export import export
from autotune.engines.quiet import library_notes_dropped

LAYOUT_FILE = "autotune-call-layout.json"   # the extra file torch.export.save writes it in
LAYOUT_ATTR = "autotune_call_layout"         # where a graph read back holds it


@dataclass(frozen=True)
class CallLayout:
    """How a graph takes its inputs: by parameter name, these by position and then those by keyword."""
    positional: tuple[str, ...]
    keywords: tuple[str, ...] = ()

    @classmethod
    def of(cls, model: nn.Module, inputs: CallInputs | None = None) -> CallLayout:
        """The layout of the call `inputs` to `model` (its parameters, by their names); without `inputs`, every
        parameter by position. A model read back by `read_graph` has its own."""
        if (layout := getattr(model, LAYOUT_ATTR, None)) is not None:
            return layout
        parameters = inspect.signature(model.forward).parameters.values()
        by_position = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [*by_position, *(p.name for p in parameters if p.kind == p.KEYWORD_ONLY)]
        if inputs is None:
            return cls(tuple(by_position), tuple(names[len(by_position):]))
        args, kwargs = inputs
        by_position += [f"input{index}" for index in range(len(by_position), len(args))]   # forward(self, *args)
        # The keywords in the parameters' order: a graph takes its inputs in the order export was given them (a
        # tokenizer's dict, in another order than BERT's parameters, reached the wrong ones), and a graph module
        # exported on them in another order took them swapped.
        order = {name: index for index, name in enumerate(names)}
        return cls(tuple(by_position[:len(args)]), tuple(sorted(kwargs, key=lambda k: order.get(k, len(order)))))

    @cached_property
    def _signature(self) -> inspect.Signature:
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature([inspect.Parameter(name, kind) for name in (*self.positional, *self.keywords)])

    def arrange(self, args: tuple, kwargs: dict) -> CallInputs:
        """A call's inputs as the graph takes them.

        Raises:
            TypeError: the call does not bind to the graph's parameters (an input missing, or one it lacks).
        """
        if not kwargs and not self.keywords and len(args) == len(self.positional):
            return args, kwargs
        bound = self._signature.bind(*args, **kwargs).arguments
        return tuple(bound[name] for name in self.positional), {name: bound[name] for name in self.keywords}

    def __str__(self) -> str:
        return ", ".join([*self.positional, *(f"{name}=" for name in self.keywords)])


def write_graph(model: nn.Module, inputs: CallInputs, out: IO[bytes]) -> CallLayout:
    """`model` exported on `inputs` as they are arranged, written to `out` with that layout; returns the layout."""
    layout = CallLayout.of(model, inputs)
    inputs = layout.arrange(*inputs)     # a graph read back takes only its own
    with library_notes_dropped():
        torch.export.save(export(model, inputs), out, extra_files={LAYOUT_FILE: json.dumps(
            {"positional": layout.positional, "keywords": layout.keywords})})
    return layout


def read_graph(saved: IO[bytes]) -> nn.Module:
    """The graph `write_graph` wrote, holding its layout (a file without one takes every input by position)."""
    extra = {LAYOUT_FILE: ""}
    graph = torch.export.load(saved, extra_files=extra).module()
    if extra[LAYOUT_FILE]:
        written = json.loads(extra[LAYOUT_FILE])
        setattr(graph, LAYOUT_ATTR, CallLayout(tuple(written["positional"]), tuple(written["keywords"])))
    return graph

