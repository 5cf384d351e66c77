"""The MiniLM sentiment workload packed into one folder small enough to carry to a machine without the package or
network: the encoder's config and weights (stored in fp16, loaded back as fp32: 46 MB where fp32 is 90 MB), the
fitted head and the held-out sentences already tokenised into sentiment_eval's batches.

    .venv/bin/python benchmarks/minilm_pack.py DIR [--limit 1000]      # here, where the package and data are
    MINILM_PACKED=DIR python3 benchmarks/gpu.py --workloads minilm     # there: harness.real_workload reads it
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from autotune.workloads.sentiment import SentimentClassifier, accuracy_eval  # noqa: E402

BATCH_SIZE = 64


def pack(folder: Path, limit: int) -> None:
    from autotune.workloads import sentiment
    classifier = sentiment.model()
    folder.mkdir(parents=True, exist_ok=True)
    classifier.encoder.to(torch.float16).save_pretrained(folder / "encoder")
    torch.save({"head": classifier.head.state_dict(), "batches": sentiment.batches(limit, BATCH_SIZE)},
               folder / "data.pt")


def load(folder: str | Path):
    """(fp32 classifier, eval_fn, example inputs, sentences scored) from a packed folder."""
    import transformers
    folder = Path(folder)
    encoder = transformers.AutoModel.from_pretrained(folder / "encoder", dtype=torch.float32).eval()
    encoder.pooler = None
    data = torch.load(folder / "data.pt")
    head = nn.Linear(encoder.config.hidden_size, 2)
    head.load_state_dict(data["head"])
    batches = data["batches"]
    return (SentimentClassifier(encoder, head).eval(), accuracy_eval(batches), batches[0][0],
            sum(len(labels) for _, labels in batches))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--limit", type=int, default=1000)
    arguments = parser.parse_args()
    pack(arguments.folder, arguments.limit)
