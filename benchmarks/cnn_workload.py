"""An image classifier of residual blocks (convolutions, BatchNorm, one ReLU module called twice per block as
torchvision's ResNets do, skip additions, strided downsampling, global average pooling, a linear head): the ResNet
shape of many users' vision models that the shipped MNIST CNN does not have. No hub here, so it is trained for 120
steps (~25 s on 2 cores, seeded) on a synthetic task: 10 classes, each a smooth random 32x32 RGB pattern, seen
shifted and under heavy noise. The eval_fn is top-1 accuracy on 512 held-out images (about 0.85: a model with
real margins, some of them thin, as a trained model's are)."""
from __future__ import annotations

import torch
from candidates import top1_accuracy
from torch import nn
from torch.nn import functional as F

WIDTHS, CLASSES, SIZE, BATCH, IMAGES, NOISE, STEPS = (32, 64, 128, 256), 10, 32, 32, 512, 5.0, 120


class Block(nn.Module):
    def __init__(self, into: int, out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(into, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.down = (nn.Sequential(nn.Conv2d(into, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or into != out else nn.Identity())

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.down(x))


class ResidualClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTHS[0], 3, 1, 1, bias=False), nn.BatchNorm2d(WIDTHS[0]), nn.ReLU())
        blocks, into = [], WIDTHS[0]
        for i, width in enumerate(WIDTHS):
            blocks += [Block(into, width, 1 if i == 0 else 2), Block(width, width, 1)]
            into = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(WIDTHS[-1], CLASSES)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _patterns() -> torch.Tensor:
    coarse = torch.randn(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    return F.interpolate(coarse, size=SIZE, mode="bilinear")


def _images(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    x = _patterns()[labels] + NOISE * torch.randn(n, 3, SIZE, SIZE, generator=generator)
    shift = torch.randint(-4, 5, (2,), generator=generator)
    return torch.roll(x, tuple(shift.tolist()), (2, 3)), labels


def model() -> nn.Module:
    torch.manual_seed(0)
    found = ResidualClassifier()
    optimizer = torch.optim.Adam(found.parameters(), 1e-3)
    generator = torch.Generator().manual_seed(2)
    found.train()
    for _ in range(STEPS):
        x, y = _images(64, generator)
        loss = F.cross_entropy(found(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return found.eval()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out images and their labels, in batches."""
    return [_images(BATCH, torch.Generator().manual_seed(100 + i)) for i in range(IMAGES // BATCH)]


def accuracy_eval():
    data = batches()
    return top1_accuracy([(x,) for x, _ in data], [y for _, y in data])


def example_inputs():
    return batches()[0][0]
