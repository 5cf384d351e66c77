"""Notes torch and torchao print about their own internals while finalists are built, compiled, run and saved: a
CUDA-only extension a CPU build cannot load, a deprecation inside torchao's import, a tensor copy inside
inductor's int8 lowering, the traceback of a first try at reading an exported file (the error that follows says
it). They ask nothing of the user and read like failures at the end of a tuning run, so they are dropped by
message, each at the logger or warning that gives it; every other message of those libraries reaches the user as
ever."""
from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

# logger name -> what its notes say (torch 2.13, torchao 0.18)
LOGGED_NOTES = {
    "torchao": r"Failed to load .*torchao/_C_",                       # CUDA kernels, absent from a CPU build
    "torchao.kernel.intmm": r"Detected no triton",
    "torch.utils._pytree": r"is an Enum subclass and is now natively supported",   # torchao registers one
    # export of data-dependent control flow: the graph traced so far, before the error the engine reports in a line
    "torch.fx.experimental.symbolic_shapes": r"Unable to find user code corresponding to",
    # a file torch.export.load cannot open: it dumps the traceback, then tries its older format, which raises
    "torch.export": r"Ran into the following error when deserializing",
    # a meta kernel refusing what the model computes (a bf16 matmul with an fp32 constant): the traceback, then the
    # error the engine reports in a line
    "torch._subclasses.fake_tensor": r"failed while attempting to run meta for",
}
WARNED_NOTES = (
    r"No complete tensor found in the group",    # torch.export.save of weights that share storage
    r"TypedStorage is deprecated",               # torch.load rebuilding int8 weights (a compile-cache read)
)

# inductor's int8 convolution lowering copies a tensor with torch.tensor() at every frozen compile, at any later call
# of a compiled model too, so this one is dropped for the whole process (module-scoped: only that lowering's)
warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning,
                        module=r"torch\._inductor\.mkldnn_lowerings")
# and its C++ code generation notes a plan's bf16 and fp16 modules meeting in one fused kernel, at the first call
# of each shape, where it computes each in its own dtype as asked
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node", category=UserWarning,
                        module=r"torch\._inductor\.codegen\.cpp")


class _DropNote(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextmanager
def library_notes_dropped() -> Iterator[None]:
    """Within it, the notes above are not shown; warnings' filters are restored after it as they were."""
    with ExitStack() as stack:
        for name, pattern in LOGGED_NOTES.items():
            logger, note = logging.getLogger(name), _DropNote(pattern)
            logger.addFilter(note)
            stack.callback(logger.removeFilter, note)
        stack.enter_context(warnings.catch_warnings())
        for pattern in WARNED_NOTES:
            warnings.filterwarnings("ignore", message=pattern)
        yield
