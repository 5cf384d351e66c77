"""A recorded call of the model, and making it again: every replay computes what the recorded call did.

State: an object a forward changes in place (transformers' KV cache, which `generate` passes and the model appends
to) is copied for each replay (`fresh`), so no call runs on what earlier ones left, and converted to the dtype a
model keeps its state in (`STATE_DTYPE`, the lowp engine's).

Entries: transformers' `generate` on an encoder-decoder runs the encoder (`self.get_encoder()(...)`) and then calls
the model with the encoder's output as an input. Recorded alone, that call would hand the decoder the fp32
encoder's output, and the encoder would be neither timed, calibrated nor measured for sensitivity. A `ModelCall`
keeps the submodule calls made apart from the forward just before it and makes them again, in order, feeding their
outputs in where the recorded call had them, so whatever runs a recorded call (`call`) runs and times the encoder as
generate does, and lowering an encoder module shows in the model's output.
"""
from __future__ import annotations

import copy
import enum
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from autotune.backends.base import CallInputs
from autotune.tree import map_tensors, tensors

Entry = tuple[str, tuple[tuple[Any, ...], dict[str, Any]]]   # (submodule path, (args, kwargs))
Link = tuple[int, int, int]    # (entry, position of the tensor in tree.tensors(its output), times each row repeats)


class ModelCall(tuple):
    """(args, kwargs) of one call of the model, with `entries`: the (path, inputs) of the submodule calls made
    before it, in order, and `links`: {position of a tensor in tree.tensors((args, kwargs)): Link}, the inputs that
    were those entries' outputs, or those outputs with each row repeated (generate's beam search expands the
    encoder's output to one row per beam). `changes_inputs`: the model changes its input tensors in place (a forward
    normalising its input with `x.sub_(mean)`), so each call gets copies of them (`fresh`)."""
    entries: tuple[Entry, ...]
    links: dict[int, Link]
    changes_inputs: bool

    def __new__(cls, pair: tuple, entries: tuple[Entry, ...] | list[Entry] = (),
                links: dict[int, Link] | None = None, changes_inputs: bool = False):
        made = super().__new__(cls, pair)
        made.entries, made.links, made.changes_inputs = tuple(entries), dict(links or {}), changes_inputs
        return made

    def remapped(self, fn: Callable[[Any], Any]) -> ModelCall:
        """A copy with its args, kwargs and every entry's inputs passed through `fn` (how tree.map_tensors walks
        it, so moving, resizing or cloning a recorded call does the same to its entries)."""
        return ModelCall((fn(self[0]), fn(self[1])), [(path, fn(inputs)) for path, inputs in self.entries],
                         self.links, self.changes_inputs)


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
                if t is out:
                    links.setdefault(position, (entry, index, 1))
                elif _rows_repeated(t, out):
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


# What a forward cannot change in place; any other object it is called with may be state that it does change.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
              torch.memory_format, enum.Enum, type)


def _is_state(leaf: Any) -> bool:
    return not isinstance(leaf, _IMMUTABLE) and not callable(leaf)


def snapshot(leaf: Any) -> Any:
    """A copy of an object a forward may change in place (transformers' KV cache, which `generate` passes and the
    model appends to on every call), or the object itself where it cannot be copied."""
    try:
        return copy.deepcopy(leaf) if _is_state(leaf) else leaf
    except Exception:  # noqa: BLE001 - an object that cannot be copied is passed as it is
        return leaf


def holds_state(inputs: CallInputs) -> bool:
    """Whether recorded inputs hold an object a call may change (a KV cache): each call then gets its own copy
    (`fresh`), so every call computes what the recorded one did, not on what earlier calls left."""
    found: list[Any] = []
    map_tensors(inputs, lambda t: t, lambda leaf: found.append(leaf) if _is_state(leaf) else None)
    return bool(found)


# A mark on a model that keeps its state in another dtype than the fp32 model that recorded it (the lowp engine's, in
# bf16: generate's KV cache holds what its own calls computed): `call` gives it the recorded state in that dtype.
STATE_DTYPE = "autotune_state_dtype"


def copied_for_each_call(inputs: CallInputs) -> bool:
    """Whether each call on recorded inputs gets copies of them (`fresh`): they hold state (`holds_state`), or
    tensors the model changes in place (`ModelCall.changes_inputs`)."""
    return getattr(inputs, "changes_inputs", False) or holds_state(inputs)


def fresh(inputs: CallInputs, state_dtype: torch.dtype | None = None) -> CallInputs:
    """`inputs` for one call: as they are, or with copies of the state objects in them (`holds_state`), their fp32
    tensors and dtype attributes converted to `state_dtype` where given, and copies of their tensors where the model
    changes them in place."""
    if not copied_for_each_call(inputs):
        return inputs
    copied = (lambda t: t.clone()) if getattr(inputs, "changes_inputs", False) else (lambda t: t)
    return map_tensors(inputs, copied, lambda leaf: _converted_copy(leaf, state_dtype))


def copied_per_call(batches: list[CallInputs], probe: CallInputs) -> list[CallInputs]:
    """`batches`, marked so that each call gets copies of their tensors (`fresh`) where a call of the model changed
    the tensors it was given in place: `probe` is a copy of the first batch that the model was called on once, and
    compared with it (left as they are, the recorded inputs drifted call by call: a forward normalising its
    input in place drove it to inf, and every module lowered was judged to lose the output)."""
    if all(same_values(after, before) for after, before in zip(tensors(probe), tensors(batches[0]))):
        return batches
    return [ModelCall((batch[0], batch[1]), entries_of(batch), getattr(batch, "links", {}), changes_inputs=True)
            for batch in batches]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` hold the same values (NaN where the other has NaN), in the same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _converted_copy(leaf: Any, dtype: torch.dtype | None) -> Any:
    copied = snapshot(leaf)
    return copied if copied is leaf else _in_dtype(copied, dtype, set())   # never the recorded object itself


def _in_dtype(value: Any, dtype: torch.dtype | None, seen: set[int]) -> Any:
    """`value` with the fp32 tensors and float32 dtype attributes in it, at any depth of objects, lists and dicts,
    converted to `dtype` in place (on a copy: `fresh`); `value` itself, converted, for a tensor or a dtype."""
    if dtype is None or id(value) in seen:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float32 else value
    if isinstance(value, torch.dtype):
        return dtype if value == torch.float32 else value
    seen.add(id(value))
    items = (enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict)
             else vars(value).items() if hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module))
             else ())
    for key, item in list(items):
        converted = _in_dtype(item, dtype, seen)
        if converted is not item:
            if isinstance(value, (list, dict)):
                value[key] = converted
            else:
                setattr(value, key, converted)
    return value


def call(model: nn.Module, inputs: CallInputs) -> Any:
    inputs = fresh(inputs, getattr(model, STATE_DTYPE, None))
    args, kwargs = after_entries(model, inputs) if entries_of(inputs) else inputs
    return model(*args, **kwargs)


DRAWS_SEED = 0


@contextmanager
def same_random_draws(model: nn.Module) -> Iterator[None]:
    """Every forward begun in a block of its own draws the same random numbers (a VAE sampling its latent): the
    error then measured is the lowered module's, not the difference of two draws (0.03 for every module and dtype
    of a VAE, which left the search blind). The caller's random state is as it was after the block."""
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(DRAWS_SEED)
        yield
