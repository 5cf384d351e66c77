"""torch's transformer encoders and encoder layers, in inference, run one fused kernel on their children's weights
(their "fast path"), reading `linear1.weight` and the rest directly, and the encoder hands its layers nested
tensors. A lowered child has no such weight, the kernel would bypass it, and its kernels take no nested tensor:
above a lowered module (and while recording what a module to be lowered is called with) they must call their
children as modules. Each is turned off through the attribute its fast-path check reads."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

# type -> (attribute, the value that keeps the module off its fast path)
_OFF = ((nn.TransformerEncoderLayer, "activation_relu_or_gelu", 0),   # the fused kernel's activation: none
        (nn.TransformerEncoder, "use_nested_tensor", False))


def _switches(model: nn.Module, names: Iterable[str]) -> dict[tuple[int, str], tuple[nn.Module, str, object]]:
    """{(id, attribute): (ancestor, attribute, off value)} for the fused-path ancestors of the named modules."""
    found = {}
    for name in names:
        parts = name.split(".") if name else []
        for depth in range(len(parts)):
            ancestor = model.get_submodule(".".join(parts[:depth]))
            for kind, attribute, off in _OFF:
                if isinstance(ancestor, kind):
                    found[id(ancestor), attribute] = (ancestor, attribute, off)
    return found


def calls_children_as_modules(model: nn.Module, names: Iterable[str]) -> None:
    """Turns off the fast path of every transformer encoder (layer) above the named modules, for good."""
    for ancestor, attribute, off in _switches(model, names).values():
        setattr(ancestor, attribute, off)


@contextmanager
def children_called_as_modules(model: nn.Module, names: Iterable[str]) -> Iterator[None]:
    """The same for the duration of the block, then back as it was."""
    switches = _switches(model, names).values()
    saved = [(ancestor, attribute, getattr(ancestor, attribute)) for ancestor, attribute, _ in switches]
    try:
        for ancestor, attribute, off in switches:
            setattr(ancestor, attribute, off)
        yield
    finally:
        for ancestor, attribute, value in saved:
            setattr(ancestor, attribute, value)
