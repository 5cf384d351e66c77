"""transformers' output recording, carried through torch.save.

Since transformers 5 a model collects hidden states and attentions with forward hooks it installs at its first call
asking for them (a backbone, as DPT's or Depth Anything's, at construction): local functions, which pickle refuses,
so torch.save of such a model failed ("Can't pickle local object 'install_output_capuring_hook.<locals>...'"), and
`autotune apply` with it. And which outputs a class records, transformers notes as a model of that class is built:
a model unpickled in a process that built none returned `hidden_states=None` however it was called.

So a model is pickled without those hooks and without the mark saying they are in place (transformers installs
them again at its next call asking for them), and holding `OutputRecording`, which, unpickled, builds each
transformers class of the model once on the meta device: what makes transformers note what the class records.
"""
from __future__ import annotations

import contextlib
import copy
import sys
import warnings
from collections.abc import Iterator

import torch
from torch import nn

HOOKS_MODULE = "transformers.utils.output_capturing"
HOOKED_MARK = "_output_capturing_hooks_installed"   # set by transformers on a model holding its hooks
HELD_AS = "autotune_output_recording"

_BUILT: set[type] = set()    # the classes built in this process for their recording to be noted


class OutputRecording:
    """The transformers classes of a saved model, with their configs; unpickling builds them (`classes_noted`)."""

    def __init__(self, classes: dict[type, object]):
        self.classes = classes

    def __reduce__(self):
        return classes_noted, (self.classes,)


def classes_noted(classes: dict[type, object]) -> OutputRecording:
    """Builds each class of `classes` not built here yet, from its config, on the meta device (no memory, no
    weights initialised): transformers notes which outputs a class records as a model of it is built."""
    for cls, config in classes.items():
        if cls in _BUILT:
            continue
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls(copy.deepcopy(config))
        except Exception as exc:  # a class that cannot be built on the meta device
            warnings.warn(f"{cls.__name__} could not be built to note which outputs it records ({exc}): called with "
                          "output_hidden_states or output_attentions, the loaded model returns None for them",
                          stacklevel=2)
        _BUILT.add(cls)
    return OutputRecording(classes)


def transformers_classes(model: nn.Module) -> dict[type, object]:
    """Each transformers model class among `model`'s modules, with the config of the first module of it."""
    if "transformers" not in sys.modules:    # nothing of transformers can be in a model before it is imported
        return {}
    from transformers import PreTrainedModel
    classes: dict[type, object] = {}
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            classes.setdefault(type(module), module.config)
    return classes


@contextlib.contextmanager
def recording_picklable(model: nn.Module) -> Iterator[None]:
    """`model` without transformers' output-capturing hooks and their mark, and holding `OutputRecording`, while
    it is pickled in this block; as it was after it."""
    classes = transformers_classes(model)
    if not classes:
        yield
        return
    hook_tables: list[tuple[dict, dict]] = []
    marks: list[tuple[nn.Module, object]] = []
    for module in model.modules():
        hooks = getattr(module, "_forward_hooks", None) or {}   # transformers registers no pre-hooks
        theirs = [key for key, hook in hooks.items() if getattr(hook, "__module__", None) == HOOKS_MODULE]
        if theirs:
            hook_tables.append((hooks, dict(hooks)))
            for key in theirs:
                del hooks[key]
        if HOOKED_MARK in vars(module):
            marks.append((module, vars(module).pop(HOOKED_MARK)))
    held_before = vars(model).get(HELD_AS)   # a model loaded from such a file holds one already
    setattr(model, HELD_AS, OutputRecording(classes))
    try:
        yield
    finally:
        delattr(model, HELD_AS)
        if held_before is not None:
            setattr(model, HELD_AS, held_before)
        for hooks, held in hook_tables:
            hooks.clear()
            hooks.update(held)
        for module, mark in marks:
            vars(module)[HOOKED_MARK] = mark
