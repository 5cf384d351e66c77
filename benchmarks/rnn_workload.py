"""Text classifiers on recurrent layers (an embedding, a 2-layer bidirectional LSTM or GRU over packed padded
sequences, a linear head): the shape of many users' sequence models that no shipped workload has. Random weights
(no hub here): the eval_fn is the top-1 agreement of the model's predictions with the fp32 model's on 512 fixed
sequences of 8-64 tokens, so the fp32 model scores 1.0 and a tolerance of 0.01 relative allows 1 % of predictions
to change."""
from __future__ import annotations

import torch
from candidates import top1_agreement
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

VOCAB, EMBED, HIDDEN, CLASSES, LENGTH, BATCH, SEQUENCES = 5000, 128, 256, 10, 64, 32, 512


class RecurrentClassifier(nn.Module):
    def __init__(self, kind: type[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.rnn = kind(EMBED, HIDDEN, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * HIDDEN, CLASSES)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        _, state = self.rnn(packed)
        last = state[0] if isinstance(state, tuple) else state     # an LSTM's (h, c): h
        return self.head(torch.cat([last[-2], last[-1]], dim=1))


def model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return RecurrentClassifier({"lstm": nn.LSTM, "gru": nn.GRU}[kind]).eval()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator),
             torch.randint(8, LENGTH + 1, (BATCH,), generator=generator)) for _ in range(SEQUENCES // BATCH)]


def agreement_eval(reference: nn.Module):
    return top1_agreement(reference, batches())


def example_inputs():
    return batches()[0]
