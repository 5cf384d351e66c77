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

from torch import nn

_EMPTY_CONTAINERS = (dict, OrderedDict, set)
_IMMUTABLE = (bool, int, float, str, type(None))   # what deepcopy returns as is


def clone(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of `module`; `memo` as for `copy.deepcopy` (an entry's value stands in for the object)."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    if not _copies_plainly(type(module)):
        return copy.deepcopy(module, memo)
    return copy_module_state(module, memo)


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
        elif key != "_compiled_call_impl":   # dropped by Module.__getstate__ too
            state[key] = copy.deepcopy(value, memo)
    copied.__dict__.update(state)
    return copied


@functools.cache
def _copies_plainly(cls: type) -> bool:
    return (cls.__getstate__ is nn.Module.__getstate__ and cls.__setstate__ is nn.Module.__setstate__
            and cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and getattr(cls, "__deepcopy__", None) is None
            and not any("__slots__" in vars(klass) for klass in cls.__mro__))
