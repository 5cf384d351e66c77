"""A text classifier built on torch's own nn.TransformerEncoder (4 layers, d_model 256, 8 heads, padding masks),
the shape of many users' models that no shipped workload has. Random weights (no hub here): the eval_fn is the
top-1 agreement of the model's predictions with the fp32 model's on 512 fixed sequences of 16-64 tokens, so the
fp32 model scores 1.0 and a tolerance of 0.01 relative allows 1 % of predictions to change."""
from __future__ import annotations

import torch
from candidates import top1_agreement
from torch import nn

D_MODEL, LAYERS, CLASSES, LENGTH, BATCH, SEQUENCES = 256, 4, 10, 64, 32, 512


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(D_MODEL, 8, 4 * D_MODEL, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=True)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x, padding_mask):
        hidden = self.encoder(x, src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).float()       # mean over the real positions only
        return self.head((hidden * keep).sum(1) / keep.sum(1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return EncoderClassifier().eval()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    found = []
    for _ in range(SEQUENCES // BATCH):
        x = torch.randn(BATCH, LENGTH, D_MODEL, generator=generator)
        lengths = torch.randint(16, LENGTH + 1, (BATCH,), generator=generator)
        found.append((x, torch.arange(LENGTH)[None, :] >= lengths[:, None]))
    return found


def agreement_eval(reference: nn.Module):
    return top1_agreement(reference, batches())


def example_inputs():
    x, mask = batches()[0]
    return (x, mask)
