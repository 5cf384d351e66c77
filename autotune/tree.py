"""Walking the nested containers (tuples, lists, dicts, model-output dicts, UserDicts, dataclasses) that models take and
return."""
from __future__ import annotations

import copy
import dataclasses
from collections import UserDict
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None = None) -> Any:
    """`value` with each tensor in it replaced by `fn(tensor)`, and each other leaf by `other(leaf)` if given."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "remapped"):   # model_call.ModelCall: it walks its own parts
        return value.remapped(lambda part: map_tensors(part, fn, other))
    # Lists, not generators, for the containers: dynamo cannot rebuild a namedtuple from a generator
    # ("'LocalGeneratorObjectVariable' object has no attribute 'remaining_items'"), and a bf16 LSTM fed a
    # PackedSequence maps its input inside the compiled engines' graphs.
    if isinstance(value, tuple) and hasattr(value, "_make"):   # a namedtuple, e.g. an RNN's PackedSequence
        return value._make([map_tensors(item, fn, other) for item in value])
    if isinstance(value, (list, tuple)):
        return type(value)([map_tensors(item, fn, other) for item in value])
    if isinstance(value, dict):
        return type(value)({key: map_tensors(item, fn, other) for key, item in value.items()})
    if isinstance(value, UserDict):   # transformers' BatchEncoding: what sentence-transformers' models take and return
        mapped = copy.copy(value)      # its other attributes (a tokenizer's encodings) as they are
        mapped.data = {key: map_tensors(item, fn, other) for key, item in value.data.items()}
        return mapped
    if dataclasses.is_dataclass(value) and not isinstance(value, type):   # a model's own output class
        return dataclasses.replace(value, **{field.name: map_tensors(getattr(value, field.name), fn, other)
                                             for field in dataclasses.fields(value) if field.init})
    return value if other is None else other(value)


def tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def float_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tensors(value) if t.is_floating_point()]
