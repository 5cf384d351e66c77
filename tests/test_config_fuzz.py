"""Property-based tests of the config loaders: whatever comes in, it loads or raises ConfigError naming the problem.

(a) Mappings for `TuningConfig.from_mapping` / `TuningConfig(**mapping)`: valid configs with one mutation applied
    (a key dropped, an unknown key added, a field or a config_set entry given junk, a deeply nested value).
(b) Text for `load_config`: the shipped configs/mnist.yaml with lines deleted, characters inserted, lines
    re-indented, keys renamed or values swapped; and arbitrary text and bytes.

Nothing but ConfigError may escape (no ValidationError, TypeError, KeyError, RecursionError...). The inputs that
once escaped as other exceptions are kept as plain regression tests at the bottom.
"""
from __future__ import annotations

import copy
import decimal
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from autotune.backends import dtype_names
from autotune.config import MixedPrecisionConfig, TuningConfig
from autotune.config.file import Evaluation, Factory, FileConfig, load_config
from autotune.errors import ConfigError

DTYPES = tuple(dtype_names())

SHIPPED = Path(__file__).parent.parent / "configs" / "mnist.yaml"
FIELDS = sorted(TuningConfig.model_fields)                 # read here, so fields added later are fuzzed too
NESTED_FIELDS = sorted(MixedPrecisionConfig.model_fields)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_FILES = settings(FUZZ, max_examples=250,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def load_or_config_error(load: Callable[[], Any]) -> ConfigError | None:
    """None if it loaded, the ConfigError if it was rejected; anything else escaping fails the test."""
    try:
        load()
    except ConfigError as exc:
        assert str(exc).strip(), "a ConfigError with an empty message"
        return exc
    return None


# ---------------------------------------------------------------------------------------- valid configs

one_or_many = lambda values: values | st.lists(values, min_size=1, max_size=3)  # noqa: E731
patterns = st.sampled_from(["*", "fc*", "layers.*.attn", "lm_head", "conv?"])

mixed_precision_dicts = st.fixed_dictionaries({}, optional={
    "dtype": one_or_many(st.sampled_from(DTYPES)),
    "module_types": one_or_many(st.sampled_from(["Linear", "Conv2d", "torch.nn.Linear", "Embedding"])),
    "include": st.lists(patterns, max_size=2) | patterns,
    "exclude": st.lists(patterns, max_size=2) | patterns,
})

VALID_VALUES: dict[str, st.SearchStrategy] = {
    "config_set": mixed_precision_dicts | st.lists(mixed_precision_dicts, min_size=1, max_size=3),
    "tolerable_loss": st.floats(0, 1, exclude_max=True) | st.just(0),   # 1 or more is refused as relative
    "loss_kind": st.sampled_from(["relative", "absolute"]),
    "higher_is_better": st.booleans(),
    "max_trials": st.integers(1, 10_000),
    "patience": st.integers(1, 100),
    "timeout": st.none() | st.floats(0.001, 1e6),
    "study_name": st.none() | st.text(min_size=1, max_size=20),
    "storage": st.sampled_from(["sqlite:///studies/autotune.db", "sqlite:///:memory:", "postgresql://h/db"]),
    "seed": st.integers(0, 2**32 - 1),
    "device": st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:7", "meta"]),
    "num_threads": st.none() | st.integers(1, 256),
    "warmup": st.integers(0, 20),
    "repeats": st.integers(3, 100),
}

valid_configs = st.fixed_dictionaries(
    {}, optional={name: values for name, values in VALID_VALUES.items() if name in FIELDS})


# ------------------------------------------------------------------------------------------------- junk

extreme_numbers = st.sampled_from([
    0, -1, -0.0, 2**31, 2**63, 2**64 + 1, 10**100, -(10**100), 1e308, -1e308, 5e-324, math.nan, math.inf,
    -math.inf, decimal.Decimal("NaN"), decimal.Decimal("sNaN"), decimal.Decimal("-Infinity"),
    decimal.Decimal("1e999"), 1j])
strings_where_numbers_go = st.sampled_from([
    "", " ", "1", "0", "-1", "1.5", "1e400", "nan", "NaN", "inf", "-inf", "0x10", "1_000", " 3 ", "true", "no",
    "null", "~", "cpu", "int8", "fp32", "relative", "\x00", "日本"])
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.binary(max_size=8)
           | st.decimals(allow_nan=False) | st.complex_numbers() | st.dates()
           | extreme_numbers | strings_where_numbers_go)
junk = st.recursive(
    scalars,
    lambda children: (st.lists(children, max_size=4) | st.tuples(children, children)
                      | st.frozensets(st.integers() | st.text(max_size=4) | st.none(), max_size=3)
                      | st.dictionaries(st.text(max_size=8), children, max_size=3)
                      | st.dictionaries(st.integers() | st.none() | st.booleans(), children, max_size=2)),
    max_leaves=12)


@st.composite
def deeply_nested(draw) -> Any:
    """Lists or dicts (or alternating) nested up to 20000 levels deep, built without recursion. (Hypothesis raises
    the recursion limit by 2000 while a test runs, so depths that overflow it must go well past 3000.)"""
    depth = draw(st.integers(1, 40) | st.integers(200, 20_000))
    kind = draw(st.sampled_from(["list", "dict", "alternating", "dtype-dict"]))
    value: Any = draw(scalars)
    for level in range(depth):
        if kind == "list" or (kind == "alternating" and level % 2):
            value = [value]
        elif kind == "dtype-dict":
            value = {"dtype": value}
        else:
            value = {"a": value}
    return value


mappings_with_non_string_keys = st.dictionaries(st.integers() | st.none() | st.booleans(), junk, min_size=1)

unknown_keys = (st.text(min_size=1, max_size=16).filter(lambda key: key not in FIELDS)
                | st.sampled_from(["max_trial", "tolerance", "Seed", "config_set ", "config_set.0", "__class__",
                                   "model_config", "model_fields", "_single_to_list", "__dict__", "self"]))


# ------------------------------------------------------------------------------------- mapping mutations
# Each draws a valid config, mutates one thing, and returns (mapping, path, rejected): `path` is what a
# ConfigError's message must name (None where the mutation has to load), `rejected` whether the mutation must not
# load (an unknown key, a non-mapping or non-string key where a config goes); junk in a known field may happen
# to be valid, and then what loads must honour the documented constraints.

def is_config_mapping(value: Any, fields: list[str]) -> bool:
    """Whether `value` is a mapping whose keys are all names of `fields` (its values may still be invalid)."""
    return isinstance(value, dict) and all(isinstance(key, str) and key in fields for key in value)


@st.composite
def with_keys_dropped(draw) -> tuple[dict, None, bool]:
    config = draw(valid_configs)
    kept = draw(st.lists(st.sampled_from(sorted(config)), unique=True)) if config else []
    return {key: config[key] for key in kept}, None, False


@st.composite
def with_unknown_key(draw) -> tuple[dict, str, bool]:
    config, key = draw(valid_configs), draw(unknown_keys)
    config[key] = draw(junk)
    return config, key, True


@st.composite
def with_junk_field(draw) -> tuple[dict, str, bool]:
    """One known field given a wrong type, an extreme number, NaN/inf, a numeric string, None or nested junk."""
    config, field = draw(valid_configs), draw(st.sampled_from(FIELDS))
    config[field] = draw(junk | extreme_numbers | strings_where_numbers_go | deeply_nested())
    return config, field, False


@st.composite
def with_junk_in_config_set(draw) -> tuple[dict, str, bool]:
    """config_set as a list of valid entries, then one entry, or one field of it, replaced by junk."""
    config = draw(valid_configs)
    entries = draw(st.lists(mixed_precision_dicts, min_size=1, max_size=3))
    index = draw(st.integers(0, len(entries) - 1))
    target = draw(st.sampled_from(["whole entry", "known field", "unknown key"]))
    if target == "whole entry":
        entries[index] = draw(junk | deeply_nested() | mappings_with_non_string_keys)
        path, rejected = f"config_set.{index}", not is_config_mapping(entries[index], NESTED_FIELDS)
    else:
        key = draw(st.sampled_from(NESTED_FIELDS) if target == "known field" else
                   st.text(min_size=1, max_size=10).filter(lambda k: k not in NESTED_FIELDS))
        entries[index] = {**entries[index], key: draw(junk | deeply_nested())}
        path, rejected = f"config_set.{index}.{key}", target == "unknown key"
    config["config_set"] = entries
    return config, path, rejected


mutated_mappings = st.one_of(with_keys_dropped(), with_unknown_key(), with_junk_field(),
                             with_junk_in_config_set())

LOADERS = {
    "from_mapping": TuningConfig.from_mapping,
    "keywords": lambda mapping: TuningConfig(**mapping),
}


def check_loaded_config(config: TuningConfig) -> None:
    """What loads honours the documented constraints, and survives a dump-and-load round trip."""
    assert config.config_set and all(mp.dtype and set(mp.dtype) <= set(DTYPES) for mp in config.config_set)
    assert config.tolerable_loss >= 0 and config.max_trials >= 1 and config.patience >= 1
    assert config.timeout is None or config.timeout > 0
    assert config.repeats >= 3 and config.warmup >= 0
    assert TuningConfig.from_mapping(config.model_dump()) == config


@pytest.mark.parametrize("loader", LOADERS)
@FUZZ
@given(valid_configs)
def test_valid_configs_load(loader, mapping):
    check_loaded_config(LOADERS[loader](mapping))


@pytest.mark.parametrize("loader", LOADERS)
@FUZZ
@given(mutated_mappings)
def test_mutated_config_loads_or_names_the_mutated_field(loader, mutation):
    mapping, path, rejected = mutation
    if path is None:
        check_loaded_config(LOADERS[loader](mapping))
        return
    error = load_or_config_error(lambda: check_loaded_config(LOADERS[loader](mapping)))
    assert error is not None or not rejected, f"{path!r} should have been rejected, but this loaded: {mapping!r:.300}"
    if error is not None:
        assert error.errors, f"ConfigError without (path, message) pairs: {error}"
        assert path in str(error), f"the message does not name {path!r}:\n{error}"
        event(f"rejected: {path.split('.')[0] if path.split('.')[0] in FIELDS else 'unknown key'}")


non_mappings = junk.filter(lambda value: not isinstance(value, dict)) | deeply_nested()


@FUZZ
@given(non_mappings | mappings_with_non_string_keys)
def test_anything_but_a_mapping_of_names_is_a_config_error(data):
    # deeply_nested() also draws mappings, of unknown keys ("a", "dtype"): rejected all the same.
    error = load_or_config_error(lambda: TuningConfig.from_mapping(data))
    assert error is not None, f"loaded: {data!r:.200}"
    assert "TuningConfig" in str(error)


def test_unknown_key_is_named_even_when_it_is_not_an_identifier():
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"max trials!": 3})
    assert ("max trials!", "Extra inputs are not permitted; did you mean 'max_trials'?") in info.value.errors


# ------------------------------------------------------------------------------------------ YAML mutations

BASE_TEXT = SHIPPED.read_text()
YAML_KEYS = sorted({*FileConfig.model_fields, *FIELDS, *NESTED_FIELDS, "factory", "kwargs", "eval_fn",
                    "dataset", "files", "inputs", "label", "metric", "limit", "batch_size"})
YAML_VALUES = ["null", "~", "[]", "{}", "''", "-1", "0", "1e400", ".nan", ".inf", "-.inf", "yes", "off",
               "2001-12-14", "!!binary aGk=", "!!python/name:os.system", "*nowhere", "&anchor 3", "|", ">-",
               "[int8, fp4]", "{a: 1}", "'x:y'", "autotune.workloads.mnist:nothing", "no_module:thing",
               "autotune.workloads.mnist:model", "sqlite:///${NOT_SET_ANYWHERE}/x.db", "$HOME", '"\\x00"',
               "- a\n- b", "[[[[1]]]]"]
KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w]*):(?P<rest>.*)$")
one_line_text = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), min_size=1, max_size=10)
yaml_characters = (st.sampled_from(list(":-[]{},#&*!|>'\"%@`?\t\n \\$")) | st.characters(codec="utf-8"))


def _lines(text: str) -> list[str]:
    return text.split("\n")


def _key_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if KEY_LINE.match(line)]


def delete_lines(draw, text: str) -> str:
    lines = _lines(text)
    for _ in range(draw(st.integers(1, 3))):
        if lines:
            del lines[draw(st.integers(0, len(lines) - 1))]
    return "\n".join(lines)


def insert_characters(draw, text: str) -> str:
    for _ in range(draw(st.integers(1, 5))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(yaml_characters) + text[at:]
    return text


def reindent_line(draw, text: str) -> str:
    lines = _lines(text)
    i = draw(st.integers(0, len(lines) - 1))
    lines[i] = draw(st.sampled_from(["", " ", "  ", "   ", "    ", "      ", "\t"])) + lines[i].lstrip()
    return "\n".join(lines)


def rename_key(draw, text: str) -> str:
    lines = _lines(text)
    candidates = _key_lines(lines)
    if not candidates:
        return text
    i = draw(st.sampled_from(candidates))
    match = KEY_LINE.match(lines[i])
    new_key = draw(st.sampled_from(YAML_KEYS) | one_line_text)
    lines[i] = f"{match['indent']}{new_key}:{match['rest']}"
    return "\n".join(lines)


def swap_values(draw, text: str) -> str:
    """Two keys trade values, or one key's value becomes one of YAML_VALUES."""
    lines = _lines(text)
    candidates = _key_lines(lines)
    i, j = draw(st.sampled_from(candidates)), draw(st.sampled_from(candidates))
    first, second = KEY_LINE.match(lines[i]), KEY_LINE.match(lines[j])
    if draw(st.booleans()):
        lines[i] = f"{first['indent']}{first['key']}:{second['rest']}"
        lines[j] = f"{second['indent']}{second['key']}:{first['rest']}"
    else:
        lines[i] = f"{first['indent']}{first['key']}: {draw(st.sampled_from(YAML_VALUES))}"
    return "\n".join(lines)


TEXT_MUTATIONS = [delete_lines, insert_characters, reindent_line, rename_key, swap_values]


@st.composite
def mutated_mnist_yaml(draw) -> str:
    text = BASE_TEXT
    for _ in range(draw(st.integers(1, 4))):
        mutate = draw(st.sampled_from(TEXT_MUTATIONS))
        text = mutate(draw, text)
    return text


yaml_like_text = st.text(st.sampled_from(list("abz019 :-[]{},#&*!|>'\"%@\n\t.~")), max_size=200)
arbitrary_text = st.text(st.characters(codec="utf-8"), max_size=300)


@st.composite
def deeply_nested_yaml(draw) -> str:
    """Compact block sequences ("- - - x") up to 20000 levels deep; flow collections up to 300 only, as PyYAML's
    scanner is quadratic in flow depth (2000 levels of "[" took 5 s to fail)."""
    block_depth, flow_depth = draw(st.integers(1, 20_000)), draw(st.integers(1, 300))
    return draw(st.sampled_from([
        "- " * block_depth + "x",
        "tuning:\n  config_set: " + "- " * block_depth + "{}",
        "tuning: " + "[" * flow_depth + "]" * flow_depth,
        "tuning: " + "{a: " * flow_depth + "}" * flow_depth,
    ]))


def check_config_file(path: Path, content: str | bytes) -> None:
    """load_config(path) loads or raises ConfigError naming the file; a YAML syntax error also names the line."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    error = load_or_config_error(lambda: load_config(path))
    if error is None:
        return
    message = str(error)
    assert message.startswith(str(path)), f"the message does not start with the file name:\n{message}"
    if "YAML syntax error" in message:
        where = re.match(rf"{re.escape(str(path))}:(\d+):(\d+): YAML syntax error", message)
        assert where, f"a YAML syntax error without file:line:column:\n{message}"
        lines = (content.count(b"\n") if isinstance(content, bytes) else content.count("\n")) + 1
        assert 1 <= int(where[1]) <= lines + 1, f"line {where[1]} of a {lines}-line file"
        event("YAML syntax error")
    else:
        event(message.splitlines()[0][len(str(path)):][:40])


@FUZZ_FILES
@given(mutated_mnist_yaml())
def test_mutated_mnist_yaml_loads_or_is_a_config_error(tmp_path, text):
    check_config_file(tmp_path / "mutated.yaml", text)


@FUZZ_FILES
@given(yaml_like_text | arbitrary_text | deeply_nested_yaml() | st.binary(max_size=200))
def test_arbitrary_text_is_a_config_error(tmp_path, content):
    check_config_file(tmp_path / "arbitrary.yaml", content)


# The shipped config as data: each section, where its keys go in it, and the names it knows.
BASE_DATA = yaml.safe_load(BASE_TEXT)
SECTIONS = {"(top level)": ((), sorted(FileConfig.model_fields)), "model": (("model",), sorted(Factory.model_fields)),
            "evaluation": (("evaluation",), sorted(Evaluation.model_fields)), "tuning": (("tuning",), FIELDS),
            "tuning.config_set": (("tuning", "config_set"), NESTED_FIELDS)}
FUZZ_SECTIONS = settings(FUZZ_FILES, max_examples=40)
yaml_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=8)
# Keys PyYAML reads as something else than the text (booleans, null): a key test needs the text back.
YAML_NON_STRINGS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null"}


def write_with(tmp_path: Path, section: str, change: Callable[[dict], Any]) -> Path:
    """The shipped config with `change` applied to one of its sections (the top level included), as a file."""
    data = copy.deepcopy(BASE_DATA)
    where, _ = SECTIONS[section]
    target = data
    for key in where:
        target = target[key]
    change(target)
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@FUZZ_SECTIONS
@given(section=st.sampled_from(sorted(SECTIONS)), key=st.from_regex(r"[A-Za-z_][A-Za-z0-9_ -]{0,14}", fullmatch=True),
       value=yaml_values)
def test_an_unknown_key_in_any_section_of_a_file_is_a_config_error_naming_it(tmp_path, section, key, value):
    known = SECTIONS[section][1]
    if key in known or key.lower() in YAML_NON_STRINGS or key != key.strip():
        return
    path = write_with(tmp_path, section, lambda target: target.__setitem__(key, value))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)) and key in str(info.value), str(info.value)


@FUZZ_SECTIONS
@given(section=st.sampled_from(sorted(SECTIONS)), key=st.integers() | st.booleans() | st.none() | st.floats())
def test_a_key_that_is_not_a_string_in_any_section_of_a_file_is_a_config_error(tmp_path, section, key):
    path = write_with(tmp_path, section, lambda target: target.__setitem__(key, 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)), str(info.value)


@FUZZ_SECTIONS
@given(section=st.sampled_from([name for name in SECTIONS if name != "(top level)"]),
       value=yaml_values.filter(lambda value: not isinstance(value, dict)))
def test_a_section_that_is_not_a_mapping_is_a_config_error_naming_it(tmp_path, section, value):
    *parents, name = SECTIONS[section][0]
    path = write_with(tmp_path, ".".join(parents) or "(top level)", lambda target: target.__setitem__(name, value))
    if section == "tuning.config_set" and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return   # a list of entries is a valid config_set shape (the entries themselves are fuzzed above)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)) and name in str(info.value), str(info.value)


def test_unmutated_base_text_loads(tmp_path):
    path = tmp_path / "mnist.yaml"
    path.write_text(BASE_TEXT)
    assert load_config(path).tuning.study_name == "mnist"


# ------------------------------------------------------------- inputs that once escaped as other exceptions

def _mnist_with(tmp_path: Path, old: str, new: str) -> Path:
    assert old in BASE_TEXT
    path = tmp_path / "bug.yaml"
    path.write_text(BASE_TEXT.replace(old, new, 1))
    return path


@pytest.mark.parametrize("mapping", [{"config_set": [{1: "x"}]}, {"config_set": {None: "x"}}])
def test_nested_non_string_key_is_a_config_error(mapping):
    with pytest.raises(ConfigError):
        TuningConfig.from_mapping(mapping)


@pytest.mark.parametrize("load", [lambda: TuningConfig.from_mapping({"self": 1}),
                                  lambda: TuningConfig(**{"self": 1}),
                                  lambda: TuningConfig.from_mapping({"config_set": {"self": 1}})])
def test_key_named_self_is_a_config_error(load):
    with pytest.raises(ConfigError, match="self"):
        load()


def test_deeply_nested_non_mapping_is_a_config_error():
    data: list = []
    for _ in range(5000):
        data = [data]
    with pytest.raises(ConfigError):
        TuningConfig.from_mapping(data)


def test_relative_import_path_is_a_config_error(tmp_path):
    path = _mnist_with(tmp_path, "factory: autotune.workloads.mnist:model", "factory: .mnist:model")
    with pytest.raises(ConfigError, match="model.factory"):
        load_config(path)


def test_yaml_integer_key_in_a_section_is_a_config_error(tmp_path):
    path = _mnist_with(tmp_path, "  max_trials: 20", "  max_trials: 20\n  1: 2")
    with pytest.raises(ConfigError, match="tuning"):
        load_config(path)


def test_deeply_nested_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("- " * 5000 + "x")
    with pytest.raises(ConfigError, match="deep.yaml"):
        load_config(path)


def test_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(BASE_TEXT.replace("# Tune", "# Café: tune").encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml"):
        load_config(path)


def test_control_character_error_names_the_line(tmp_path):
    path = _mnist_with(tmp_path, "  max_trials: 20", "  max_trials: 20\x07")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:15:")
