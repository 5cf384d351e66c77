import logging

import pytest
import torch
from torch import nn

from autotune import ConfigError, MixedPrecisionConfig, NoTunableModulesError
from autotune.discovery import tunable_modules, untuned_weights


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)


def model():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), Block(), Block(), nn.Linear(8, 2))


def test_default_types_are_linear_and_conv_with_fp32_always_added():
    found = tunable_modules(model(), [MixedPrecisionConfig(dtype=["int8"])])
    assert list(found) == ["0", "2.query", "2.key", "2.out", "3.query", "3.key", "3.out", "4"]
    assert all(dtypes == ["int8", "fp32"] for dtypes in found.values())


def test_a_decoders_transposed_convolutions_are_tuned_by_default_in_the_dtypes_that_run_them():
    """A U-Net's or an autoencoder's upsampling is as heavy as its encoder's convolutions; no int8 kernel here
    computes a transposed convolution, so it is offered the cast dtypes."""
    from autotune.config.tuning import TuningConfig
    from autotune.discovery import search_candidates
    decoder = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ConvTranspose1d(4, 4, 2, stride=2), nn.ConvTranspose2d(4, 2, 3))
    found = search_candidates(decoder, TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16"])))
    assert found == {"0": ["int8", "bf16", "fp32"], "1": ["bf16", "fp32"], "2": ["bf16", "fp32"]}


def test_include_exclude_globs_and_union_over_configs():
    found = tunable_modules(model(), [MixedPrecisionConfig(dtype=["int8"], include=["*.query", "*.key"],
                                                           exclude=["3.*"]),
                                      MixedPrecisionConfig(dtype=["bf16"], include=["2.*"])])
    assert found == {"2.query": ["int8", "bf16", "fp32"], "2.key": ["int8", "bf16", "fp32"],
                     "2.out": ["bf16", "fp32"]}


def test_module_types_by_class_name_and_outer_module_owns_its_children():
    found = tunable_modules(model(), [MixedPrecisionConfig(dtype=["bf16"], module_types=["Block", "Linear"])])
    assert list(found) == ["2", "3", "4"]


@pytest.mark.parametrize("field", ["include", "exclude"])
def test_pattern_matching_nothing_is_an_error_naming_it(field):
    with pytest.raises(ConfigError, match=rf"config_set.0.{field}: pattern 'decoder\.\*' matches no module"):
        tunable_modules(model(), [MixedPrecisionConfig(**{field: ["decoder.*"]})])


def test_model_without_tunable_modules_is_an_error():
    with pytest.raises(NoTunableModulesError, match="no module of the tunable types"):
        tunable_modules(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)), [MixedPrecisionConfig()])


class Recommender(nn.Module):
    def __init__(self):
        super().__init__()
        self.items, self.norm, self.head = nn.Embedding(1000, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, ids):
        return self.head(self.norm(self.items(ids)).mean(1))


def test_a_type_holding_much_of_the_weights_that_no_module_types_names_is_said_to_be_untuned(caplog):
    """An embedding table can be most of a model: the plan of its Linears alone never said so."""
    model = Recommender()
    with caplog.at_level(logging.INFO, logger="autotune"):
        untuned = untuned_weights(model, tunable_modules(model, [MixedPrecisionConfig()]))
    assert set(untuned) == {"Embedding"} and untuned["Embedding"][0] == 1   # LayerNorm: a sliver of the weights
    assert untuned["Embedding"][1] == pytest.approx(32000 / (32000 + 64 + 32 * 8 + 8))
    said = [r for r in caplog.records if r.getMessage().startswith("not tuned, as no module_types names them")]
    assert [r.getMessage() for r in said] == ["not tuned, as no module_types names them: Embedding ×1 (99 % of the "
                                              "weights)"]
    assert said[0].levelno == logging.WARNING    # most of the model: said where a plain `autotune tune` shows it
    assert untuned_weights(model, tunable_modules(model, [MixedPrecisionConfig(module_types=["Embedding",
                                                                                              "Linear"])])) == {}


class TiedLanguageModel(nn.Module):
    """An output projection sharing the embedding table (tie_word_embeddings), as Gemma and BART have."""

    def __init__(self):
        super().__init__()
        self.embed, self.body, self.lm_head = nn.Embedding(1000, 32), nn.Linear(32, 32), nn.Linear(32, 1000)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.body(self.embed(ids)))


def test_a_tied_weight_counts_once_in_the_share_of_the_weights_left_untuned():
    """The table was counted twice in the total (once per module holding it): 'x % of the weights' was wrong."""
    model = TiedLanguageModel()
    untuned = untuned_weights(model, tunable_modules(model, [MixedPrecisionConfig()]))
    unique = 32000 + 32 * 32 + 32 + 1000
    assert untuned == {"Embedding": (1, pytest.approx(32000 / unique))}


def test_modules_quantised_already_are_named_as_left_as_they_are(caplog):
    # torch.ao's dynamic int8 Linear matches "Linear" by name, and no technique takes it: the run tuned nothing and
    # said only that no plan ran faster than fp32.
    import torch

    from autotune.config.tuning import TuningConfig
    from autotune.discovery import search_candidates, unlowerable

    float_model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    quantised = torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        assert unlowerable(quantised, search_candidates(quantised, config)) == ["0", "2"]
    assert "2 of the 2 tunable modules stay as they are: no technique lowers them " \
           "(torch.ao.nn.quantized.dynamic.modules.linear.Linear: quantised already" in caplog.text
    caplog.clear()
    assert unlowerable(float_model, search_candidates(float_model, config)) == [] and not caplog.text


def test_modules_only_casts_take_are_named_so_where_int8_alone_is_configured(caplog):
    """Fused experts and recurrent cells with int8 alone: they are not quantised already, as the warning said."""
    from autotune.config.tuning import TuningConfig
    from autotune.discovery import search_candidates, unlowerable
    model = TinyMoE().eval()
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8"]))
    with caplog.at_level(logging.WARNING, logger="autotune"):
        assert unlowerable(model, search_candidates(model, config)) == ["experts"]
    assert ("1 of the 4 tunable modules stay as they are: no technique lowers them (test_discovery.TinyExperts: no "
            "technique of the dtypes configured takes them: bf16 / fp16 casts do)") in caplog.text, caplog.text


class Stepped(nn.Module):
    """A decoder stepping an LSTMCell and a GRUCell over its input, as seq2seq decoders are written."""

    def __init__(self):
        super().__init__()
        self.lstm, self.gru, self.out = nn.LSTMCell(8, 16), nn.GRUCell(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = c = g = x.new_zeros(x.shape[1], 16)
        for step in x:
            h, c = self.lstm(step, (h, c))
            g = self.gru(h, g)
        return self.out(g)


def test_recurrent_cells_stepped_in_a_loop_are_tuned_by_default_in_the_dtypes_that_run_them():
    # Most of such a decoder's weights sit in its cells, which no default module type named: only the output
    # Linear was tuned.
    import torch

    from autotune.config.tuning import TuningConfig
    from autotune.discovery import search_candidates
    from autotune.plan import apply_plan

    torch.manual_seed(0)
    decoder, x = Stepped().eval(), torch.randn(6, 3, 8)
    found = search_candidates(decoder, TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16"])))
    assert found == {"lstm": ["bf16", "fp32"], "gru": ["bf16", "fp32"], "out": ["int8", "bf16", "fp32"]}
    lowered = apply_plan(decoder, {"lstm": "bf16", "gru": "bf16", "out": "fp32"})
    with torch.no_grad():
        out, reference = lowered(x), decoder(x)
    assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.05) and not torch.equal(out, reference)


def test_a_module_type_no_module_is_nor_torch_nn_has_is_an_error_with_a_hint_and_every_bad_name_is_named():
    """`module_types=["Conv2dd", "Linear"]` tuned the Linears alone, the convolutions left with a warning."""
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ConfigError) as raised:
        tunable_modules(net, [MixedPrecisionConfig(module_types=["Conv2dd", "Linear"], exclude=["9", "fc*"])])
    message = str(raised.value)
    assert "config_set.0.module_types: 'Conv2dd' is no class of Sequential's modules nor of torch.nn; did you mean " \
           "'Conv2d'?" in message, message
    assert "pattern '9' matches no module" in message and "pattern 'fc*' matches no module" in message, message
    assert [path for path, _ in raised.value.errors] == ["config_set.0.exclude", "config_set.0.exclude",
                                                         "config_set.0.module_types"]
    # A torch.nn class the model lacks is a config written for other models too; a class given itself is its path.
    assert list(tunable_modules(net, [MixedPrecisionConfig(module_types=["LSTM", nn.Linear])])) == ["2"]
    assert MixedPrecisionConfig(module_types=nn.Conv2d).module_types == ["torch.nn.modules.conv.Conv2d"]


class TinyExperts(nn.Module):
    """The layout of transformers' fused experts (Qwen3MoeExperts, MixtralExperts): every expert's weights stacked
    in one Parameter, sliced per expert in forward."""

    def __init__(self, experts=4, width=16, hidden=32):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, width) / width ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, width, hidden) / hidden ** 0.5)

    def forward(self, x, top_index, top_weights):
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.where(top_index == expert)
            gate, up = nn.functional.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, rows, (y * top_weights[rows, slot, None]).to(out.dtype))
        return out


class ListExperts(nn.Module):
    """Experts as a list of Linears: tuned as those Linears, each in any dtype, not as one unit."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        return sum(expert(x) for expert in self.experts)


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.experts, self.listed = nn.Linear(16, 4), TinyExperts(), ListExperts()

    def forward(self, x):
        top_weights, top_index = self.router(x).softmax(-1).topk(2, dim=-1)
        return self.listed(self.experts(x, top_index, top_weights))


def test_fused_experts_are_tuned_by_default_in_the_dtypes_that_cast_them():
    """transformers' MoE layers hold their experts' weights stacked in 3-D Parameters, no nn.Linear: a 3-layer
    Qwen3-MoE left 60 % of its weights untuned. They are one unit in bf16 / fp16 (no int8 technique takes them);
    experts held as Linears are still tuned Linear by Linear."""
    from autotune.config.tuning import TuningConfig
    from autotune.discovery import search_candidates
    from autotune.plan import apply_plan
    model = TinyMoE().eval()
    found = search_candidates(model, TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16"])))
    assert found == {"router": ["int8", "bf16", "fp32"], "experts": ["bf16", "fp32"],
                     "listed.experts.0": ["int8", "bf16", "fp32"], "listed.experts.1": ["int8", "bf16", "fp32"]}
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    tuned = apply_plan(model, {"experts": "bf16"})
    assert tuned.experts.inner.gate_up_proj.dtype == torch.bfloat16
    assert model.experts.gate_up_proj.dtype == torch.float32
    with torch.no_grad():
        expected, out = model(x), tuned(x)
    assert out.dtype == torch.float32 and 0 < (out - expected).abs().max() < 0.05 * expected.abs().max()
    # A module_types list of one's own leaves them out unless it names them.
    assert "experts" not in tunable_modules(model, [MixedPrecisionConfig(module_types=["Linear"])])
    assert "experts" in tunable_modules(model, [MixedPrecisionConfig(module_types=["FusedExperts"])])
