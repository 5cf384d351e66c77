import copy
import io

import pytest
import torch
from conftest import Conv1D, logged_by, needs_cuda
from torch import nn
from torch.nn.utils import prune

from autotune.backends import get_backend
from autotune.backends.quantized import has_avx512_vnni
from autotune.measure import weight_bytes

CPU = torch.device("cpu")


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype,bound", [("fp32", 0.0), ("bf16", 2e-2), ("fp16", 2e-3), ("int8", 5e-2)])
def test_linear_in_each_dtype_keeps_caller_dtype_and_stays_close(dtype, bound):
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 32), torch.randn(4, 7, 64)
    lowered = get_backend(dtype).apply(copy.deepcopy(linear), None)
    with torch.inference_mode():
        out = lowered(x)
        assert out.dtype == torch.float32 and out.shape == (4, 7, 32)
        assert relative_error(out, linear(x)) <= bound


def test_static_int8_conv_is_calibrated_on_recorded_inputs():
    torch.manual_seed(0)
    conv, x = nn.Conv2d(3, 8, 3, padding=1, groups=1), torch.randn(2, 3, 12, 12)
    backend = get_backend("int8")
    with pytest.raises(ValueError, match="calibration"):
        backend.apply(copy.deepcopy(conv), None)
    lowered = backend.apply(copy.deepcopy(conv), ((x,), {}))
    with torch.inference_mode():
        assert relative_error(lowered(x), conv(x)) < 5e-2


def test_int8_shrinks_weights_and_survives_copy_and_save():
    linear, x = nn.Linear(256, 128), torch.randn(3, 256)
    lowered = get_backend("int8").apply(copy.deepcopy(linear), None)
    assert weight_bytes(lowered) < weight_bytes(linear) / 3
    buffer = io.BytesIO()
    torch.save(copy.deepcopy(lowered), buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    with torch.inference_mode():
        assert torch.equal(restored(x), lowered(x))


def test_supports_reports_what_each_backend_can_run():
    int8, bf16 = get_backend("int8"), get_backend("bf16")
    assert int8.supports(nn.Linear(4, 4), CPU) and int8.supports(nn.Conv2d(1, 1, 3), CPU)
    assert not int8.supports(nn.LayerNorm(4), CPU)
    assert not int8.supports(nn.Conv2d(1, 1, 4, padding="same"), CPU)     # pads one side more: no int8 kernel
    assert not int8.supports(nn.Linear(4, 4), torch.device("cuda"))
    assert bf16.supports(nn.LayerNorm(4), CPU) and not bf16.supports(nn.ReLU(), CPU)


def test_unknown_dtype_backend_is_a_clear_error():
    with pytest.raises(KeyError, match="no backend for dtype 'int4'"):
        get_backend("int4")


@needs_cuda()
@pytest.mark.parametrize("dtype,torch_dtype,bound", [("bf16", torch.bfloat16, 2e-2), ("fp16", torch.float16, 5e-3)])
def test_half_backends_on_cuda(dtype, torch_dtype, bound):
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 32).cuda(), torch.randn(8, 64, device="cuda")
    before = {name: tensor.clone() for name, tensor in linear.state_dict().items()}
    lowered = get_backend(dtype).apply(linear, None)
    assert {(p.dtype, p.device.type) for p in lowered.parameters()} == {(torch_dtype, "cuda")}
    with torch.inference_mode():
        out = lowered(x)
        assert out.dtype == torch.float32 and out.device.type == "cuda" and out.shape == (8, 32)
        assert 0 < relative_error(out, linear(x)) <= bound
    for name, tensor in linear.state_dict().items():      # the module it lowered is left as it was
        assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int8"])
def test_each_backend_leaves_the_module_it_lowers_as_it_was(dtype):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Conv2d(2, 2, 3)), torch.randn(1, 2, 6, 6)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    backend = get_backend(dtype)
    lowered = [backend.apply(model[0], None), backend.apply(model[1], ((x,), {}))]
    assert all(new is not old for new, old in zip(lowered, model))
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name
    ours = {t.data_ptr() for t in model.state_dict().values()}
    assert not ours & {t.data_ptr() for module in lowered for t in module.state_dict().values()
                       if isinstance(t, torch.Tensor)}      # int8 modules' extra state is a dict


def test_copies_of_an_int8_module_share_packed_weights_but_not_hooks():
    lowered, x = get_backend("int8").apply(nn.Linear(16, 8), None), torch.randn(2, 16)
    copied = copy.deepcopy(lowered)
    copied.register_forward_hook(lambda module, args, out: out * 0)
    assert copied._packed is lowered._packed and weight_bytes(copied) == weight_bytes(lowered)
    with torch.inference_mode():
        assert copied(x).abs().sum() == 0 and lowered(x).abs().sum() > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "int8"])
def test_a_lowered_module_answers_what_parents_read_of_it(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    linear, conv = nn.Linear(16, 8), nn.Conv2d(3, 8, 3, stride=2, padding=1)
    lowered_linear = get_backend(dtype).apply(linear, None)
    lowered_conv = get_backend(dtype).apply(conv, ((x,), {}))
    assert lowered_conv.stride == (2, 2) and lowered_conv.padding == (1, 1) and lowered_conv.out_channels == 8
    assert lowered_linear.in_features == 16 and lowered_linear.weight.shape == (8, 16)
    # The weights it stands for: the cast ones, or int8's dequantised (one quantisation step from the original).
    for lowered, original in ((lowered_linear, linear), (lowered_conv, conv)):
        assert relative_error(lowered.weight.float(), original.weight) < 1e-2
        assert torch.allclose(lowered.bias.float(), original.bias, atol=1e-2)
    wrapped = copy.deepcopy(lowered_linear)
    assert type(wrapped) is type(lowered_linear)   # copying is the wrapper's own, not its inner module's
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        assert lowered_linear.no_such_thing is None


class _ReadsItsChildsWeight(nn.Module):
    """A parent casting its input to its child's weight dtype, as HF ViT does with its patch projection's."""

    def __init__(self, child: nn.Module):
        super().__init__()
        self.child = child

    def forward(self, x):
        return self.child(x.to(self.child.weight.dtype))


def test_an_int8_module_s_weight_read_in_a_compiled_forward_logs_nothing_and_computes_the_same():
    """dynamo has no fake kernel for packed weights: a parent reading an int8 child's weight in a compiled forward
    logged torch's "Encountered exception (quantized nyi in meta tensors) during fake tensor propagation"."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    model = _ReadsItsChildsWeight(get_backend("int8").apply(nn.Conv2d(3, 8, 3), ((x,), {}))).eval()
    with torch.inference_mode():
        expected = model(x)
    model.child.__dict__.pop("_float_weight")       # as a model built for compiling holds it: never read yet
    torch.compiler.reset()
    with logged_by("torch._dynamo") as notes, torch.inference_mode():
        compiled = torch.compile(model, backend="eager")(x)
    messages = [record.getMessage() for record in notes]
    assert not [m for m in messages if "fake tensor propagation" in m], messages
    assert torch.equal(compiled, expected)


@pytest.mark.parametrize("dtype,bound", [("int8", 5e-2), ("bf16", 2e-2)])
def test_gpt_style_conv1d_is_tuned_by_default_and_lowers_as_the_linear_it_computes(dtype, bound):
    from autotune import TuningConfig
    from autotune.discovery import search_candidates
    torch.manual_seed(0)
    model, x = nn.Sequential(Conv1D(256, 128)), torch.randn(2, 5, 128)
    assert dtype in search_candidates(model, TuningConfig())["0"]
    lowered = get_backend(dtype).apply(model[0], None)
    with torch.inference_mode():
        assert relative_error(lowered(x), model(x)) < bound
    assert weight_bytes(lowered) < weight_bytes(model[0]) / (3 if dtype == "int8" else 1.9)


def test_a_model_whose_every_module_is_int8_keeps_its_biases_as_parameters(storage):
    """Eval code often takes the model's device from `next(model.parameters())`: a plan lowering every module
    to int8 must not fail there (torch's own quantized modules have no parameters)."""
    from conftest import HalfCostMeasurer

    from autotune import MixedPrecisionConfig, TuningConfig, autotune
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval(), \
        torch.randn(2, 3, 8, 8)
    reference = model(x).detach()

    def eval_fn(net):
        device = next(net.parameters()).device
        with torch.no_grad():
            return 1 - ((net(x.to(device)) - reference).norm() / reference.norm()).item()

    config = TuningConfig(engines=["eager"],
                          config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.5,
                          max_trials=3, storage=storage)
    result = autotune(model, config, eval_fn, measurer=HalfCostMeasurer(["0", "3"]))
    assert result.plan == {"0": "int8", "3": "int8"}
    assert not [t for t in result.study.trials if t.state.name == "FAIL"]
    # the float biases, copies of the model's: the int8 weights stay packed
    names = dict(result.model.named_parameters())
    assert set(names) == {"0.bias", "3.bias"} and torch.equal(names["3.bias"], model[3].bias)
    assert names["3.bias"].data_ptr() != model[3].bias.data_ptr() and not names["3.bias"].requires_grad
    assert weight_bytes(result.model) < weight_bytes(model) / 3


@pytest.mark.parametrize("shape", [(2, 16, 40), (16, 40)])    # batched and unbatched
def test_static_int8_conv1d_runs_as_the_conv2d_of_height_one_it_equals(shape):
    torch.manual_seed(0)
    conv, x = nn.Conv1d(16, 32, 5, stride=2, padding=2, groups=2), torch.randn(*shape)
    int8 = get_backend("int8")
    assert int8.supports(conv, CPU) and not int8.supports(nn.Conv1d(16, 8, 3, padding_mode="circular"), CPU)
    lowered = int8.apply(copy.deepcopy(conv), ((x,), {}))
    with torch.inference_mode():
        out = lowered(x)
        assert out.shape == conv(x).shape and relative_error(out, conv(x)) < 5e-2
    # what parents read of a Conv1d: its own geometry and (dequantised) 1-d weight
    assert lowered.stride == (2,) and lowered.kernel_size == (5,) and lowered.weight.shape == conv.weight.shape
    assert relative_error(lowered.weight, conv.weight) < 1e-2 and weight_bytes(lowered) < weight_bytes(conv) / 2


@pytest.mark.parametrize("make", [lambda: nn.Conv1d(8, 16, 5, padding="same", dilation=2),
                                  lambda: nn.Conv2d(8, 16, 3, padding="same"),
                                  lambda: nn.Conv2d(8, 16, 3, padding="valid"),
                                  lambda: nn.utils.parametrizations.weight_norm(nn.Conv1d(8, 16, 3, padding=1)),
                                  lambda: nn.utils.parametrizations.weight_norm(nn.Linear(8, 16))])
def test_int8_takes_string_padding_and_weight_norm_as_the_convolutions_they_compute(make):
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(2, 8, 20) if isinstance(module, nn.Conv1d) else torch.randn(2, 8, 12, 12) \
        if isinstance(module, nn.Conv2d) else torch.randn(4, 8)
    int8 = get_backend("int8")
    assert int8.supports(module, CPU)
    lowered = int8.apply(module, ((x,), {}))
    with torch.inference_mode():
        assert relative_error(lowered(x), module(x)) < 5e-2


def test_activations_use_eight_bits_only_where_the_cpu_adds_products_in_int32(monkeypatch):
    from autotune.backends import Int8DynamicLinearConfig, quantized
    linear = nn.Linear(16, 8)
    for vnni in (True, False):
        monkeypatch.setattr(quantized, "has_avx512_vnni", lambda vnni=vnni: vnni)
        assert Int8DynamicLinearConfig().lower(linear, None).reduce_range is not vnni
        assert get_backend("int8").apply(linear, None).reduce_range is not vnni
    assert Int8DynamicLinearConfig(reduce_range=True).lower(linear, None).reduce_range    # as configured


@pytest.mark.skipif(not has_avx512_vnni(), reason="8-bit activations saturate FBGEMM on CPUs without AVX512-VNNI")
def test_eight_bit_activations_halve_the_error_on_a_vnni_cpu():
    from autotune.backends import Int8DynamicLinearConfig
    torch.manual_seed(0)
    linear, x = nn.Linear(512, 512), torch.randn(32, 512) * 3 + 1
    errors = {bits: relative_error(Int8DynamicLinearConfig(reduce_range=bits == 7).lower(linear, None)(x),
                                   linear(x)) for bits in (7, 8)}
    assert errors[8] < 0.7 * errors[7]


def test_a_saved_int8_model_loads_in_a_fresh_process_without_torchs_deprecation_warnings(tmp_path):
    """torch.load of packed int8 weights rebuilt their int8 tensors through what torch warns is deprecated
    (TypedStorage, quantized tensor creation): two warnings at every load of a tuned model, asking nothing of the
    user. Loaded in a process of its own (torch warns of each once a process), with any UserWarning an error."""
    import subprocess
    import sys

    from autotune.backends import Int8DynamicLinearConfig, Int8DynamicRNNConfig, Int8StaticConv2dConfig
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(Int8StaticConv2dConfig().lower(nn.Conv2d(3, 4, 3), ((x,), {})), nn.Flatten(1),
                          nn.Unflatten(1, (4, 36)), Int8DynamicRNNConfig().lower(nn.GRU(36, 6), None))
    head = Int8DynamicLinearConfig().lower(nn.Linear(6, 5), None)
    with torch.inference_mode():
        expected = head(model(x)[0])
    torch.save({"model": model, "head": head, "x": x, "expected": expected}, tmp_path / "int8.pt")
    script = ("import sys, torch, autotune\n"
              "saved = torch.load(sys.argv[1], weights_only=False)\n"
              "with torch.inference_mode():\n"
              "    out = saved['head'](saved['model'](saved['x'])[0])\n"
              "assert torch.equal(out, saved['expected'])\n")
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script, str(tmp_path / "int8.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_saved_int8_model_with_eight_bit_activations_warns_when_loaded_on_a_cpu_where_they_saturate(monkeypatch):
    import warnings

    from autotune.backends import Int8DynamicLinearConfig, Int8DynamicRNNConfig, Int8StaticConv2dConfig, quantized
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(Int8StaticConv2dConfig(reduce_range=False).lower(nn.Conv2d(3, 4, 3), ((x,), {})),
                          Int8DynamicLinearConfig(reduce_range=True).lower(nn.Linear(6, 6), None),
                          Int8DynamicRNNConfig(reduce_range=False).lower(nn.GRU(6, 6), None))
    saved = io.BytesIO()
    torch.save(model, saved)

    def load(vnni: bool) -> list[str]:
        monkeypatch.setattr(quantized, "has_avx512_vnni", lambda: vnni)
        saved.seek(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = torch.load(saved, weights_only=False)
        assert loaded[0](x).shape == model[0](x).shape    # it loads and runs either way
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    warned = load(vnni=False)
    assert len(warned) == 2      # the 8-bit conv and GRU; the 7-bit Linear is right on any CPU
    assert warned[0].startswith("StaticInt8Conv2d: ") and "autotune apply" in warned[0]
    assert warned[1].startswith("DynamicInt8RNN: ")
    assert load(vnni=True) == []


def test_a_depthwise_int8_convolution_errs_no_more_than_a_dense_one():
    """FBGEMM's depthwise kernel adds 8-bit activation products in int16 even on an AVX512-VNNI CPU: 10x the error
    of a dense convolution there, where oneDNN's (the x86 engine's choice) adds them in int32."""
    from autotune.backends import Int8StaticConv2dConfig
    torch.manual_seed(0)
    x = torch.randn(8, 64, 16, 16)
    errors = {}
    for groups in (1, 64):
        conv = nn.Conv2d(64, 64, 3, padding=1, groups=groups).eval()
        with torch.inference_mode():
            errors[groups] = relative_error(Int8StaticConv2dConfig().lower(conv, ((x,), {}))(x), conv(x))
    assert errors[64] < 1.5 * errors[1]


def test_a_saved_int8_convolution_computes_what_was_measured_whichever_engine_the_loading_process_has():
    """torch.load packs int8 weights again, for the process's quantized engine, whose kernels round otherwise than
    those the module was measured with: a saved model scored differently from the tuned one."""
    from autotune.backends import Int8StaticConv2dConfig
    torch.manual_seed(0)
    conv, x = nn.Conv2d(3, 64, 3, padding=1).eval(), torch.randn(8, 3, 32, 32)
    lowered = Int8StaticConv2dConfig().lower(conv, ((x,), {}))
    saved = io.BytesIO()
    torch.save(lowered, saved)
    before = torch.backends.quantized.engine
    try:
        for engine in {"fbgemm", "x86", "onednn"} & set(torch.backends.quantized.supported_engines):
            torch.backends.quantized.engine = engine
            saved.seek(0)
            restored = torch.load(saved, weights_only=False)
            with torch.inference_mode():
                assert torch.equal(restored(x), lowered(x)), engine
    finally:
        torch.backends.quantized.engine = before


@pytest.mark.parametrize("dtype", ["int8", "bf16"])
@pytest.mark.parametrize("make,shape", [(lambda: nn.Linear(16, 8), (4, 16)),
                                        (lambda: nn.Conv2d(3, 8, 3, padding=1), (2, 3, 8, 8))])
def test_a_users_forward_hooks_run_once_on_the_module_built_in_place_of_theirs(dtype, make, shape):
    torch.manual_seed(0)
    module, x = make().eval(), torch.randn(shape)
    seen = []
    module.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    module.register_forward_hook(lambda mod, args, kwargs, out: seen.append(out.shape) or out + 100.0,
                                 with_kwargs=True)
    with torch.inference_mode():
        expected = module(x)
        lowered = get_backend(dtype).apply(module, ((x,), {}))
        seen.clear()
        out = lowered(x)
    assert seen == [expected.shape]         # once, where a wrapper around a copy of the module holds them too
    assert relative_error(out, expected) < 2e-2


def test_the_old_weight_norm_hook_is_folded_into_the_int8_weight_not_carried():
    torch.manual_seed(0)
    with pytest.warns(FutureWarning):
        module = nn.utils.weight_norm(nn.Linear(8, 16)).eval()
    x = torch.randn(4, 8)
    lowered = get_backend("int8").apply(module, None)
    with torch.inference_mode():
        assert relative_error(lowered(x), module(x)) < 5e-2


@pytest.mark.parametrize("make, shape", [(lambda: nn.Linear(16, 32), (4, 16)),
                                         (lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 10))])
def test_a_prune_hook_is_folded_into_the_int8_weight_not_carried(make, shape):
    """torch.nn.utils.prune's pre-hook sets `weight` from `weight_orig * weight_mask`: carried onto the int8 module,
    which holds neither, it failed every call with "'StaticInt8Conv2d' object has no attribute 'weight_mask'"."""
    torch.manual_seed(0)
    module = prune.l1_unstructured(make().eval(), "weight", amount=0.5)
    x = torch.randn(*shape)
    lowered = get_backend("int8").apply(module, ((x,), {}))
    assert not lowered._forward_pre_hooks
    with torch.inference_mode():
        assert relative_error(lowered(x), module(x)) < 5e-2


def test_transformers_own_output_capturing_hooks_are_not_counted_as_a_users():
    transformers = pytest.importorskip("transformers")
    from autotune.backends.base import hooked_modules
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 1], decoder_hidden_size=32, num_labels=3,
                                          strides=[4, 2], patch_sizes=[7, 3], mlp_ratios=[2, 2])
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    with torch.inference_mode():
        model(pixel_values=torch.randn(1, 3, 64, 64))     # installs them: its head reads the hidden states
    assert hooked_modules(model) == []
    model.decode_head.classifier.register_forward_hook(lambda module, args, out: None)
    assert hooked_modules(model) == ["decode_head.classifier"]


@pytest.mark.parametrize("batch_first", [True, False])
def test_int8_attention_is_called_and_answers_as_the_multihead_attention_it_replaces(batch_first):
    """Self- and cross-attention, boolean padding and causal masks, with or without (per-head) weights, unbatched:
    each output within int8's error of torch's own, each of the same shape; the fp32 module is left as it was."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    before = {name: tensor.clone() for name, tensor in attention.state_dict().items()}
    lowered = get_backend("int8").apply(attention, None)

    def laid_out(batch, length):
        return torch.randn(batch, length, 32) if batch_first else torch.randn(length, batch, 32)

    q, memory, single = laid_out(3, 7), laid_out(3, 9), torch.randn(7, 32)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[:, 6:] = True
    causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    calls = [((q, q, q), {}), ((q, q, q), {"attn_mask": causal, "is_causal": True, "need_weights": False}),
             ((q, q, q), {"attn_mask": causal, "average_attn_weights": False}),
             ((q, memory, memory), {"key_padding_mask": padding}), ((single, single, single), {})]
    with torch.inference_mode():
        for args, kwargs in calls:
            (out, weights), (ours, our_weights) = attention(*args, **kwargs), lowered(*args, **kwargs)
            assert out.shape == ours.shape and relative_error(ours, out) < 5e-2, kwargs
            assert (weights is None) == (our_weights is None), kwargs
            if weights is not None:
                assert weights.shape == our_weights.shape and relative_error(our_weights, weights) < 5e-2, kwargs
    assert lowered.batch_first == batch_first and lowered.in_proj_bias is not None and lowered._qkv_same_embed_dim
    assert all(torch.equal(tensor, before[name]) for name, tensor in attention.state_dict().items())
    assert weight_bytes(lowered) < weight_bytes(attention) / 2   # int8 weights, their scales, fp32 biases
    saved = io.BytesIO()
    torch.save(lowered, saved)
    saved.seek(0)
    with torch.inference_mode():
        assert torch.equal(torch.load(saved, weights_only=False)(q, q, q)[0], lowered(q, q, q)[0])
    assert not get_backend("int8").supports(nn.MultiheadAttention(32, 4, kdim=16, vdim=16), CPU)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):   # as torch's module:
        lowered(q, q, q, is_causal=True)       # a causal mask applied without one changed what the model computes


def test_the_weights_of_a_module_the_user_quantised_with_torch_ao_are_counted():
    """The packed int8 weights of a Linear the user had run through quantize_dynamic were left out of the model's
    size: it read as its fp32 Linears alone."""
    import warnings
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch.ao's notice that eager quantisation moved to torchao
        model[1] = torch.ao.quantization.quantize_dynamic(nn.Sequential(model[1]), {nn.Linear})[0]
    assert weight_bytes(model) == (256 * 256 + 256) * 4 + 256 * 128 + 128 * 4    # int8 weight, fp32 bias


class ConvLinearLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.lstm, self.fc = nn.Conv2d(3, 8, 3), nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        features = self.conv(x).mean(dim=(2, 3)).unsqueeze(1).repeat(1, 5, 1)
        return self.fc(self.lstm(features)[0][:, -1])


def test_a_tuned_models_state_dict_holds_its_int8_weights_and_ranges_for_a_model_rebuilt_with_the_plan(tmp_path):
    """The int8 weights are no parameters: a model rebuilt with the plan took a tuned one's state_dict in a strict
    load, every key matched, and its int8 modules kept the weights and ranges they were built from."""
    from autotune.capture import record_module_inputs
    from autotune.plan import apply_plan

    plan = {"conv": "int8", "lstm": "int8", "fc": "int8"}
    x = torch.randn(4, 3, 10, 10)

    def tuned(seed: int, inputs: torch.Tensor) -> nn.Module:
        torch.manual_seed(seed)
        model = ConvLinearLSTM().eval()
        return apply_plan(model, plan, record_module_inputs(model, list(plan), ((inputs,), {})))

    first, rebuilt = tuned(0, x), tuned(1, 3 * torch.randn(4, 3, 10, 10))
    torch.save(first.state_dict(), tmp_path / "tuned.pt")
    with torch.inference_mode():
        expected, before = first(x), rebuilt(x)
        assert not torch.allclose(expected, before) and not torch.equal(rebuilt.fc.weight, first.fc.weight)
        rebuilt.load_state_dict(torch.load(tmp_path / "tuned.pt", weights_only=True), strict=True)
        assert torch.equal(rebuilt(x), expected)
    assert torch.equal(rebuilt.fc.weight, first.fc.weight)       # the dequantised weight read anew
    with pytest.raises(RuntimeError, match="Unexpected key"):    # into the fp32 model: said, not dropped
        ConvLinearLSTM().load_state_dict(first.state_dict())
