"""Caption data loaders on fixtures in each real format, the Flickr8k subset, contexts, buckets."""
from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
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
    # blank-line blocks as stored: joined back they are the article (the reference's context body)
    assert s.paragraphs == ["Mayor Jane Doe opened the bridge on Monday.",
                            "The bridge cost $2 million.\nIt spans the Hudson River."]
    assert s.image_position is None and Path(s.image_path).is_file() and s.split == "train"
    test = load_goodnews(FIX / "goodnews", "test")
    assert [x.id for x in test] == ["5a1b2c_1"]  # same article, other split
    assert len(load_goodnews(FIX / "goodnews")) == 3
    with pytest.raises(TellkitError, match="not found"):
        load_goodnews(FIX / "nytimes")


def test_mongodump_archive_read_without_a_server():
    header, metas = read_header(ARCHIVE)
    assert header["version"] == "0.1" and [m["collection"] for m in metas] == ["articles", "objects"]
    docs = list(iter_documents(ARCHIVE))
    assert Counter(ns for ns, _ in docs) == {"nytimes.articles": 3, "nytimes.objects": 2}
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
    # other captions are empty slots; the image's own caption is not among the paragraphs
    assert a.image_position == 2 and by_id["bb22"].image_position == 5
    assert by_id["bb22"].paragraphs == ["A storm hit the coast of Maine on Friday.", "Thousands lost power.", "",
                                        "Governor Paul LePage declared an emergency.", "Schools were closed.",
                                        "Power returned on Sunday."]
    faces, objects = a.extra["faces"], a.extra["objects"]
    assert faces.dtype == objects.dtype == np.float32
    assert faces.shape == (4, 512) and faces[3, 1] == pytest.approx(3.01)  # first four of five, in order
    assert objects.shape == (3, 2048) and objects[0, 0] == 0.5 and objects[2, 5] == 1.0
    b = by_id["bb22"]
    assert b.extra["faces"].shape == (0, 512) and b.extra["objects"].shape == (0, 2048)  # shipped, none found
    assert "objects" not in by_id["cc33"].extra  # not in collection objects: no object set
    # no facenet_details: the dump stores them only where faces were found, so none were (reference)
    assert by_id["cc33"].extra["faces"].shape == (0, 512)
    assert "objects" not in load_nytimes_archive(ARCHIVE, "train")[0].extra  # objects=False: not read
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

    objects = {d["_id"]: d for ns, d in iter_documents(ARCHIVE, {"nytimes.objects"})}

    class Objects:
        def find(self, query, projection=None):
            return [objects[k] for k in query["_id"]["$in"] if k in objects]

    client = {"nytimes": {"articles": Coll(), "objects": Objects()}}
    got = load_nytimes_mongo("mongodb://localhost", "val", client=client)
    assert [s.id for s in got] == ["cc33"]
    train = load_nytimes_mongo("mongodb://localhost", "train", client=client, objects=True)
    assert {s.id: s.extra["objects"].shape for s in train} == {"aa11": (3, 2048), "bb22": (0, 2048)}
    assert train[0].extra["faces"].shape == (4, 512)


def test_goodnews_captions_cleaned_as_the_reference(tmp_path):
    import json

    from tellkit.data.goodnews import clean_caption

    raw = " <b>DUSK</b> The new bridge at dusk [Click to enlarge] &amp; lit. "
    # HTML to text (entities decoded), [...] removed, stripped
    assert clean_caption(raw) == "DUSK The new bridge at dusk  & lit."
    assert clean_caption("Christie&apos;s <strong>SALE</strong> [To be titled], 2015.") == "Christie's SALE , 2015."
    (tmp_path / "captioning_dataset.json").write_text(json.dumps(
        {"a1": {"article": "Text.", "headline": {"main": "H"}, "images": {"0": raw, "1": "[only a note]"}}}))
    (tmp_path / "img_splits.json").write_text(json.dumps({"a1_0.jpg": "test", "a1_1.jpg": "test"}))
    got = load_goodnews(tmp_path, "test")
    assert [s.caption for s in got] == ["DUSK The new bridge at dusk  & lit."]  # an empty caption is dropped
    assert load_goodnews(tmp_path, "test", clean_captions=False)[0].caption == raw.strip()


def test_goodnews_objects_where_present():
    got = load_goodnews(FIX / "goodnews", objects=FIX / "goodnews" / "goodnews_objects.archive.gz")
    by_id = {s.id: s for s in got}
    o = by_id["5a1b2c_0"].extra["objects"]
    assert o.dtype == np.float32 and o.shape == (2, 2048) and o[1, 7] == 0.75
    assert "objects" not in by_id["5a1b2c_1"].extra


def test_bad_shipped_vectors_are_one_line_errors():
    from tellkit.data.nytimes import vectors

    with pytest.raises(TellkitError, match="2048"):
        vectors([[1.0, 2.0]], 2048, 64, "objects of image x")
    assert vectors([[0.0] * 4] * 70, 4, 64, "x").shape == (64, 4)


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
    text = 'image,caption\na.jpg,"A dog, running ."\na.jpg,A dog\nb.jpg,A cat , sitting\n'
    (tmp_path / "captions.txt").write_text(text)
    rows = read_captions(tmp_path / "captions.txt")
    assert rows == [("a.jpg", "A dog, running ."), ("a.jpg", "A dog"), ("b.jpg", "A cat , sitting")]
    (tmp_path / "bad.txt").write_text("x,y\n")
    with pytest.raises(TellkitError, match="header"):
        read_captions(tmp_path / "bad.txt")


def _flickr8k_fixture(root: Path, with_split: bool) -> None:
    """Six images with two captions each, in the official layout (token file + split files)."""
    text = root / "Flickr8k_text"
    text.mkdir(parents=True)
    names = [f"{i}_x.jpg" for i in range(6)]
    (text / "Flickr8k.token.txt").write_text(
        "".join(f"{n}#{k}\tA caption {k} of {n} , with a comma .\n" for n in names for k in range(2)))
    if with_split:
        for part, chosen in (("train", names[:3]), ("dev", names[3:4]), ("test", names[4:5])):
            (text / f"Flickr_8k.{part}Images.txt").write_text("\n".join(chosen) + "\n")


def test_flickr8k_official_split_files(tmp_path):
    _flickr8k_fixture(tmp_path, with_split=True)
    parts = {s: load_flickr8k(tmp_path, s) for s in ("train", "val", "test")}
    assert [len(parts[s]) for s in ("train", "val", "test")] == [6, 2, 2]
    assert {x.image_id for x in parts["val"]} == {"3_x.jpg"}  # dev is the validation split
    second = parts["train"][1]
    assert second.id == "0_x.jpg#1" and second.caption == "A caption 1 of 0_x.jpg , with a comma ."
    everything = load_flickr8k(tmp_path)
    assert len(everything) == 12 and [x.split for x in everything if x.image_id == "5_x.jpg"] == [None, None]
    (tmp_path / "Flickr8k_text" / "Flickr_8k.devImages.txt").unlink()
    with pytest.raises(TellkitError, match="incomplete"):
        load_flickr8k(tmp_path, "train")
    with pytest.raises(TellkitError, match="split must be"):
        load_flickr8k(tmp_path, "dev")


def test_flickr8k_bad_token_line(tmp_path):
    _flickr8k_fixture(tmp_path, with_split=True)
    with open(tmp_path / "Flickr8k_text" / "Flickr8k.token.txt", "a") as f:
        f.write("no tab or hash here\n")
    with pytest.raises(TellkitError, match=r"Flickr8k.token.txt:13: expected"):
        load_flickr8k(tmp_path, "train")


def test_flickr8k_seeded_split_without_split_files(tmp_path):
    rows = "".join(f"{i}.jpg,A photo {k} of {i}\n" for i in range(20) for k in range(5))
    (tmp_path / "captions.txt").write_text("image,caption\n" + rows)
    parts = {s: load_flickr8k(tmp_path, s) for s in ("train", "val", "test")}
    images = {s: {x.image_id for x in parts[s]} for s in parts}
    assert [len(images[s]) for s in ("train", "val", "test")] == [16, 2, 2]
    assert not images["train"] & images["test"] and not images["val"] & images["test"]
    assert parts["test"] == load_flickr8k(tmp_path, "test")  # fixed
    assert images["test"] != {x.image_id for x in load_flickr8k(tmp_path, "test", seed=9)}


@pytest.mark.data
def test_flickr8k_official_split(shared_data):
    root = shared_data / "flickr8k"
    parts = {s: load_flickr8k(root, s) for s in ("train", "val", "test")}
    assert [len(parts[s]) for s in ("train", "val", "test")] == [30000, 5000, 5000]
    images = {s: {x.image_id for x in parts[s]} for s in parts}
    assert [len(images[s]) for s in ("train", "val", "test")] == [6000, 1000, 1000]
    assert not images["train"] & images["test"] and not images["val"] & images["test"]
    assert not images["train"] & images["val"]
    listed = (root / "Flickr8k_text" / "Flickr_8k.testImages.txt").read_text().split()
    assert images["test"] == set(listed)
    assert len(load_flickr8k(root)) == 40455
    # the CSV form holds the same captions
    csv_rows = read_captions(root / "captions.txt")
    assert sorted(csv_rows) == sorted((x.image_id, x.caption) for x in load_flickr8k(root))
    ctx = load_flickr8k(root, "test", context="other_captions")
    s = ctx[0]
    others = [x.caption for x in ctx if x.image_id == s.image_id and x is not s]
    assert len(s.paragraphs) == 4 and s.paragraphs == others
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


def test_bson_long_double_arrays_and_id_filter():
    import bson

    from tellkit.data.mongo_archive import peek_id

    rng = np.random.default_rng(0)
    doc = {"_id": "h1", "object_features": rng.normal(size=(3, 2048)).tolist(),
           "mixed": [1.5] * 200 + ["x"], "ints": list(range(300)), "many": rng.normal(size=12345).tolist()}
    got = decode_document(bson.encode(doc))
    assert got == doc  # the vectorised path gives the same floats; mixed / int arrays fall back
    assert peek_id(bson.encode(doc)) == "h1" and peek_id(bson.encode({"x": 1})) is None
    docs = list(iter_documents(ARCHIVE, {"nytimes.objects"}, ids={"bb22"}))
    assert [d["_id"] for _, d in docs] == ["bb22"]


def test_face_and_object_sizes_have_one_home():
    """NYTimes800k's reader, the face encoder and the bundle share the bundle's constants, and
    no encoder module imports the data loaders (data sits above encoders: no cycle)."""
    import ast
    import inspect

    from tellkit.data import nytimes
    from tellkit.encoders import bundle
    from tellkit.encoders.faces.pipeline import FaceEncoder

    assert (nytimes.MAX_FACES, nytimes.FACE_DIM, nytimes.OBJECT_DIM) == (bundle.MAX_FACES, bundle.FACE_DIM,
                                                                         bundle.OBJECT_DIM)
    source = inspect.getsource(nytimes)
    assert "MAX_FACES = " not in source and "OBJECT_DIM = " not in source and "FACE_DIM, OBJECT_DIM =" not in source
    assert inspect.signature(FaceEncoder).parameters["max_faces"].default == bundle.MAX_FACES
    root = Path(bundle.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.split(".")[:2] in (["tellkit", "data"], ["tellkit", "tasks"])]
            assert not bad, f"{path.relative_to(root)} imports {bad}"


TAT = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "configs" / "tat"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "default_caption"


@pytest.mark.parametrize("name", sorted(p.stem for p in TAT.glob("*.yaml")))
def test_tat_recipes_name_no_data_location(name):
    """Data roots come from the recipe user (data.root=..., --data), never from a folder of a
    checkout; without one the task says so in one line."""
    from tellkit.config import load_yaml
    from tellkit.tasks.captioning import CaptioningTask

    r = load_yaml(f"tat/{name}")
    assert "root" not in (r.get("data") or {}), r["data"]
    assert "shared" not in (TAT / f"{name}.yaml").read_text(encoding="utf-8")
    with pytest.raises(TellkitError, match="no 'root'.*data.root=PATH"):
        CaptioningTask(r).load_samples("train")


def test_default_model_metadata_names_no_machine_path():
    import json

    meta = json.loads((DEFAULT_MODEL / "config.json").read_text(encoding="utf-8"))
    texts = [json.dumps(meta), (DEFAULT_MODEL / "README.md").read_text(encoding="utf-8")]
    for text in texts:
        assert "shared/data" not in text and "/work" not in text and "/home" not in text
    assert meta["data"].get("root") is None and meta["data"].get("features") is None


@pytest.mark.data
def test_flickr8k_recipe_reads_the_data_given_to_it(shared_data):
    from tellkit.config import deep_merge, load_yaml
    from tellkit.tasks.captioning import CaptioningTask

    r = deep_merge(load_yaml("tat/flickr8k_small"), {"data": {"root": str(shared_data / "flickr8k")}})
    val = CaptioningTask(r).load_samples("val")
    assert len({s.image_id for s in val}) == 1000 and all(Path(s.image_path).is_file() for s in val[:5])


def test_goodnews_split_rule_as_goodnews_drew_it():
    """GoodNews's clean_captions.py: np.random.seed(42), then per caption (articles and images in
    file order) u = np.random.uniform(); u > 0.95 test, 0.91 < u < 0.95 val, else train."""
    import numpy as np

    from tellkit.data.goodnews import goodnews_splits

    articles = {f"a{i}": {"images": {str(j): f"c{j}" for j in (2, 0, 1)[: 1 + i % 3]}} for i in range(3000)}
    np.random.seed(42)
    expected = {}
    for aid, art in articles.items():
        for ix in art["images"]:
            u = np.random.uniform()
            expected[f"{aid}_{ix}.jpg"] = "test" if u > 0.95 else ("val" if 0.91 < u < 0.95 else "train")
    got = goodnews_splits(articles)
    assert got == expected and list(got) == list(expected)
    share = {k: sum(v == k for v in got.values()) / len(got) for k in ("train", "val", "test")}
    assert abs(share["test"] - 0.05) < 0.01 and abs(share["val"] - 0.04) < 0.01


def test_the_real_goodnews_sample_reads_and_becomes_a_batch(shared_data, tmp_path):
    """GoodNews' own release format (5 New York Times articles, 12 photos, no split file): the
    loader reads every non-empty caption, cleaned, with its article and photo; the captioning
    processor (the one evaluation and the pipelines use) turns the samples into a batch a
    Transform and Tell reads."""
    import torch

    from tellkit.encoders.bundle import EncoderBundle, EncodersConfig
    from tellkit.registry import create_model
    from tellkit.tasks.captioning import CaptionGeneration, CaptionProcessor, sample_input

    root = shared_data / "goodnews_sample"
    samples = load_goodnews(root)
    assert len(samples) == 10  # 12 photos, 2 with an empty caption
    # one article has only an empty caption
    assert len({s.article_id for s in samples}) == 4 and all(Path(s.image_path).is_file() for s in samples)
    by_id = {s.id: s for s in samples}
    zuck = by_id["54453eab38f0d832c813e7f5_0"]
    assert zuck.caption == "Mark Zuckerberg is the chief executive of Facebook."  # stripped of its blank lines
    assert zuck.title and zuck.paragraphs and zuck.split is None and zuck.extra["url"].startswith("http")
    assert any("Leroy Smith" in s.caption for s in samples)
    assert all("[" not in s.caption and "<" not in s.caption for s in samples)
    # no img_splits.json: a split is drawn by GoodNews's own rule (seed 42, one draw per photo)
    dropped = []
    test = load_goodnews(root, "test", dropped=dropped)
    assert [s.id for s in test] == ["584f1ddf95d0e0392607597e_0"] and test[0].split == "test"
    assert [d["id"] for d in dropped] == ["51a92bb440e9ec65d203a9e4_0"]  # a test photo with an empty caption
    assert dropped[0]["reason"] == "empty caption"
    assert len(load_goodnews(root, "train")) == 9

    contexts = ("image", "article")
    proc = CaptionProcessor(EncoderBundle(EncodersConfig(), contexts, max_article_tokens=64), contexts=contexts)
    items = [proc.prepare(sample_input(s)) for s in samples[:4]]
    batch = proc.collate(items)
    assert batch["image"].shape[:2] == (4, 49) and batch["image_mask"].all()
    assert batch["article"].shape[0] == 4 and batch["article"].shape[2] <= 64
    # every article is read from its title on, up to the budget; shorter ones are padded and masked
    lengths = batch["article_mask"].sum(1).tolist()
    assert all(3 < n <= 64 for n in lengths)
    assert all(e["article_text"].startswith(s.title) for e, s in zip(batch["encoded"], samples[:4]))
    torch.manual_seed(0)
    model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, contexts=list(contexts))
    out = proc.generate(model.eval(), batch, CaptionGeneration(max_len=5))
    assert len(proc.decode(out, batch, details=False)) == 4


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_article_texts_stream_what_the_loaders_read(split):
    """The streamed texts of a split (rare-name counting) are the loaders' captions and articles
    (headline and paragraphs; NYTimes800k's empty slots for other captions left out)."""
    from tellkit.data import iter_article_texts

    for fmt, root in (("goodnews", FIX / "goodnews"), ("nytimes800k", ARCHIVE)):
        streamed = list(iter_article_texts(fmt, root, split, progress=False))
        if fmt == "nytimes800k" and split == "test":  # the archive has no test article
            assert streamed == []
            continue
        samples = load_captions(fmt, root, split, progress=False)
        assert Counter(c for _, caps in streamed for c in caps) == Counter(s.caption for s in samples)
        articles = {"\n\n".join(p for p in [s.title, *s.paragraphs] if p) for s in samples}
        assert {a for a, _ in streamed} == articles and len(streamed) == len(articles), fmt


def test_the_real_goodnews_sample_streams_its_training_split(shared_data):
    """GoodNews's release without img_splits.json: the streamed training split is the one the loader
    draws (the same captions, each article once), and a test caption of a training article is not
    among the training captions."""
    from tellkit.data import iter_article_texts

    root = shared_data / "goodnews_sample"
    train = list(iter_article_texts("goodnews", root, "train", progress=False))
    samples = load_goodnews(root, "train", progress=False)
    assert Counter(c for _, caps in train for c in caps) == Counter(s.caption for s in samples)
    assert len(train) == len({s.article_id for s in samples}) and all(a for a, _ in train)
    test = [c for _, caps in iter_article_texts("goodnews", root, "test", progress=False) for c in caps]
    assert test and not set(test) & {c for _, caps in train for c in caps}
