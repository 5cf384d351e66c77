"""Inputs a forward changes in place: transformers' `generate` passes one KV cache object to every step and the model
appends to it. What the tuner records and replays must compute what the recorded call did."""
import copy
import json
import logging
import re

import pytest
import torch
from click.testing import CliRunner
from conftest import HalfCostMeasurer
from torch import nn

from autotune import LatencyInput, MixedPrecisionConfig, TuningConfig, autotune
from autotune.capture import HowCalled, record_module_inputs, run_capturing, to_device
from autotune.cli import main
from autotune.engines import CALLS_ITSELF, compile_model
from autotune.measure.sensitivity import module_sensitivity
from autotune.measure.shapes import resize_batch
from autotune.model_call import call, fresh, holds_state

MAX_POSITIONS = 16


class KVCache:
    """Keys appended by every call, as a decoder's cache is."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []

    def __len__(self):
        return sum(k.shape[1] for k in self.keys)


class TinyDecoder(nn.Module):
    """Attends over every position cached so far; refuses more than MAX_POSITIONS, as a model with learned
    position embeddings does."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x, cache: KVCache):
        if len(cache) + x.shape[1] > MAX_POSITIONS:
            raise IndexError(f"position {len(cache) + x.shape[1]} is past the {MAX_POSITIONS} the model has")
        cache.keys.append(self.embed(x))
        keys = torch.cat(cache.keys, dim=1)
        return self.head(torch.softmax(keys @ keys.mT, -1) @ keys)[:, -1]

    def generate(self, prompt, steps=4):
        """A prompt's prefill, then one position per step, all on one cache, calling `self` as transformers'
        generate does."""
        cache, x, out = KVCache(), prompt, []
        for _ in range(steps):
            last = self(x, cache=cache)
            out.append(last)
            x = last.unsqueeze(1)
        return torch.stack(out, 1)


PROMPT = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))


def test_recorded_inputs_keep_the_state_of_their_call_and_each_replay_starts_from_it():
    torch.manual_seed(0)
    model = TinyDecoder().eval()
    with torch.no_grad():
        _, recorded = run_capturing(model, lambda m: m.generate(PROMPT), stop_early=False)
        prefill = recorded[0]
        assert holds_state(prefill) and len(prefill[1]["cache"]) == 0    # as it was at the call, not after it
        assert len(recorded[1][1]["cache"]) == 6 and not holds_state(((PROMPT,), {"n": 3}))
        outputs = [call(model, prefill) for _ in range(5)]     # 5 x 6 positions: past the limit if they piled up
    assert len(prefill[1]["cache"]) == 0 and all(torch.equal(o, outputs[0]) for o in outputs)
    assert fresh(prefill)[1]["cache"] is not prefill[1]["cache"]


def tune_by_generation(config: TuningConfig, example_inputs=None, model_class=TinyDecoder):
    """A TinyDecoder tuned by how closely its generate follows the fp32 one's: (model, result, eval_fn)."""
    torch.manual_seed(0)
    model = model_class().eval()
    with torch.no_grad():
        reference = model.generate(PROMPT)

    def eval_fn(m):
        with torch.no_grad():
            return 1 - ((m.generate(PROMPT) - reference).norm() / reference.norm()).item()
    return model, autotune(model, config, eval_fn, example_inputs=example_inputs), eval_fn


def test_a_decoder_evaluated_by_generation_is_tuned_on_its_recorded_calls_and_compiled_in_place(storage):
    """Its generate calls the module itself, which torch.compile's wrapper would not reach: the inductor engine
    compiles the model in place, and the compiled engine, whose exported graph has no generate, is left out
    saying why."""
    config = TuningConfig(engines=["eager", "compiled", "inductor"], tolerable_loss=0.05, max_trials=4, repeats=5,
                          config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), storage=storage)
    model, result, fidelity = tune_by_generation(config)   # a cache piling up over the timed calls: the model raises
    assert fidelity(result.model) >= 0.95 * fidelity(model)
    exported = CliRunner().invoke(main, ["export", result.study.study_name, "--storage", storage])
    assert exported.exit_code == 0 and json.loads(exported.output)["compile_in_place"] is True   # for `apply`
    assert result.study.user_attrs["autotune.engines_dropped"] == {
        "compiled": "eval_fn runs the model through its own methods (TinyDecoder.generate), which this engine's "
                    "model does not have"}
    assert any(name.endswith("(inductor)") for name in result.study.user_attrs["autotune.finalist_setup_s"])


class Probe(TinyDecoder):
    """Says whether each of its calls ran under torch.compile."""

    def forward(self, x, cache):
        self.compiled_calls.append(torch.compiler.is_compiling())
        return super().forward(x, cache)


def test_a_model_marked_as_calling_itself_is_compiled_in_place_so_its_methods_run_compiled():
    wrapped, in_place = Probe().eval(), Probe().eval()
    setattr(in_place, CALLS_ITSELF, True)
    for model in (wrapped, in_place):
        model.compiled_calls = []
        with torch.no_grad():
            compile_model(model).generate(PROMPT)
    assert not any(wrapped.compiled_calls)      # torch.compile(model).generate calls the module beneath it
    assert all(in_place.compiled_calls) and len(in_place.compiled_calls) == 4
    compiled = compile_model(in_place)
    assert type(compiled) is Probe and compiled is not in_place and compiled.embed is in_place.embed


class SplitDecoder(TinyDecoder):
    """Generates as transformers' generate does: one method calls the model on the prompt, another at each step."""

    @torch.no_grad()
    def generate(self, prompt, steps=4):
        cache = KVCache()
        out = [self._prefill(prompt, cache)]
        return torch.stack(self._sample(out, cache, steps - 1), 1)

    def _prefill(self, prompt, cache):
        return self(prompt, cache=cache)

    def _sample(self, out, cache, steps):
        for _ in range(steps):
            out.append(self(out[-1].unsqueeze(1), cache=cache))
        return out


def test_calls_of_one_generation_made_by_several_of_its_methods_count_as_one_run():
    how = HowCalled()
    run_capturing(SplitDecoder().eval(), lambda m: (m.generate(PROMPT), m.generate(PROMPT)), stop_early=False,
                  how=how)
    assert how.own_callers == {"SplitDecoder._prefill", "SplitDecoder._sample"}
    assert (how.first_calls, how.later_calls) == (2, 6)
    assert how.calls_to_time() == [LatencyInput(call=0), LatencyInput(call=1, weight=3.0)]


def test_how_called_names_the_models_method_calling_it_the_grad_mode_and_the_calls_each_run_made():
    model = TinyDecoder().eval()
    direct, generating = HowCalled(), HowCalled()
    with torch.no_grad():
        run_capturing(model, lambda m: m(PROMPT, cache=KVCache()), stop_early=False, how=direct)
    with torch.inference_mode():
        run_capturing(model, lambda m: (m.generate(PROMPT), m.generate(PROMPT, steps=3)), stop_early=False,
                      how=generating)
    assert direct == HowCalled(set(), {"no_grad"}, first_calls=1, later_calls=0, later=[False])
    assert direct.calls_to_time() == []      # its one call stands for itself
    assert generating == HowCalled({"TinyDecoder.generate"}, {"inference_mode"}, first_calls=2, later_calls=5,
                                   later=[False, True, True, True])
    assert generating.calls_to_time() == [LatencyInput(call=0), LatencyInput(call=1, weight=2.5)]


def test_generation_with_example_inputs_timed_at_them_alone_says_how_to_time_the_steps_too(storage, caplog):
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=2, repeats=3, storage=storage)
    _, result, _ = tune_by_generation(config, example_inputs=((PROMPT,), {"cache": KVCache()}))
    assert [shape.name for shape in result.shapes] == ["batch 4"]
    assert ("eval_fn calls the model through its own methods (TinyDecoder.generate), and only its first call is "
            "timed") in caplog.text and "latency_inputs: [{call: 0}, {call: 1, weight: W}]" in caplog.text


class SlowPrefill(TinyDecoder):
    """A prompt's call computes far more than a step's, as a long prompt's does (work that no plan changes, so a
    loaded machine slows both alike)."""

    def forward(self, x, cache):
        work = torch.ones(256, 256)
        for _ in range(40 if x.shape[1] > 1 else 0):    # ops as well as time: a loaded machine stalls each op
            work = (work @ work).clamp(max=1.0)
        return super().forward(x, cache) + 0 * work[0, :8]


def test_generation_is_timed_at_its_first_call_and_its_steps_weighted_by_their_share_of_its_time(storage, caplog):
    """With no latency_inputs, the calls to time are chosen from what the baseline's eval_fn call saw: generate
    called the model once on the prompt and 3 times after it, each step a small share of the prompt's time, so the
    steps' ratio weighs 3 x that share (not 3) against the prompt's 1; a resumed run times the same."""
    caplog.set_level(logging.INFO, logger="autotune")
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=2, repeats=3, storage=storage)
    _, result, _ = tune_by_generation(config, model_class=SlowPrefill)
    (first, steps), share = result.shapes, float(re.search(r"3 more times after each first call, each at ([\d.]+) of "
                                                          r"its fp32 time", caplog.text).group(1))
    assert (first.name, first.weight, steps.name) == ("call 0, batch 4", 1.0, "call 1, batch 4")
    assert steps.weight == pytest.approx(3 * share, abs=0.005) and 0 < steps.weight < 1.0   # far below 3
    assert "only its first call is timed" not in caplog.text
    _, resumed, _ = tune_by_generation(config.model_copy(update={"max_trials": 3}), model_class=SlowPrefill)
    assert resumed.study.study_name == result.study.study_name
    assert [(s.name, s.weight) for s in resumed.shapes] == [(s.name, s.weight) for s in result.shapes]
    exported = CliRunner().invoke(main, ["export", result.study.study_name, "--storage", storage])
    assert json.loads(exported.output)["latency_inputs"] == [{"call": 0}, {"call": 1, "weight": steps.weight}]


class ProjectsItsPromptOnce(TinyDecoder):
    """Projects the prompt on the first call only, as cross-attention projects an encoder's output once and its
    steps reuse the keys and values cached."""

    def __init__(self):
        super().__init__()
        self.memory = nn.Linear(8, 32)

    def forward(self, x, cache):
        if not cache.keys:
            cache.memory = self.memory(x).mean(1)
        return super().forward(x, cache) + 0.1 * self.head(cache.memory)


def test_a_module_the_steps_do_not_call_costs_nothing_at_the_steps_and_is_tuned(storage):
    """Its latency at the steps' call was looked up on inputs recorded there, which it has none of: KeyError."""
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=3, repeats=3, storage=storage)
    _, result, _ = tune_by_generation(config, model_class=ProjectsItsPromptOnce)
    by_shape = result.study.user_attrs["autotune.module_latency_ms_by_shape"]
    assert by_shape["call 1, batch 4"]["memory"] == {"int8": 0.0, "fp32": 0.0}
    assert by_shape["call 0, batch 4"]["memory"]["fp32"] > 0 and "memory" in result.study.user_attrs[
        "autotune.module_latency_ms"]


def test_generation_is_timed_at_its_prefill_and_its_steps_with_their_weights(storage, caplog):
    """`latency_inputs` picks recorded calls: the prompt's (call 0) and a step's, one position on a cache of the
    prompt's 6 (call 1), weighted as a generation of 3 new positions calls them."""
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]),
                          tolerable_loss=0.05, max_trials=3, repeats=5, storage=storage,
                          latency_inputs=[{"call": 0}, {"call": 1, "weight": 3}])
    _, result, _ = tune_by_generation(config)
    assert [(shape.name, shape.weight) for shape in result.shapes] == [("call 0, batch 4", 1.0),
                                                                      ("call 1, batch 4", 3.0)]
    assert "only its first call is timed" not in caplog.text


class BatchedEncoder(nn.Module):
    """sentence-transformers' shape: an `encode` method calling the model once per batch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 32)

    def forward(self, x):
        return self.proj(x)

    def encode(self, batches):
        return torch.cat([self(batch).mean(1) for batch in batches])


@pytest.mark.parametrize("lengths", [(6, 6, 6), (6, 3, 3)])
def test_batches_an_encode_method_feeds_are_timed_apart_only_where_their_shapes_differ(storage, lengths):
    torch.manual_seed(0)
    model = BatchedEncoder().eval()
    batches = [torch.randn(4, n, 8) for n in lengths]
    with torch.no_grad():
        reference = model.encode(batches)

    def eval_fn(m):
        with torch.no_grad():
            return 1 - ((m.encode(batches) - reference).norm() / reference.norm()).item()
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=2, repeats=3, storage=storage)
    result = autotune(model, config, eval_fn)
    names = [shape.name for shape in result.shapes]
    assert names == (["batch 4"] if lengths[1] == lengths[0] else ["call 0, batch 4", "call 1, batch 4"])


class TinyTranslator(nn.Module):
    """An encoder-decoder generating as transformers' does: its generate runs the encoder once, then calls the
    model on the encoder's output at every step."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 32))
        self.decoder = TinyDecoder()

    def forward(self, x, memory, cache: KVCache):
        return self.decoder(x, cache=cache) + self.decoder.head(memory.mean(1))

    def generate(self, prompt, steps=4):
        memory, cache, x, out = self.encoder(prompt), KVCache(), prompt[:, :2], []
        for _ in range(steps):
            last = self(x, memory=memory, cache=cache)
            out.append(last)
            x = last.unsqueeze(1)
        return torch.stack(out, 1)


def test_the_encoder_a_generation_runs_first_is_recorded_with_its_first_call_and_feeds_it_when_replayed():
    torch.manual_seed(0)
    model = TinyTranslator().eval()
    with torch.no_grad():
        _, recorded = run_capturing(model, lambda m: m.generate(PROMPT), stop_early=False)
        first, step = recorded[0], recorded[1]
        assert [path for path, _ in first.entries] == ["encoder"] and not hasattr(step, "entries")
        assert torch.equal(first.entries[0][1][0][0], PROMPT)
        memory = first[1]["memory"]
        assert torch.equal(call(model, first), model(first[1]["x"] if "x" in first[1] else first[0][0],
                                                     memory=memory, cache=KVCache()))
        for copied in (copy.deepcopy(first), to_device(first, torch.device("cpu")), resize_batch(first, 2)):
            assert copied.links == first.links and [p for p, _ in copied.entries] == ["encoder"]
        assert resize_batch(first, 2).entries[0][1][0][0].shape[0] == 2
        lowered = module_sensitivity(model, {"encoder.2": ["int8", "fp32"]}, first,
                                     record_module_inputs(model, ["encoder.2"], first))
        assert lowered["encoder.2"]["int8"] > 0            # lowering it shows in the model's output
        model.encoder[0].weight.data.mul_(1.5)             # the encoder's output is made again and fed in
        changed = call(model, first)
        assert not torch.equal(changed, model(*first[0], **fresh(first)[1]))
        assert torch.equal(changed, model(*first[0], **{**fresh(first)[1], "memory": model.encoder(PROMPT)}))


class BeamTranslator(TinyTranslator):
    """Searches two beams as transformers' beam search does: the encoder's output expanded to a row per beam."""

    def generate(self, prompt, steps=4):
        memory, cache = self.encoder(prompt).repeat_interleave(2, 0), KVCache()
        x, out = prompt[:, :2].repeat_interleave(2, 0), []
        for _ in range(steps):
            out.append(self(x, memory=memory, cache=cache))
            x = out[-1].unsqueeze(1)
        return torch.stack(out, 1)


def test_an_encoder_output_expanded_to_a_row_per_beam_is_fed_in_expanded_again():
    """Beam search passes the model its encoder's output with each row repeated, a tensor of its own: the replay
    fed the recorded fp32 copy in, so lowering an encoder module never showed in the model's output."""
    torch.manual_seed(0)
    model = BeamTranslator().eval()
    with torch.no_grad():
        _, recorded = run_capturing(model, lambda m: m.generate(PROMPT), stop_early=False)
        first = recorded[0]
        assert list(first.links.values()) == [(0, 0, 2)]
        model.encoder[0].weight.data.mul_(1.5)
        memory = model.encoder(PROMPT).repeat_interleave(2, 0)
        assert torch.equal(call(model, first), model(*first[0], **{**fresh(first)[1], "memory": memory}))


def decode_by_hand(model, steps=3):
    """eval_fn's own greedy loop: the encoder once, then the model at every step."""
    memory, cache, x, out = model.encoder(PROMPT), KVCache(), PROMPT[:, :2], []
    for _ in range(steps):
        out.append(model(x, memory=memory, cache=cache))
        x = out[-1].unsqueeze(1)
    model.decoder.embed(out[-1])     # a submodule called after the last call: no call of the model follows it
    return torch.stack(out, 1)


def test_the_encoder_eval_fns_own_decoding_loop_runs_first_is_recorded_with_the_first_call_alone():
    torch.manual_seed(0)
    model = TinyTranslator().eval()
    with torch.no_grad():
        _, recorded = run_capturing(model, decode_by_hand, stop_early=False)
    assert [path for path, _ in recorded[0].entries] == ["encoder"] and recorded[0].links
    assert not any(hasattr(later, "entries") for later in recorded[1:]) and len(recorded) == 3


def test_a_generations_encoder_is_timed_measured_and_tuned_with_the_model(storage):
    """Its modules were never called by the model's recorded calls: they stayed fp32, untimed and unmeasured."""
    config = TuningConfig(engines=["eager"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=3, repeats=3, storage=storage)
    _, result, _ = tune_by_generation(config, model_class=TinyTranslator)
    attrs = result.study.user_attrs
    by_shape = attrs["autotune.module_latency_ms_by_shape"]
    assert by_shape["call 0, batch 4"]["encoder.0"]["fp32"] > 0 and by_shape["call 1, batch 4"]["encoder.0"] == {
        "int8": 0.0, "fp32": 0.0}
    assert {"encoder.0", "encoder.2"} <= set(attrs["autotune.module_latency_ms"]) & set(attrs["autotune.sensitivity"])
    assert {"encoder.0", "encoder.2"} <= set(result.plan)


@pytest.mark.parametrize("model_class", [TinyDecoder, TinyTranslator])
def test_the_low_precision_model_replays_recorded_calls_with_their_cache_and_encoder_in_its_dtype(model_class):
    """The recorded cache held the fp32 model's keys, and its encoder got the fp32 prompt: the bf16 model failed on
    both (mat1 and mat2 must have the same dtype), so the lowp engine was dropped for every generated model."""
    from autotune.engines import Calibration, LowPrecisionEngine

    torch.manual_seed(0)
    model = model_class().eval()
    with torch.no_grad():
        _, recorded = run_capturing(model, lambda m: m.generate(PROMPT), stop_early=False)
        names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        low = LowPrecisionEngine().build(model, dict.fromkeys(names, "bf16"), Calibration(recorded, {}))
        for recorded_call in recorded[:2]:
            out, reference = call(low, recorded_call), call(model, recorded_call)
            assert out.dtype == torch.float32 and torch.allclose(out, reference, atol=0.1, rtol=0.1)
    cache = recorded[1][1]["cache"]
    assert cache.keys and all(key.dtype == torch.float32 for key in cache.keys)   # the record itself unchanged


class ProbedEncoder(nn.Sequential):
    def forward(self, x):
        self.compiled_calls.append(torch.compiler.is_compiling())
        return super().forward(x)


def test_the_encoder_generate_calls_apart_is_compiled_in_place_with_the_model_and_said_so():
    from autotune.engines import ENTRIES
    from autotune.engines.base import how_to_compile

    model = TinyTranslator().eval()
    model.encoder = ProbedEncoder(*model.encoder)
    model.encoder.compiled_calls = []
    setattr(model, CALLS_ITSELF, True)
    setattr(model, ENTRIES, ("encoder",))
    with torch.no_grad():
        compile_model(model).generate(PROMPT)
        compile_model(model).generate(PROMPT)
    assert model.encoder.compiled_calls == [True, True]
    assert how_to_compile("torch.load(path)", model) == (
        "model = torch.load(path); model.compile(); model.get_submodule('encoder').compile()")


def test_a_model_whose_encoder_eval_fn_calls_apart_is_tuned_whole_and_the_exported_graph_engine_left_out(storage):
    torch.manual_seed(0)
    model = TinyTranslator().eval()
    with torch.no_grad():
        reference = decode_by_hand(model)

    def eval_fn(m):
        with torch.no_grad():
            return 1 - ((decode_by_hand(m) - reference).norm() / reference.norm()).item()
    config = TuningConfig(engines=["eager", "compiled"], config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]),
                          tolerable_loss=0.05, max_trials=3, repeats=3, storage=storage)
    result = autotune(model, config, eval_fn)
    assert {"encoder.0", "encoder.2"} <= set(result.study.user_attrs["autotune.module_latency_ms"])
    assert result.study.user_attrs["autotune.engines_dropped"] == {
        "compiled": "eval_fn calls its submodules apart from its forward (encoder), which this engine's model does "
                    "not have"}
    exported = CliRunner().invoke(main, ["export", result.study.study_name, "--storage", storage])
    assert json.loads(exported.output)["compile_in_place"] is True   # eval_fn calls its encoder on what it is given


def test_a_scalar_or_empty_entry_output_handed_on_as_it_is_is_linked_once_without_rows():
    """Linking divided the input's rows by the output's: a 0-d tensor has none (IndexError), an empty one zero."""
    from autotune.model_call import linked

    scalar, empty, rows = torch.tensor(2.0), torch.zeros(0, 3), torch.arange(4.0).reshape(2, 2)
    live = ((scalar, empty), {"memory": rows.repeat_interleave(3, 0)})
    assert linked(live, [[scalar, empty, rows]]) == {0: (0, 0, 1), 1: (0, 1, 1), 2: (0, 2, 3)}


class NormalisesInPlace(nn.Module):
    """Normalises its input in place, as some preprocessing-in-forward models do: the caller's tensor changes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        x.sub_(0.5).div_(0.25)
        return self.body(x)


class RealErrorsHalfCost(HalfCostMeasurer):
    """The per-module output errors measured on the model's recorded inputs; every lowered module at half its fp32
    time (int8 stays a candidate of every module, however fast this machine runs it)."""

    def sensitivity(self, fp32, candidates, inputs, calibration):
        return module_sensitivity(fp32, candidates, inputs, calibration)


@pytest.mark.parametrize("given", [False, True])
def test_a_model_changing_its_input_in_place_is_tuned_on_inputs_as_recorded(storage, caplog, given):
    """Replayed as they were, the recorded inputs drifted call by call (to inf here): every module lowered was
    judged to lose the output, and the run returned fp32 after no trial. Inputs the user hands over stay as given."""
    model = NormalisesInPlace().eval()
    data = torch.rand(256, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(data.clone())

    def eval_fn(net):     # a fresh tensor per call, as a DataLoader gives
        with torch.no_grad():
            return -float((net(data.clone()) - reference).abs().mean())

    example = data.clone() if given else None
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          loss_kind="absolute", engines=["eager"], max_trials=4, repeats=3, storage=storage)
    with caplog.at_level(logging.INFO, logger="autotune"):
        result = autotune(model, config, eval_fn, example, measurer=RealErrorsHalfCost(["body.0", "body.2", "body.4"]))
    assert "the model changes the tensors it is called with in place" in caplog.text
    lost = result.study.user_attrs["autotune.sensitivity"]
    assert max(errors["int8"] for errors in lost.values()) < 1.0, lost    # finite: measured on the inputs as recorded
    assert any(t.user_attrs.get("evaluated") and "int8" in t.user_attrs["plan"].values() for t in result.study.trials)
    if given:
        assert torch.equal(example, data)


class RunningMean(nn.Module):
    """Updates an EMA of its inputs and a call counter in eval mode, as some streaming models do."""

    def __init__(self, stateful: bool):
        super().__init__()
        self.stateful, self.fc = stateful, nn.Linear(16, 16)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        if self.stateful:
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls += 1
        return self.fc(x - self.ema)


@pytest.mark.parametrize("stateful", [True, False])
def test_a_model_whose_forward_changes_its_buffers_is_warned_of_naming_them(storage, caplog, stateful):
    """Its EMA moved with every call the tuner made: plans were scored from other states than the fp32 model's, good
    ones rejected ("lost at least 0.062" where they lost 0.0001), and the model handed back held a moved state,
    unsaid."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    config = TuningConfig(engines=["eager"], max_trials=2, repeats=3, storage=storage)
    with caplog.at_level(logging.WARNING, logger="autotune"):
        autotune(RunningMean(stateful).eval(), config, lambda model: model(x).abs().mean().item(), example_inputs=x)
    said = "the model's forward changes its buffers (ema, calls): every call the tuner makes, its timing's included"
    assert (said in caplog.text) is stateful, caplog.text


def test_every_plan_of_a_model_moving_its_buffers_is_scored_from_its_state_as_handed_over(storage):
    """Plans were scored from the states earlier calls left (its EMA drifting toward the inputs' mean of 3), and
    the model handed back held what its last timing call left."""
    torch.manual_seed(0)
    model, x = RunningMean(True).eval(), torch.randn(64, 16) + 3
    with torch.no_grad():
        reference = copy.deepcopy(model)(x)

    def eval_fn(net):   # agreement with the handed-over model's first answer
        with torch.no_grad():
            return -float((net(x) - reference).abs().mean())

    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "fp32"]), tolerable_loss=0.05,
                          loss_kind="absolute", engines=["eager"], max_trials=4, repeats=3, storage=storage)
    # Timed at half fp32's cost in int8, so that plans are scored on every host (on AVX2 a 16x16 int8 Linear is
    # slower than fp32, and pruned before any trial); the scores are eval_fn's own.
    result = autotune(model, config, eval_fn, example_inputs=x, measurer=HalfCostMeasurer(["fc"]))
    assert result.baseline.accuracy == 0.0
    evaluated = [t for t in result.study.trials if t.user_attrs.get("evaluated")]
    assert evaluated and all(t.user_attrs["accuracy_loss"] < 0.05 for t in evaluated), \
        [(t.user_attrs["plan"], t.user_attrs["accuracy_loss"]) for t in evaluated]
    assert torch.equal(result.model.ema, torch.zeros(16)) and int(result.model.calls) == 0
    assert torch.equal(model.ema, torch.zeros(16))     # the user's model untouched
