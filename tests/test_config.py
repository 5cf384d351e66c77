import pytest

from autotune import ConfigError, MixedPrecisionConfig, TuningConfig


def test_single_config_and_single_dtype_are_accepted_where_lists_are_expected():
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype="int8"))
    assert len(config.config_set) == 1
    assert config.config_set[0].dtype == ["int8"]


def test_config_set_from_plain_dicts():
    config = TuningConfig.from_mapping({"config_set": {"dtype": ["bf16", "fp32"], "exclude": "lm_head"},
                                        "tolerable_loss": 0.02})
    assert config.config_set[0].exclude == ["lm_head"]
    assert config.tolerable_loss == 0.02


def test_finalists_run_in_every_engine_of_the_device_unless_engines_are_given():
    assert TuningConfig().engines == ["eager", "compiled", "inductor", "lowp"]
    assert TuningConfig.from_mapping({"device": "cuda:0"}).engines == ["eager", "inductor", "lowp"]   # x86 int8
    assert TuningConfig(device="cuda", engines="compiled").engines == ["compiled"]   # the engine then says why not
    assert TuningConfig.from_mapping({"engines": ["eager"]}).engines == ["eager"]
    from autotune.engines import ENGINES
    assert set(TuningConfig().engines) == set(ENGINES)      # a new engine is named in the config as well


def test_unknown_field_is_rejected_naming_it_and_the_field_it_is_close_to():
    with pytest.raises(ConfigError) as info:
        TuningConfig(max_trial=10)
    assert ("max_trial", "Extra inputs are not permitted; did you mean 'max_trials'?") in info.value.errors
    with pytest.raises(ConfigError) as info:
        TuningConfig(batch_size=10)      # close to no field
    assert ("batch_size", "Extra inputs are not permitted") in info.value.errors


@pytest.mark.parametrize("data, path, message", [
    ({"config_set": {"dtypes": ["int8"]}}, "config_set.0.dtypes", "did you mean 'dtype'?"),   # nested: its own fields
    ({"config_set": {"dtype": ["int8", "bfloat16"]}}, "config_set.0.dtype.1", "did you mean 'bf16'?"),
    ({"config_set": {"dtype": ["torch.float16"]}}, "config_set.0.dtype.0", "did you mean 'fp16'?"),
    ({"config_set": {"dtype": ["INT8"]}}, "config_set.0.dtype.0", "did you mean 'int8'?"),
    ({"engines": ["compile"]}, "engines.0", "did you mean 'compiled'?"),
    ({"knobs": ["channel_last"]}, "knobs.0", "did you mean 'channels_last'?"),
    ({"objective": "Pareto"}, "objective", "did you mean 'pareto'?"),
])
def test_a_misspelt_field_or_value_is_refused_with_the_closest_known_one(data, path, message):
    """A misspelt key or dtype was refused naming the valid values only: the user looked for the difference."""
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping(data)
    [(where, said)] = info.value.errors
    assert where == path and said.endswith(message), said


def test_a_value_close_to_no_choice_gets_no_guess():
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"config_set": {"dtype": ["int4"]}})
    assert "did you mean" not in str(info.value) and "'int8'" in str(info.value)


def test_unknown_dtype_is_rejected_naming_the_field():
    with pytest.raises(ConfigError) as info:
        TuningConfig(config_set=[MixedPrecisionConfig(dtype=["int8", "int4"])])
    assert "dtype.1" in str(info.value) and "int4" not in info.value.errors[0][0]


def test_nested_bad_value_names_the_full_path():
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"config_set": [{"dtype": ["fp32"]}, {"dtype": ["fp8"]}]})
    assert info.value.errors[0][0] == "config_set.1.dtype.0"


@pytest.mark.parametrize("field,value", [("tolerable_loss", -0.1), ("max_trials", 0), ("timeout", 0),
                                         ("loss_kind", "percent"), ("device", "tpu:0"), ("repeats", 1)])
def test_out_of_range_values_are_rejected(field, value):
    with pytest.raises(ConfigError) as info:
        TuningConfig(**{field: value})
    assert info.value.errors[0][0] == field


@pytest.mark.parametrize("written, fraction", [("1%", "0.01"), (" 0.5 %", "0.005"), ("%", "0.01")])
def test_a_tolerable_loss_written_with_a_percent_sign_is_refused_with_the_fraction_to_write(written, fraction):
    """"1%" was refused as "unable to parse string as a number", which did not say what to write instead."""
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"tolerable_loss": written})
    assert info.value.errors == [("tolerable_loss", f"write the loss as a fraction: {fraction} for {written.strip()}")]


def test_a_relative_tolerable_loss_of_one_or_more_is_refused_as_a_percentage_mistaken_for_a_fraction():
    """`tolerable_loss: 5` (5 % meant) ran as a 500 % relative loss: every plan passed, silently."""
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"tolerable_loss": 5})
    assert info.value.errors[0][0] == "tolerable_loss"
    assert "5 is a relative loss of 500%: write a fraction (0.05 for 5 %)" in str(info.value)
    assert TuningConfig(tolerable_loss=5, loss_kind="absolute").tolerable_loss == 5
    assert TuningConfig(tolerable_loss=0.99).tolerable_loss == 0.99


def test_predicted_trial_timing_beside_the_pareto_objective_is_refused_saying_why():
    """`objective: pareto` with `trial_timing: predicted` timed every trial, and nothing said the setting was
    dropped."""
    with pytest.raises(ConfigError) as info:
        TuningConfig.from_mapping({"objective": "pareto", "trial_timing": "predicted"})
    assert info.value.errors[0][0] == "trial_timing"
    assert "objective: pareto times every trial, its latency being one of the objectives" in str(info.value)
    assert TuningConfig(objective="pareto").trial_timing == "measured"


def test_empty_dtype_list_is_rejected():
    with pytest.raises(ConfigError, match="dtype"):
        MixedPrecisionConfig(dtype=[])


@pytest.mark.parametrize("kind,baseline,accuracy", [("relative", 1.0, 0.99), ("absolute", 0.9, 0.89),
                                                    ("relative", 0.3, 0.297)])
def test_a_score_exactly_at_the_tolerance_passes(kind, baseline, accuracy):
    # In floating point these losses come out a hair above 0.01: 0.010000000000000009 for 1.0 to 0.99.
    config = TuningConfig(loss_kind=kind, tolerable_loss=0.01)
    assert config.accuracy_loss(baseline, accuracy) == 0.01 and config.passes(baseline, accuracy)
    assert not config.passes(baseline, accuracy - 1e-9)


@pytest.mark.parametrize("kind,higher,baseline,accuracy,loss", [
    ("relative", True, 0.80, 0.78, 0.025),
    ("absolute", True, 0.80, 0.78, 0.02),
    ("relative", False, 2.0, 2.1, 0.05),     # e.g. perplexity: higher is worse
    ("absolute", False, 2.0, 1.9, -0.1),     # better than baseline: negative loss
])
def test_accuracy_loss_kinds(kind, higher, baseline, accuracy, loss):
    config = TuningConfig(loss_kind=kind, higher_is_better=higher, tolerable_loss=0.03)
    assert config.accuracy_loss(baseline, accuracy) == pytest.approx(loss)
    assert config.passes(baseline, accuracy) == (loss <= 0.03)


def test_a_device_nested_thousands_deep_is_a_config_error_naming_it_not_a_recursion_error():
    device: object = "cuda"
    for _ in range(5000):
        device = {"a": device}
    with pytest.raises(ConfigError, match="device"):
        TuningConfig.from_mapping({"device": device})
