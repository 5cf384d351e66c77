"""Every error the tuner raises on purpose derives from AutotuneError, so callers can catch one type."""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from pathlib import Path

# Up to the URL's last "@": a password holding an "@" not percent-encoded is then masked whole, not to its first.
_PASSWORD = re.compile(r"(://[^:/@\s]*:)\S*@")
UNENCODED_AT = ("; the URL holds more than one '@': characters such as @ / : # % in a password must be "
                "percent-encoded (@ as %40, / as %2F, : as %3A, # as %23, % as %25)")


def masked(text: str) -> str:
    """`text` with the password of any URL in it shown as ***, for messages."""
    return _PASSWORD.sub(r"\1***@", text)


def unencoded_at(url: str) -> bool:
    """Whether `url` holds a password with a raw "@": SQLAlchemy then reads what follows its first "@" as the host.
    An SQLite URL holds a file's path, which may have any number of them."""
    scheme, _, rest = url.partition("://")
    return not scheme.startswith("sqlite") and rest.count("@") > 1


def describe(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line for a log or a reason: "TypeName: the first line of its message", with the next
    where the first ends in a colon ("... See:" then a link), cut at `limit` (torch's messages run to pages of hints
    and tracebacks). A torch.compile error's first line names only what failed ("RuntimeError when making fake
    tensor call"): the error under it and the line of the model's code that raised it follow."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(exc).__name__}: {first[:limit]}{_compile_error_cause(str(exc))}"


def _compile_error_cause(text: str) -> str:
    """": <the error> (at file:line in function: code)" from dynamo's "Explanation:" line and "from user code:"
    block, or "" for other messages."""
    lines = [line.strip() for line in text.splitlines()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    cause = re.search(r"got (\w+\(.*\))$", explanation)
    said = f": {cause.group(1)[:200]}" if cause else ""
    if "from user code:" in lines:
        block = lines[lines.index("from user code:") + 1:]
        block = block[:block.index("")] if "" in block else block
        frames = [index for index, line in enumerate(block) if re.match(r'File ".+", line \d+, in ', line)]
        if frames:     # the innermost: listed last, its code on the next line
            found = re.match(r'File "(.+)", line (\d+), in (.+)', block[frames[-1]])
            code = block[frames[-1] + 1] if frames[-1] + 1 < len(block) else ""
            said += f" (at {Path(found.group(1)).name}:{found.group(2)} in {found.group(3)}" + \
                    (f": {code[:120]})" if code else ")")
    return said


# torch's names of the dtypes, which a config names as autotune does
TORCH_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                     "qint8": "int8", "quint8": "int8"}


def listed(names: list[str], most: int = 5) -> str:
    """"a, b, c and 4 more": the first `most` names of a list a message gives."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the choice closest to `given` (a misspelling, a torch dtype's name, another case),
    or "" where none is close."""
    choices = list(choices)
    lowered = {choice.lower(): choice for choice in choices}
    key = given.strip().lower().removeprefix("torch.")
    close = ([lowered[key]] if key in lowered else
             [TORCH_DTYPE_NAMES[key]] if TORCH_DTYPE_NAMES.get(key) in choices else
             difflib.get_close_matches(given, choices, n=1, cutoff=0.8))
    return f"; did you mean {close[0]!r}?" if close and close[0] != given else ""


class AutotuneError(Exception):
    """Base class of the errors autotune raises on purpose."""


class ConfigError(AutotuneError, ValueError):
    """A configuration value is missing, unknown or out of range. `errors` holds (field path, message) pairs."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.errors = errors or []

    @classmethod
    def from_validation(cls, exc, model_name: str, hints: dict[str, str] | None = None,
                        fields_at: Callable[[tuple], Iterable[str]] | None = None) -> ConfigError:
        """From a pydantic ValidationError: one (dotted field path, message) pair per error, the message naming the
        value given where it is a plain one the message does not show, and for an unknown field its `hints` entry
        (by its name: what to use instead) or else the closest of the fields beside it (`fields_at`: their names,
        given the unknown one's path); for a value not among the choices, the closest; one line for one error."""
        errors = []
        for err in exc.errors():
            path = ".".join(str(part) for part in err["loc"]) or model_name
            message, given = err["msg"].removeprefix("Value error, "), err.get("input")
            if err["type"] not in ("missing", "extra_forbidden") and isinstance(given, (str, int, float)) \
                    and str(given) not in message:
                message += f" (got {given!r})"
            if err["type"] == "extra_forbidden" and err["loc"]:
                name = str(err["loc"][-1])
                message += (f"; {hints[name]}" if name in (hints or {}) else
                            did_you_mean(name, fields_at(err["loc"][:-1])) if fields_at else "")
            if err["type"] == "literal_error" and isinstance(given, str):
                message += did_you_mean(given, re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected"))))
            errors.append((path, message))
        return cls.of_fields(model_name, errors)

    @classmethod
    def of_fields(cls, model_name: str, errors: list[tuple[str, str]], source: str = "") -> ConfigError:
        """`invalid {model_name}`, prefixed with `source`, and the (field path, message) pairs: one line for one."""
        start = f"{source}: invalid {model_name}" if source else f"invalid {model_name}"
        if len(errors) == 1:
            return cls(f"{start}: {errors[0][0]}: {errors[0][1]}", errors)
        lines = "\n".join(f"  {path}: {msg}" for path, msg in errors)
        return cls(f"{start}:\n{lines}", errors)


class EvalFunctionError(AutotuneError):
    """eval_fn is not callable, raised, or returned something that is not a finite number."""


class NoTunableModulesError(AutotuneError):
    """The model holds no module the configuration allows to be tuned."""


class PlanError(AutotuneError, ValueError):
    """A plan names modules the model does not have, or dtypes a module cannot take."""


class StorageError(AutotuneError):
    """The study storage cannot be opened or read: a URL that does not parse, a database driver that is not
    installed, a server that does not answer, a file that is not a database."""


class StudyMismatchError(AutotuneError):
    """An existing study was created for another model or search space."""


class EvalTimeoutError(AutotuneError):
    """eval_fn ran past the per-trial timeout (TuningConfig.trial_timeout)."""


class SaveError(AutotuneError, ValueError):
    """A tuned model cannot be written: a file name its engine's loader cannot read, or a model torch refuses to
    write (parametrizations where the engine pickles, a namedtuple output where it exports)."""
