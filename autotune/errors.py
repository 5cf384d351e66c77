"""Every error the tuner raises on purpose derives from AutotuneError, so callers can catch one type."""
from __future__ import annotations


def describe(exc: BaseException, limit: int = 300) -> str:
    """An exception in one line for a log or a reason: "TypeName: the first line of its message", with the next
    where the first ends in a colon ("... See:" then a link), cut at `limit` (torch's messages run to pages of hints
    and tracebacks)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
    first = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(exc).__name__}: {first[:limit]}"


class AutotuneError(Exception):
    """Base class of the errors autotune raises on purpose."""


class ConfigError(AutotuneError, ValueError):
    """A configuration value is missing, unknown or out of range. `errors` holds (field path, message) pairs."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.errors = errors or []

    @classmethod
    def from_validation(cls, exc, model_name: str) -> ConfigError:
        """From a pydantic ValidationError: one (dotted field path, message) pair per error, the message naming the
        value given where it is a plain one the message does not show; one line for one error."""
        errors = []
        for err in exc.errors():
            path = ".".join(str(part) for part in err["loc"]) or model_name
            message, given = err["msg"].removeprefix("Value error, "), err.get("input")
            if err["type"] not in ("missing", "extra_forbidden") and isinstance(given, (str, int, float)) \
                    and str(given) not in message:
                message += f" (got {given!r})"
            errors.append((path, message))
        if len(errors) == 1:
            return cls(f"invalid {model_name}: {errors[0][0]}: {errors[0][1]}", errors)
        lines = "\n".join(f"  {path}: {msg}" for path, msg in errors)
        return cls(f"invalid {model_name}:\n{lines}", errors)


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
