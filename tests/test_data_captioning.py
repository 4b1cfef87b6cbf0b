"""Caption data loaders on fixtures in each real format, the Flickr8k subset, contexts, buckets."""
from __future__ import annotations

import gzip
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tellkit.data import load_captions
from tellkit.data.bucketing import bucket_batches
from tellkit.data.coco import load_coco
from tellkit.data.flickr8k import load_flickr8k, read_captions
from tellkit.data.goodnews import load_goodnews
from tellkit.data.mongo_archive import decode_document, iter_documents, read_header
from tellkit.data.nytimes import load_nytimes_archive, load_nytimes_mongo
from tellkit.errors import TellkitError

FIX = Path(__file__).parent / "fixtures"
ARCHIVE = FIX / "nytimes" / "nytimes_tiny.archive.gz"


def test_goodnews_splits_captions_and_images():
    train = load_goodnews(FIX / "goodnews", "train")
    assert [s.id for s in train] == ["5a1b2c_0"]
    s = train[0]
    assert s.caption == "Mayor Jane Doe cuts the ribbon in Albany on Monday."
    assert s.title == "A New Bridge for Albany"
    assert s.paragraphs == ["Mayor Jane Doe opened the bridge on Monday.", "The bridge cost $2 million.", "It spans the Hudson River."]
    assert s.image_position is None and Path(s.image_path).is_file() and s.split == "train"
    assert [x.id for x in load_goodnews(FIX / "goodnews", "test")] == ["5a1b2c_1"]  # same article, other split
    assert len(load_goodnews(FIX / "goodnews")) == 3
    with pytest.raises(TellkitError, match="not found"):
        load_goodnews(FIX / "nytimes")


def test_mongodump_archive_read_without_a_server():
    header, metas = read_header(ARCHIVE)
    assert header["version"] == "0.1" and [m["collection"] for m in metas] == ["articles", "objects"]
    docs = list(iter_documents(ARCHIVE))
    assert Counter(ns for ns, _ in docs) == {"nytimes.articles": 3, "nytimes.objects": 1}
    first = docs[0][1]
    assert first["_id"] == "5c3a1f0e8f1a2b3c4d5e6f70" and first["pub_date"].year == 2018
    assert first["parsed_section"][2]["facenet_details"]["embeddings"][0][3] == pytest.approx(0.03)
    only_articles = list(iter_documents(ARCHIVE, {"nytimes.articles"}))
    assert len(only_articles) == 3


def test_bson_decoder_against_pymongo():
    bson = pytest.importorskip("bson")
    import datetime

    doc = {"s": "héllo", "i": 7, "l": bson.int64.Int64(2**40), "f": 1.5, "b": True, "n": None,
           "a": [1, "x", {"k": [2.5]}], "d": {"e": {}}, "bin": b"\x00\x01", "t": datetime.datetime(2020, 1, 2, 3, 4, 5)}
    got = decode_document(bson.encode(doc))
    assert got["t"].replace(tzinfo=None) == doc["t"]
    del got["t"], doc["t"]
    assert got == doc
    nested = {"keep": 1, "a": [{"pos": ["x"] * 3, "k": 2}], "pos": "text"}
    assert decode_document(bson.encode(nested), skip_fields=["pos"]) == {"keep": 1, "a": [{"k": 2}]}


def test_nytimes_samples_from_the_archive():
    samples = load_nytimes_archive(ARCHIVE, image_root=FIX / "nytimes" / "images_processed", objects=True)
    by_id = {s.id: s for s in samples}
    assert sorted(by_id) == ["aa11", "bb22", "cc33"]
    a = by_id["aa11"]
    assert a.caption == "Waves in Portland, Me., on Friday." and a.title == "Storm Hits Coast"
    assert a.paragraphs[:2] == ["A storm hit the coast of Maine on Friday.", "Thousands lost power."]
    assert a.image_position == 2 and by_id["bb22"].image_position == 4
    assert len(a.extra["faces"]) == 1 and len(a.extra["faces"][0]) == 512 and a.extra["objects"] == [[0.5] * 4]
    assert Path(a.image_path).is_file() and a.split == "train" and by_id["cc33"].split == "val"
    assert [s.id for s in load_nytimes_archive(ARCHIVE, "val")] == ["cc33"]
    with pytest.raises(TellkitError, match="no test captions"):
        load_nytimes_archive(ARCHIVE, "test")


def test_archive_errors_are_one_line(tmp_path):
    raw = gzip.decompress(ARCHIVE.read_bytes())
    (tmp_path / "plain.archive").write_bytes(raw)  # without --gzip
    assert len(load_nytimes_archive(tmp_path / "plain.archive")) == 3
    (tmp_path / "cut.archive").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(TellkitError, match="truncated"):
        load_nytimes_archive(tmp_path / "cut.archive")
    (tmp_path / "cut.gz").write_bytes(ARCHIVE.read_bytes()[:-20])
    with pytest.raises(TellkitError, match="corrupt or truncated|truncated"):
        load_nytimes_archive(tmp_path / "cut.gz")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(TellkitError, match="not a mongodump archive"):
        load_nytimes_archive(tmp_path / "x.json")
    with pytest.raises(TellkitError, match="directory"):
        load_nytimes_archive(tmp_path)


def test_nytimes_from_mongodb_through_a_client():
    docs = [d for ns, d in iter_documents(ARCHIVE, {"nytimes.articles"})]

    class Coll:
        def find(self, query, projection=None):
            allowed = set(query["split"]["$in"])
            return [d for d in docs if d["split"] in allowed]

    client = {"nytimes": {"articles": Coll()}}
    got = load_nytimes_mongo("mongodb://localhost", "val", client=client)
    assert [s.id for s in got] == ["cc33"]


def test_coco_official_and_karpathy():
    val = load_coco(FIX / "coco" / "captions_val.json", "val", image_root=FIX / "coco" / "images")
    assert [(s.id, s.image_id) for s in val] == [("10", "1"), ("11", "1"), ("12", "2")]
    assert Path(val[0].image_path).is_file() and val[0].split == "val"
    ctx = load_coco(FIX / "coco" / "captions_val.json", "val", context="other_captions")
    assert ctx[0].paragraphs == ["A brown dog sleeping."] and ctx[2].paragraphs == []
    k = load_coco(FIX / "coco" / "dataset_karpathy.json", "train")  # restval -> train
    assert [s.caption for s in k] == ["Two people, one kite.", "A kite in the sky."]
    assert Path(k[0].image_path) == FIX / "coco" / "images" / "b.jpg"
    assert load_captions("coco", FIX / "coco" / "dataset_karpathy.json", "test")[0].id == "0"


def test_flickr8k_csv_quoting(tmp_path):
    (tmp_path / "captions.txt").write_text('image,caption\na.jpg,"A dog, running ."\na.jpg,A dog\nb.jpg,A cat , sitting\n')
    rows = read_captions(tmp_path / "captions.txt")
    assert rows == [("a.jpg", "A dog, running ."), ("a.jpg", "A dog"), ("b.jpg", "A cat , sitting")]
    (tmp_path / "bad.txt").write_text("x,y\n")
    with pytest.raises(TellkitError, match="header"):
        read_captions(tmp_path / "bad.txt")


@pytest.mark.data
def test_flickr8k_fixed_seeded_split(shared_data):
    root = shared_data / "flickr8k"
    parts = {s: load_flickr8k(root, s) for s in ("train", "val", "test")}
    assert [len(parts[s]) for s in ("train", "val", "test")] == [4000, 500, 500]
    images = {s: {x.image_id for x in parts[s]} for s in parts}
    assert len(images["train"]) == 800 and not images["train"] & images["test"] and not images["val"] & images["test"]
    assert parts["test"] == load_flickr8k(root, "test")  # fixed
    ctx = load_flickr8k(root, "test", context="other_captions")
    s = ctx[0]
    assert len(s.paragraphs) == 4 and s.paragraphs == [x.caption for x in ctx if x.image_id == s.image_id and x is not s]
    assert Path(s.image_path).is_file()


def test_bucketing_token_cap_and_determinism():
    lengths = [5, 50, 7, 48, 6, 51, 100, 3, 49, 8]
    b = bucket_batches(lengths, batch_size=3, max_tokens=120, shuffle=True, seed=1, epoch=0)
    assert sorted(i for x in b for i in x) == list(range(10))
    for x in b:
        assert len(x) <= 3 and (len(x) == 1 or len(x) * max(lengths[i] for i in x) <= 120)
        assert max(lengths[i] for i in x) - min(lengths[i] for i in x) <= 10  # similar lengths together
    assert b == bucket_batches(lengths, 3, 120, shuffle=True, seed=1, epoch=0)
    assert b != bucket_batches(lengths, 3, 120, shuffle=True, seed=1, epoch=1)
    assert bucket_batches(lengths, 3, 120, shuffle=False) == [[7, 0, 4], [2, 9], [3, 8], [1, 5], [6]]
