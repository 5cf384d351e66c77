"""Deep copies of modules, made faster than `copy.deepcopy` where a module copies the plain way.

`copy.deepcopy` of a module goes through the pickle protocol for each of its dozen hook dictionaries, which are
nearly always empty, and that is most of what a trial's model copy costs. `clone` makes the same copy
(the state `Module.__getstate__` gives, deep-copied, set as `Module.__setstate__` sets it) but makes empty
containers directly. A module whose class copies or pickles itself its own way is handed to `copy.deepcopy`.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

_EMPTY_CONTAINERS = (dict, OrderedDict, set)
_IMMUTABLE = (bool, int, float, str, type(None))   # what deepcopy returns as is
_SHARED_HOOKS = ("_forward_hooks", "_forward_pre_hooks")   # the copy runs the user's hook objects themselves


def clone(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of `module`; `memo` as for `copy.deepcopy` (an entry's value stands in for the object)."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    if not _copies_plainly(type(module)):
        return copy.deepcopy(module, memo)
    return copy_module_state(module, memo)


def clone_sharing_weights(module: nn.Module) -> nn.Module:
    """A copy of `module` as `clone` makes it, but holding the same parameters: for a working copy that the tuner
    calls and changes the modules of, never the weights (the signals' copy, where one module at a time is swapped
    for its lowered form). Copying the weights cost their size again at the peak of the signals. Buffers, which
    some forwards move, are still copied. Not for models handed to eval_fn: one that casts or edits its model in
    place would change the fp32 weights every later plan is built from."""
    return clone(module, {id(parameter): parameter for parameter in module.parameters()})


def copy_module_state(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The plain copy of one module, for classes that define `__deepcopy__` in terms of it."""
    copied = type(module).__new__(type(module))
    memo[id(module)] = copied
    state = {}
    for key, value in module.__dict__.items():
        kind = type(value)
        if kind in _IMMUTABLE:
            state[key] = value
        elif key == "_modules":
            state[key] = kind((name, None if child is None else clone(child, memo)) for name, child in value.items())
        elif kind in _EMPTY_CONTAINERS and not value:
            state[key] = kind()
        elif key in _SHARED_HOOKS:
            state[key] = kind((handle, _hook_copy(hook, memo)) for handle, hook in value.items())
        elif isinstance(value, torch.Tensor) and not value.is_leaf:
            # computed with autograd on, which deepcopy refuses: the weight a prune or weight_norm hook sets from its
            # parts (`weight_orig * weight_mask`) after a forward with gradients, or right after prune.l1_unstructured.
            # The hook computes it again at each call; the copy holds its value.
            state[key] = memo[id(value)] = value.detach().clone()
        elif key != "_compiled_call_impl":   # dropped by Module.__getstate__ too
            state[key] = copy.deepcopy(value, memo)
    copied.__dict__.update(state)
    return copied


def _hook_copy(hook: Any, memo: dict[int, Any]) -> Any:
    """The hook a copy runs: a method of a module (a library's own hook) bound to that module's copy; any other
    hook, the same object, so that a user's hook object collecting outputs gets the copy's calls too (deepcopy
    would give the copy a collector of its own, which the user never sees)."""
    return copy.deepcopy(hook, memo) if isinstance(getattr(hook, "__self__", None), nn.Module) else hook


@functools.cache
def _copies_plainly(cls: type) -> bool:
    return (cls.__getstate__ is nn.Module.__getstate__ and cls.__setstate__ is nn.Module.__setstate__
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__deepcopy__", None) is None
            and not any("__slots__" in vars(klass) for klass in cls.__mro__))
