"""LSTM and GRU: tuned by default, int8 through FBGEMM's quantized RNN cells, bf16 / fp16 by casting, answering
every way nn.LSTM / nn.GRU are called."""
import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from autotune.backends import get_backend
from autotune.measure import weight_bytes

CPU = torch.device("cpu")


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def flat(value):
    """The tensors of an RNN's (output, state), output unpacked."""
    out, state = value
    out = out.data if isinstance(out, PackedSequence) else out
    return [out, *(state if isinstance(state, tuple) else (state,))]


def calls(batch_first):
    """The ways an RNN is called: plain, with an initial state, packed (unsorted lengths), unbatched."""
    torch.manual_seed(1)
    x = torch.randn(3, 6, 16) if batch_first else torch.randn(6, 3, 16)
    lengths = torch.tensor([4, 6, 2])
    packed = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
    return {"plain": lambda state: (x,), "state": lambda state: (x, state(3)), "packed": lambda state: (packed,),
            "packed+state": lambda state: (packed, state(3)), "unbatched": lambda state: (x[0] if batch_first
                                                                                            else x[:, 0],)}


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("dtype,bound", [("int8", 5e-2), ("bf16", 3e-2), ("fp16", 3e-3)])
@pytest.mark.parametrize("batch_first", [True, False])
def test_an_rnn_in_each_dtype_answers_every_call_as_the_fp32_one_does(kind, dtype, bound, batch_first):
    torch.manual_seed(0)
    rnn = kind(16, 32, num_layers=2, bidirectional=True, batch_first=batch_first).eval()
    lowered = get_backend(dtype).apply(copy.deepcopy(rnn), None)

    def state(batch):
        h = torch.randn(4, batch, 32) * 0.5
        return (h, torch.randn(4, batch, 32) * 0.5) if kind is nn.LSTM else h

    for name, make in calls(batch_first).items():
        torch.manual_seed(2)
        args = make(state)
        with torch.inference_mode():
            want, got = rnn(*args), lowered(*args)
        assert type(got[0]) is type(want[0]), name
        for w, g in zip(flat(want), flat(got), strict=True):
            assert g.dtype == torch.float32 and g.shape == w.shape, name
            assert relative_error(g, w) <= bound, name


def test_int8_rnn_shrinks_weights_shares_them_between_copies_and_survives_save():
    torch.manual_seed(0)
    rnn, x = nn.GRU(64, 128, num_layers=2, batch_first=True).eval(), torch.randn(2, 5, 64)
    lowered = get_backend("int8").apply(rnn, None)
    assert weight_bytes(lowered) < weight_bytes(rnn) / 3
    copied = copy.deepcopy(lowered)
    assert copied._packed is lowered._packed and weight_bytes(copied) == weight_bytes(lowered)
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    restored.flatten_parameters()    # models call it on their RNNs in forward
    with torch.inference_mode():
        assert torch.equal(restored(x)[0], lowered(x)[0])
    assert restored.hidden_size == 128 and restored.num_layers == 2 and restored.batch_first
    # its float biases stay parameters, named as torch's (the weights are packed)
    biases = dict(lowered.named_parameters())
    assert set(biases) == {n for n, _ in rnn.named_parameters() if n.startswith("bias")}
    assert all(torch.equal(b, getattr(rnn, n)) for n, b in biases.items())


def test_int8_takes_the_rnns_fbgemm_has_cells_for():
    int8 = get_backend("int8")
    assert int8.supports(nn.LSTM(4, 4), CPU) and int8.supports(nn.GRU(4, 4, bidirectional=True), CPU)
    assert not int8.supports(nn.LSTM(4, 8, proj_size=4), CPU)      # projections: no such cell
    assert not int8.supports(nn.GRU(4, 4, bias=False), CPU)
    assert not int8.supports(nn.RNN(4, 4), CPU)
    assert get_backend("bf16").supports(nn.LSTM(4, 8, proj_size=4), CPU)
    # weight_norm'd, as the other int8 techniques take it: the weights it computes are what is quantised
    normed = nn.utils.parametrizations.weight_norm(nn.GRU(4, 8), "weight_hh_l0").eval()
    assert int8.supports(normed, CPU)
    x = torch.randn(5, 2, 4)
    with torch.inference_mode():
        assert relative_error(int8.apply(normed, None)(x)[0], normed(x)[0]) < 5e-2


class Tagger(nn.Module):
    """Embedding, a bidirectional RNN over packed padded sequences, a linear head on the last states."""

    def __init__(self, kind):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(100, 16), kind(16, 32, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(64, 5)

    def forward(self, tokens, lengths):
        self.rnn.flatten_parameters()
        _, state = self.rnn(pack_padded_sequence(self.embed(tokens), lengths, batch_first=True,
                                                 enforce_sorted=False))
        h = state[0] if isinstance(state, tuple) else state
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_an_rnn_model_is_tuned_by_default_on_packed_sequences(kind, storage):
    from autotune import TuningConfig, autotune
    from autotune.storage import study as studies
    torch.manual_seed(0)
    model = Tagger(kind).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 100, (8, 12), generator=gen), torch.randint(2, 13, (8,), generator=gen))
               for _ in range(3)]
    with torch.no_grad():
        reference = [model(*batch) for batch in batches]

    def fidelity(net):
        with torch.no_grad():
            return 1 - sum(((net(*b) - r).norm() / r.norm()).item() for b, r in zip(batches, reference)) / 3

    config = TuningConfig(tolerable_loss=0.05, max_trials=4, repeats=3, storage=storage)
    result = autotune(model, config, fidelity)
    # The RNN's int8 and bf16 were measured on its packed inputs (whichever the search then keeps).
    latency = studies.get_attr(result.study, "module_latency_ms")
    assert {"fp32", "int8", "bf16"} <= set(latency["rnn"]) and "rnn" in result.plan
    assert 1 - fidelity(result.model) <= 0.05


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_lowered_rnn_fed_packed_sequences_runs_compiled(dtype):
    """The inductor engine compiles the eager plan: a bf16 LSTM rebuilt its PackedSequence input from a generator,
    which dynamo cannot do ("'LocalGeneratorObjectVariable' object has no attribute 'remaining_items'"), and the
    engine was dropped for every model whose RNN takes one."""
    torch.manual_seed(0)
    model = Tagger(nn.LSTM).eval()
    model.rnn = get_backend(dtype).apply(model.rnn, None)
    tokens, lengths = torch.randint(0, 100, (4, 9)), torch.tensor([9, 5, 3, 2])
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(tokens, lengths), model(tokens, lengths), atol=1e-6)
