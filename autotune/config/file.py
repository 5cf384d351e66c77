"""A stand-alone YAML tuning file: the model, how to score it, and a `tuning:` section that is a TuningConfig.

    model:      {factory: "package.module:callable", kwargs: {...}}
    evaluation: {eval_fn: "package.module:factory", kwargs: {...}}      # factory(**kwargs) -> eval_fn
            or  {dataset: {files: data.parquet}, inputs: image, label: label, metric: accuracy, batch_size: 64}
    example_inputs: {factory: "package.module:callable", kwargs: {...}} # optional
    calibration: {run_fn: "package.module:factory", kwargs: {...}}      # optional: factory(**kwargs) -> run_fn
    tuning:     {...}                                                   # autotune.config.TuningConfig

`${VAR}` / `$VAR` are expanded in every string value (a variable that is not set is an error). Relative dataset
paths are read from the config file's folder; the storage URL is used as is (a relative SQLite path is from the
working directory). A config is code: its import paths name callables that run with your permissions.
"""
from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator
from torch import nn

from autotune.config.tuning import StrictModel, TuningConfig, split_import_path
from autotune.dataset_eval import dataset_eval
from autotune.errors import ConfigError, did_you_mean, masked

# `$$` (a literal `$`), `${VAR}` or `$VAR`; any other `$` is text. A variable's value is not scanned again.
_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)\}|(\w+))")


def expand_env(value: str, typed: bool = False) -> Any:
    """`${VAR}` and `$VAR` replaced by the environment's values, `$$` by `$`; a variable that is not set is an
    error instead of being left as text. `typed`: a string that is one variable alone takes its value as YAML reads
    a number or a boolean (a factory's `kwargs: {batch: "${BATCH}"}` with BATCH=64 gives 64: nothing coerces a
    factory's own arguments, as pydantic does the config's fields)."""
    text = _expanded(value)
    whole = _VARIABLE.fullmatch(value)
    if typed and whole and not whole.group(1):
        try:
            scalar = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        return scalar if isinstance(scalar, (int, float, bool)) else text
    return text


def _expanded(value: str) -> str:
    def replaced(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(3)
        if name not in os.environ:
            raise ValueError(f"environment variable {name} is not set (in {masked(value)!r}; write $$ for a $ itself)")
        return os.environ[name]
    return _VARIABLE.sub(replaced, value)


def expand_env_everywhere(data: Any, path: str = "") -> Any:
    """`data` with `${VAR}` / `$VAR` expanded in every string value (keys are left alone).

    Raises:
        ConfigError: naming the field whose string uses a variable that is not set.
    """
    if isinstance(data, str):
        try:
            return expand_env(data, typed=".kwargs." in f".{path}")
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}", [(path, str(exc))]) from None
    if isinstance(data, dict):
        return {key: expand_env_everywhere(value, f"{path}.{key}" if path else str(key)) for key, value in data.items()}
    if isinstance(data, list):
        return [expand_env_everywhere(value, f"{path}.{index}") for index, value in enumerate(data)]
    return data


def resolve(import_path: str) -> Any:
    """The object at "package.module:attribute" (the attribute may be dotted)."""
    module_name, attribute = split_import_path(import_path)
    try:
        target = importlib.import_module(module_name)
    except Exception as exc:   # the user's module may raise anything as it is imported
        raise ValueError(f"cannot import module {module_name!r} of {import_path!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            names = [name for name in dir(target) if not name.startswith("_")]
            raise ValueError(f"{import_path!r}: module {module_name!r} has no attribute {attribute!r}"
                             + did_you_mean(part, names)) from None
    if not callable(target):
        raise ValueError(f"{import_path!r} is not callable")
    return target


def _resolves(import_path: str) -> str:
    resolve(import_path)
    return import_path


ImportPath = Annotated[str, AfterValidator(_resolves)]


class Factory(StrictModel):
    """A callable named by import path, called with `kwargs`."""

    factory: ImportPath
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def build(self, field: str) -> Any:
        return call_factory(self.factory, self.kwargs, field)


def call_factory(factory: str | Callable[..., Any], kwargs: dict[str, Any], field: str, makes: str = "") -> Any:
    """Calls the user's factory (a callable, or its import path); its failure becomes a ConfigError naming the
    field (no traceback in the CLI). `makes`: what the factory returns, said where the callable named wants an
    argument the kwargs do not give (an eval_fn(model) named in place of the factory returning it)."""
    try:
        return (resolve(factory) if isinstance(factory, str) else factory)(**kwargs)
    except Exception as exc:
        hint = ""
        if makes and isinstance(exc, TypeError) and "required positional argument" in str(exc):
            hint = f" ({field} names a factory, called with its kwargs alone, that returns {makes})"
        raise ConfigError(f"{field}: {getattr(factory, '__name__', factory)}(**{kwargs}) raised "
                          f"{type(exc).__name__}: {exc}{hint}", [(field, str(exc))]) from exc


class DatasetFiles(StrictModel):
    """Local files read with `datasets.load_dataset(format, data_files=files)`; nothing is downloaded."""

    files: list[str] = Field(min_length=1)
    format: Literal["csv", "json", "parquet"] | None = Field(None, description="default: from the file suffix")

    @field_validator("files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("files")
    @classmethod
    def _existing(cls, files: list[str], info: ValidationInfo) -> list[str]:
        base = Path((info.context or {}).get("base_dir", "."))
        found = []
        for name in files:
            path = base / name
            if not path.is_file():
                raise ValueError(f"dataset file not found: {path}")
            found.append(str(path))
        return found

    @model_validator(mode="after")
    def _known_format(self) -> DatasetFiles:
        self.file_format  # noqa: B018 -- raises when the suffixes do not tell
        return self

    @property
    def file_format(self) -> str:
        if self.format is not None:
            return self.format
        suffixes = {Path(f).suffix.lstrip(".").replace("jsonl", "json") for f in self.files}
        if len(suffixes) != 1 or not suffixes <= {"csv", "json", "parquet"}:
            raise ValueError(f"cannot tell the format from the suffixes {sorted(suffixes)}; "
                             "set format: csv | json | parquet")
        return suffixes.pop()


class Evaluation(StrictModel):
    """Either an eval_fn factory, or the built-in evaluator over a local dataset."""

    eval_fn: ImportPath | None = Field(None, description="factory(**kwargs) returning eval_fn(model) -> number")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetFiles | None = None
    inputs: str | list[str] | dict[str, str] | None = Field(
        None, description="column: one positional tensor; list: columns stacked as features; "
                          "mapping: keyword argument -> column")
    input_shape: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, min_length=1, description="reshape each example (the positional input only)")
    input_dtype: Literal["float32", "int64"] = "float32"
    label: str | None = None
    metric: Literal["accuracy", "f1", "mse"] = "accuracy"
    batch_size: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _one_kind(self) -> Evaluation:
        if (self.eval_fn is None) == (self.dataset is None):
            raise ValueError("give either eval_fn (a factory import path) or dataset (the built-in evaluator)")
        if self.dataset is not None and (self.inputs is None or self.label is None):
            raise ValueError("the built-in evaluator needs inputs (the model's columns) and label")
        builtin_only = self.model_fields_set & {"inputs", "input_shape", "input_dtype", "label", "metric",
                                                "batch_size"}
        if self.eval_fn is not None and builtin_only:
            raise ValueError(f"{sorted(builtin_only)} belong to the built-in evaluator (dataset:), not to eval_fn")
        if self.dataset is not None and self.kwargs:
            raise ValueError("kwargs belong to eval_fn, not to the built-in evaluator")
        if isinstance(self.inputs, dict) and self.input_shape is not None:   # it was dropped without a word
            raise ValueError("input_shape reshapes the one positional input (inputs: a column or a list of them); "
                             "with inputs as a mapping of keyword arguments, reshape in the model or give a column "
                             "of rows already shaped")
        return self

    def build(self) -> Callable[[nn.Module], float]:
        if self.eval_fn is not None:
            eval_fn = call_factory(self.eval_fn, self.kwargs, "evaluation.eval_fn", "eval_fn(model)")
            if not callable(eval_fn):
                raise ConfigError(f"evaluation.eval_fn: {self.eval_fn} returned {type(eval_fn).__name__}, "
                                  "not an eval_fn(model) -> number", [("evaluation.eval_fn", self.eval_fn)])
            return eval_fn
        return dataset_eval(self)


class CalibrationFn(StrictModel):
    """INC's run_fn: `run_fn(model)` feeds the model calibration data (its first batches are used: see `autotune`)."""

    run_fn: ImportPath = Field(description="factory(**kwargs) returning run_fn(model)")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def build(self) -> Callable[[nn.Module], Any]:
        run_fn = call_factory(self.run_fn, self.kwargs, "calibration.run_fn", "run_fn(model)")
        if not callable(run_fn):
            raise ConfigError(f"calibration.run_fn: {self.run_fn} returned {type(run_fn).__name__}, not a "
                              "run_fn(model)", [("calibration.run_fn", self.run_fn)])
        return run_fn


class FileConfig(StrictModel):
    display_name = "config"
    model: Factory
    evaluation: Evaluation
    example_inputs: Factory | None = Field(None, description="default: the first batch eval_fn feeds the model")
    calibration: CalibrationFn | None = Field(None, description="default: calibrated on the first batches eval_fn "
                                                                "feeds the model (or example_inputs)")
    tuning: TuningConfig = Field(default_factory=TuningConfig, validate_default=True)

    @field_validator("tuning")
    @classmethod
    def _metric_direction(cls, tuning: TuningConfig, info: ValidationInfo) -> TuningConfig:
        evaluation = info.data.get("evaluation")  # absent when evaluation itself was invalid
        if evaluation is not None and evaluation.dataset is not None and evaluation.metric == "mse":
            if "higher_is_better" in tuning.model_fields_set and tuning.higher_is_better:
                raise ValueError("evaluation.metric mse is lower-is-better; set higher_is_better: false")
            tuning.higher_is_better = False
        return tuning

    def build_model(self) -> nn.Module:
        model = self.model.build("model.factory")
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory: {self.model.factory} returned {type(model).__name__}, "
                              "not a torch.nn.Module", [("model.factory", self.model.factory)])
        return model

    def build_example_inputs(self) -> Any:
        return None if self.example_inputs is None else self.example_inputs.build("example_inputs.factory")

    def build_run_fn(self) -> Callable[[nn.Module], Any] | None:
        return None if self.calibration is None else self.calibration.build()


def parse_config(data: Any, base_dir: Path | str = ".", source: str = "config") -> FileConfig:
    """Validates a mapping; relative dataset paths are read from `base_dir`.

    Raises:
        ConfigError: naming `source` and each bad field.
    """
    try:
        return FileConfig.from_mapping(expand_env_everywhere(data), context={"base_dir": Path(base_dir)})
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}", exc.errors) from None


def _where(path: Path | str, text: str, position: int) -> str:
    """`file:line:column` of a character offset."""
    line_start = text.rfind("\n", 0, position) + 1
    return f"{path}:{text.count(chr(10), 0, position) + 1}:{position - line_start + 1}"


def load_config(path: str | os.PathLike) -> FileConfig:
    """Reads and validates a YAML tuning file.

    Args:
        path: the YAML file; relative dataset paths in it are read from its folder.
    Returns:
        The validated FileConfig (model factory, evaluation, example inputs, tuning).
    Raises:
        ConfigError: naming the file, and the line or field, of every problem found.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{_where(path, raw.decode('utf-8', 'replace'), exc.start)}: not UTF-8 text "
                          f"(byte {raw[exc.start]:#04x})") from None
    return parse_config(read_yaml(text, str(path)), path.parent, str(path))


def without_storage(data: dict) -> dict:
    """A job's config mapping without `tuning.storage`: a worker uses its own storage, and a ${VAR} there names a
    variable of the submitter's shell (a worker without it failed the job over a field it ignores)."""
    tuning = data.get("tuning")
    if not isinstance(tuning, dict) or "storage" not in tuning:
        return data
    return {**data, "tuning": {key: value for key, value in tuning.items() if key != "storage"}}


def check_without_imports(data: dict, source: str) -> None:
    """What a job's config can be checked for before a worker imports what it names (`autotune submit`): its
    sections, and its `tuning` fields (`storage` aside: a worker uses its own). A variable the submitter's shell
    does not set may be set where the workers run: its fields are then left to them.

    Raises:
        ConfigError: naming `source` and the unknown section or bad field.
    """
    unknown = sorted(set(data) - set(FileConfig.model_fields))
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {', '.join(unknown)}; a config has "
                          f"{', '.join(FileConfig.model_fields)}" + did_you_mean(unknown[0], FileConfig.model_fields))
    tuning = without_storage(data).get("tuning")
    if not isinstance(tuning, dict):
        return
    try:
        tuning = expand_env_everywhere(tuning)
    except ConfigError:
        return
    try:
        TuningConfig.from_mapping(tuning)
    except ConfigError as exc:   # worded as `tune` words it: the field's path in the whole config
        raise ConfigError.of_fields("config", [(f"tuning.{path}", message) for path, message in exc.errors],
                                    source) from None


def yaml_error(exc: yaml.YAMLError, source: str, text: str) -> str:
    """What is wrong in the YAML (or JSON) text read from `source`, in one line naming where: pyyaml's own message
    spans several lines, quoting the text."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        kind = "YAML error" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        return f"{where}: {kind}: {exc.problem or exc.context}"
    if isinstance(exc, yaml.reader.ReaderError):
        return f"{_where(source, text, exc.position)}: YAML syntax error: character {exc.character!r} is not allowed"
    return f"{source}: YAML error: {' '.join(str(exc).split())}"


class _OneOfEachKey(yaml.SafeLoader):
    """safe_load's loader, refusing a key given twice in one mapping: pyyaml keeps the last without a word, so a
    second `model:` or `tuning:` dropped the first's settings. A key overriding one merged in with `<<` is fine."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping (first on line {first[key].line + 1})",
                    key_node.start_mark)
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load of `text` (YAML or JSON), but a key given twice in one mapping is a yaml.YAMLError."""
    return yaml.load(text, Loader=_OneOfEachKey)


def read_yaml(text: str, source: str) -> dict:
    """The mapping a YAML config's text holds, not yet validated.

    Raises:
        ConfigError: naming `source` and the line of a syntax error, or saying the text is not a mapping.
    """
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error(exc, source, text)) from None
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested too deeply to read") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with model, evaluation and tuning; "
                          f"got {type(data).__name__}")
    return data
