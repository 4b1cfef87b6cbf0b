"""The embedded index of a news data set: the NYTimes800k archive is scanned once, every split
is then read from the index by key, object vectors stay there until used; GoodNews's JSON is
indexed the same way."""
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from tellkit.data import news_store
from tellkit.data.news_store import NewsStore
from tellkit.data.nytimes import StoredVectors, load_nytimes_archive

FIX = Path(__file__).parent / "fixtures"
ARCHIVE = FIX / "nytimes" / "nytimes_tiny.archive.gz"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TELLKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_archive_is_scanned_once_then_read_by_key(tmp_path, monkeypatch):
    archive = tmp_path / "nytimes.archive.gz"
    shutil.copy(ARCHIVE, archive)
    scans = []
    real = news_store.iter_documents
    monkeypatch.setattr(news_store, "iter_documents", lambda *a, **k: scans.append(a) or real(*a, **k))
    images = FIX / "nytimes" / "images_processed"
    train = load_nytimes_archive(archive, "train", image_root=images, objects=True, progress=False)
    val = load_nytimes_archive(archive, "val", image_root=images, objects=True, progress=False)
    assert len(scans) == 1  # one scan for both splits
    assert [s.id for s in train] == ["aa11", "bb22"] and [s.id for s in val] == ["cc33"]
    # the same samples as a scan of the archive, objects read on demand
    plain = {s.id: s for s in load_nytimes_archive(archive, image_root=images, objects=True, index=False)}
    for s in train + val:
        ref = plain[s.id]
        assert (s.caption, s.title, s.paragraphs, s.image_position, s.split) == \
            (ref.caption, ref.title, ref.paragraphs, ref.image_position, ref.split)
        np.testing.assert_array_equal(s.extra["faces"], ref.extra["faces"])
        assert ("objects" in s.extra) == ("objects" in ref.extra)
    lazy = train[0].extra["objects"]
    assert isinstance(lazy, StoredVectors) and lazy.shape == (3, 2048)
    np.testing.assert_array_equal(np.asarray(lazy), plain["aa11"].extra["objects"])
    again = pickle.loads(pickle.dumps(lazy))  # a DataLoader worker reopens the index by path
    np.testing.assert_array_equal(np.asarray(again), plain["aa11"].extra["objects"])
    assert train[1].extra["objects"].shape == (0, 2048)

    store = NewsStore.for_source(archive, "nytimes800k", progress=False)
    assert store.article("a2")["headline"]["main"] == "Art Fair Opens"
    assert store.splits() == {"train": 1, "valid": 1, "test": 1} and store.meta["objects"] == 2
    with pytest.raises(KeyError):
        store.article("nope")

    os.utime(archive, ns=(1, 1))  # the source changed: the index is rebuilt
    load_nytimes_archive(archive, "val", image_root=images, progress=False)
    assert len(scans) == 2


def test_goodnews_json_is_indexed_by_article(tmp_path):
    store = NewsStore.for_source(FIX / "goodnews", "goodnews", progress=False)
    data = json.loads((FIX / "goodnews" / "captioning_dataset.json").read_text())
    assert len(store) == len(data)
    aid = next(iter(data))
    assert store.article(aid)["images"] == data[aid]["images"]
    assert [a["_id"] for a in store.articles()] == list(data)
