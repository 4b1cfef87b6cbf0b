"""The captioning task end to end on the GoodNews fixture with a tiny Transform and Tell and fake
frozen encoders (fixed values of the tiny config's sizes): features, train, evaluate."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tellkit.encoders.features as features_mod
from tellkit.config import deep_merge, load_yaml
from tellkit.data.batch import collate_captions
from tellkit.encoders.bundle import EncoderBundle
from tellkit.tasks.captioning import CaptioningTask
from tellkit.workflows import train_recipe as train

FIX = Path(__file__).parent / "fixtures"


class _Img:
    out_dim = 16
    name = "fake"

    def encode(self, pils):
        x = torch.stack([torch.full((5, 16), float(sum(p.getpixel((0, 0)))) / 765) for p in pils])
        return x, torch.ones(x.shape[:2], dtype=torch.bool)


class _Faces:
    def detect_and_embed(self, pil):
        return {"embeddings": torch.ones(1, 512), "boxes": torch.zeros(1, 4), "probs": torch.ones(1)}


class _Art:
    num_layers, dim, max_tokens, num_special = 3, 24, 64, 0

    def count_tokens(self, text):
        return len(text.split())

    def encode(self, texts, max_tokens=512):
        n = max(len(t.split()) for t in texts)
        g = torch.Generator().manual_seed(n)
        mask = torch.tensor([[i < len(t.split()) for i in range(n)] for t in texts])
        offs = [[(0, 1)] * len(t.split()) for t in texts]
        return {"hidden": torch.randn(len(texts), 3, n, 24, generator=g), "mask": mask, "offsets": offs,
                "tokens": [t.split() for t in texts]}

    def caption_ids(self, texts, offsets):
        return torch.full((len(texts), max(len(o) for o in offsets)), 100)


class FakeBundle(EncoderBundle):
    """The real encoding routine over fake encoders."""

    built = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        FakeBundle.built += 1

    image_encoder = property(lambda self: _Img())
    face_encoder = property(lambda self: _Faces())
    article_encoder = property(lambda self: _Art())


@pytest.fixture
def fake_encoders(monkeypatch):
    monkeypatch.setattr(features_mod, "EncoderBundle", FakeBundle)


def recipe(tmp_path, **train):
    r = load_yaml("tat/tiny")
    return deep_merge(r, {
        "model": {"face_dim": 512},
        "data": {"format": "goodnews", "root": str(FIX / "goodnews"), "context": "first_tokens",
                 "features": str(tmp_path / "feats")},
        "train": {"max_steps": 4, "max_epochs": 10, "lr": 1e-3, "log_every": 1, **train},
        "eval": {"metrics": ["bleu", "rouge", "cider"], "ner": False, "max_len": 6},
    })


def test_feature_cache_and_collate(tmp_path, fake_encoders):
    task = CaptioningTask(recipe(tmp_path))
    ds = task.build_dataset("train")
    assert (tmp_path / "feats" / "train-first_tokens" / "features.json").is_file() and FakeBundle.built == 1
    again = task.build_dataset("train")  # finished shards are reused: no encoder is built
    assert FakeBundle.built == 1 and len(again) == 1
    item = ds[0]
    assert item["caption"][0] == 0 and item["caption"][-1] == 2  # <s> ... </s>
    expected = "Mayor Jane Doe cuts the ribbon in Albany on Monday."
    assert task.tokenizer.decode(item["caption"][1:-1].tolist()) == expected
    assert item["article"].shape[0] == 3 and item["article"].shape[1] > 5 and item["faces"].shape == (1, 512)
    b = collate_captions([item, {**item, "faces": torch.zeros(0, 512), "caption": item["caption"][:3]}], task.contexts)
    assert b["caption"].shape == (2, len(item["caption"])) and b["caption"][1, 3:].eq(1).all()
    assert b["faces_mask"].tolist() == [[True], [False]] and b["article"].shape[:2] == (2, 3)
    assert b["image"].dtype == torch.float32 and b["article_ids"].min() >= -1
    other = deep_merge(recipe(tmp_path), {"encoders": {"image": "resnet50"}})  # other encoders: refused
    with pytest.raises(Exception, match="another configuration or item list"):
        CaptioningTask(other).build_dataset("train")


def test_on_the_fly_encoding_without_a_cache(tmp_path):
    r = recipe(tmp_path)
    del r["data"]["features"]
    task = CaptioningTask(r, bundle=FakeBundle(None, ("image", "article", "faces"), context_mode="first_tokens"))
    ds = task.build_dataset("val")
    item = ds[0]
    from tellkit.tasks.captioning import sample_input

    words = len(task.bundle.context_text(sample_input(ds.samples[0], "first_tokens")).split())
    assert item["image"].shape == (5, 16) and item["article"].shape[:2] == (3, words) and item["id"] == "7d8e9f_0"
    assert words > 3 and item["article_ids"].shape == (words,)
    assert item["faces"].shape == (1, 512) and set(item) == {"id", "image_id", "references", "caption", "image",
                                                             "faces", "article", "article_ids"}


def test_cached_and_fresh_items_are_the_same(tmp_path, fake_encoders):
    """The feature cache and on-the-fly encoding go through one routine: equal items (up to float16)."""
    cached = CaptioningTask(recipe(tmp_path)).build_dataset("val")[0]
    r = recipe(tmp_path)
    del r["data"]["features"]
    fresh = CaptioningTask(r, bundle=FakeBundle(None, ("image", "article", "faces"), context_mode="first_tokens"))
    fresh = fresh.build_dataset("val")[0]
    for k in ("image", "faces", "article"):
        assert torch.allclose(cached[k], fresh[k], atol=1e-2), k
    assert torch.equal(cached["article_ids"], fresh["article_ids"])


def test_precomputed_faces_and_objects_enter_the_batch(tmp_path):
    """A sample that ships face embeddings and object vectors (NYTimes800k) gives them to the
    batch as they are (faces cut to max_faces); no detector runs. Without objects the set is empty."""
    from tellkit.data.sample import CaptionSample
    from tellkit.tasks.captioning import sample_input

    class NoDetector(FakeBundle):
        face_encoder = property(lambda self: pytest.fail("the face detector ran"))

    faces = np.arange(6 * 512, dtype=np.float32).reshape(6, 512)
    objects = np.ones((3, 2048), dtype=np.float32)
    img = str(FIX / "goodnews" / "images" / "5a1b2c_0.jpg")
    with_sets = CaptionSample("a", "x", img, "a", extra={"faces": faces.tolist(), "objects": objects})
    bare = CaptionSample("b", "x", img, "b")
    bundle = NoDetector(None, ("image", "faces", "objects"), context_mode="none")
    items = bundle.encode([sample_input(with_sets, "none")])
    assert torch.equal(items[0]["faces"], torch.from_numpy(faces[:4])) and items[0]["objects"].shape == (3, 2048)
    items += FakeBundle(None, ("image", "faces", "objects")).encode([sample_input(bare, "none")], details=True)
    assert items[1]["objects"].shape == (0, 2048) and items[1]["objects_source"] == "none"
    b = collate_captions(items, ("image", "faces", "objects"))
    assert b["objects"].shape == (2, 3, 2048) and b["objects_mask"].tolist() == [[True] * 3, [False] * 3]
    assert b["faces_mask"].tolist() == [[True] * 4, [True, False, False, False]]


def test_train_then_evaluate_through_the_cli(tmp_path, fake_encoders):
    r = recipe(tmp_path, max_tokens=None)
    s = train(r, tmp_path / "run", progress=False)
    assert s["steps"] == 4 and s["best"] is not None
    from tellkit.cli import main

    argv = ["evaluate", str(tmp_path / "run"), "--data", str(FIX / "goodnews"), "--split", "test", "--no-progress"]
    assert main(argv) == 0
    out = tmp_path / "run" / "eval"
    summary = json.loads((out / "metrics_test.json").read_text())
    assert summary["n"] == 1
    assert {"bleu4", "rouge_l", "cider", "length", "ttr", "flesch", "loss"} <= set(summary["metrics"])
    row = json.loads((out / "predictions_test.jsonl").read_text())
    assert row["id"] == "5a1b2c_1" and row["references"] == ["The new bridge at dusk."] and "cider" in row["scores"]
    assert isinstance(row["prediction"], str)
    assert "ner_model" not in summary  # no entity metrics asked for: no pipeline to name


def test_evaluation_names_the_spacy_pipeline_beside_the_metrics(tmp_path, fake_encoders):
    pytest.importorskip("spacy")
    from tellkit.cli import main
    from tellkit.metrics.ner import resolve_model

    train(recipe(tmp_path, max_tokens=None, max_steps=1), tmp_path / "run", progress=False)
    argv = ["evaluate", str(tmp_path / "run"), "--data", str(FIX / "goodnews"), "--split", "test", "--no-progress",
            "--out", str(tmp_path / "ev"), "eval.ner=true"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "ev" / "metrics_test.json").read_text())
    assert summary["ner_model"] == resolve_model("auto")
    assert "entities_precision" in summary["metrics"] and "rare_proper_nouns_recall" in summary["metrics"]
    # the reference's full figure set: both rare-name variants with counts, both sides' linguistic measures
    figures = {f"{g}_{side}{part}" for g in ("rare_proper_nouns", "rare_proper_nouns_article")
               for side in ("precision", "recall") for part in ("", "_count", "_total")}
    figures |= {f"{p}{m}" for p in ("", "reference_") for m in ("length", "unique_words", "ttr", "flesch")}
    assert figures <= set(summary["metrics"])
    names = summary["rare_names"]  # where the counts came from
    assert names["source"]["split"] == "train" and names["captions"] == 1 and names["articles"] == 1
    assert Path(names["cache"]).parent == tmp_path / "feats"
    # the name is not a metric: every value is a number, or null where a figure is undefined (0/0)
    assert all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
               for v in summary["metrics"].values())
    assert summary["metrics"]["entities_precision_total"] >= 0


TAT_RECIPES = Path(__file__).resolve().parents[1] / "configs" / "tat"


@pytest.mark.parametrize("name", sorted(p.stem for p in TAT_RECIPES.glob("*.yaml")))
def test_tat_recipes_are_valid(name):
    """Every Transform and Tell recipe: its train section is a valid TrainConfig, its task exists
    and its model builds (on the meta device: no memory)."""
    from tellkit.recipes import train_config
    from tellkit.registry import create_model
    from tellkit.tasks import get_task

    r = load_yaml(f"tat/{name}")
    cfg = train_config(r)
    assert cfg.lr > 0 and get_task(r["task"]) is CaptioningTask
    with torch.device("meta"):
        create_model(r)


def _capitalised(text):
    """A fake NER: no entities; every capitalised word of two letters or more is a proper noun."""
    import re

    return [], re.findall(r"\b[A-Z][a-z]+\b", text)


@pytest.fixture
def fake_ner(monkeypatch):
    """``eval.ner_model: fake`` tags with :func:`_capitalised` (no spaCy)."""
    import tellkit.metrics.ner as ner

    monkeypatch.setattr(ner, "load_nlp", lambda model="auto": _capitalised)


def ner_recipe(tmp_path, root=FIX / "goodnews"):
    return deep_merge(recipe(tmp_path), {"data": {"root": str(root)},
                                          "eval": {"ner": True, "ner_model": "fake", "metrics": ["bleu"]}})


def test_training_name_counts_stream_the_training_split_only(tmp_path, fake_ner):
    """The fixture's training split is one caption of article 5a1b2c; its counts are that caption's
    and that article's (headline + text) proper nouns. Article 7d8e9f (val) and the test caption of
    5a1b2c add nothing. Cached beside the features; read back without touching the data."""
    import tellkit.tasks.captioning.names as names

    task = CaptioningTask(ner_recipe(tmp_path))
    counts = task.name_counts(articles=True)
    assert counts.caption == {"Mayor": 1, "Jane": 1, "Doe": 1, "Albany": 1, "Monday": 1}
    assert counts.context == {"New": 1, "Bridge": 1, "Albany": 1, "Mayor": 1, "Jane": 1, "Doe": 1, "Monday": 1,
                              "The": 1, "It": 1, "Hudson": 1, "River": 1}
    assert counts.info["captions"] == 1 and counts.info["articles"] == 1 and counts.info["source"]["split"] == "train"
    cache = tmp_path / "feats" / "train_name_counts-fake.json"
    assert counts.info["cache"] == str(cache) and cache.is_file() and not counts.info["cached"]
    again = CaptioningTask(ner_recipe(tmp_path))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(names, "iter_article_texts", lambda *a, **k: pytest.fail("the training split was read again"))
        cached = again.name_counts(articles=True)
    assert cached.caption == counts.caption and cached.context == counts.context and cached.info["cached"]
    # another data location is another source: counted again, not taken from the cache
    other = tmp_path / "copy"
    other.mkdir()
    for name in ("captioning_dataset.json", "img_splits.json"):
        (other / name).write_text((FIX / "goodnews" / name).read_text())
    (other / "img_splits.json").write_text(json.dumps({"5a1b2c_0.jpg": "train", "5a1b2c_1.jpg": "test",
                                                       "7d8e9f_0.jpg": "train"}))
    moved = CaptioningTask(ner_recipe(tmp_path, other)).name_counts(articles=True)
    assert moved.caption["Serena"] == 1 and moved.context["Williams"] == 2 and not moved.info["cached"]


def test_rare_name_figures_by_hand_on_a_crafted_example(tmp_path, fake_ner):
    """Generated 'Mayor Jane Doe meets Serena Zorg', reference 'Serena Zorg and Hudson Quux visit'.
    Caption-rare (not among the training captions' Mayor Jane Doe Albany Monday): generated Serena
    Zorg, reference Serena Zorg Hudson Quux -> precision 2/2, recall 2/4. Article-rare (nor among the
    training article's names, Hudson among them): reference Serena Zorg Quux -> recall 2/3. Serena
    is in the val article only, so she stays rare."""
    task = CaptioningTask(ner_recipe(tmp_path))
    task.evaluation_dir = tmp_path / "eval"  # a final evaluation: the article-rare figures too
    preds = [{"id": "x", "prediction": "Mayor Jane Doe meets Serena Zorg",
              "references": ["Serena Zorg and Hudson Quux visit"]}]
    m = task.score(preds)
    assert (m["proper_nouns_precision_count"], m["proper_nouns_precision_total"]) == (2, 5)
    assert (m["rare_proper_nouns_precision_count"], m["rare_proper_nouns_precision_total"]) == (2, 2)
    assert (m["rare_proper_nouns_recall_count"], m["rare_proper_nouns_recall_total"]) == (2, 4)
    assert m["rare_proper_nouns_recall"] == pytest.approx(50.0)
    assert (m["rare_proper_nouns_article_recall_count"], m["rare_proper_nouns_article_recall_total"]) == (2, 3)
    assert m["rare_proper_nouns_article_recall"] == pytest.approx(200 / 3)
    assert m["rare_proper_nouns_article_precision"] == pytest.approx(100.0)
    # the human captions' measures beside the generations'
    assert m["reference_length"] == 6 and m["length"] == 6 and m["reference_unique_words"] == 6
    assert {"reference_ttr", "reference_flesch"} <= set(m)
    assert task.eval_info["rare_names"]["source"]["format"] == "goodnews"
    # a training run's validation (no evaluation folder) leaves the article pass to tellkit evaluate
    val = CaptioningTask(ner_recipe(tmp_path)).score([dict(p) for p in preds])
    assert "rare_proper_nouns_recall" in val and "rare_proper_nouns_article_recall" not in val


def test_evaluate_without_a_training_split_says_so(tmp_path, fake_encoders, fake_ner, capsys):
    """A data location with no training captions: no rare-name figure, a note in the JSON and one
    warning line; every other figure is still there."""
    from tellkit.cli import main

    train(recipe(tmp_path, max_tokens=None, max_steps=1), tmp_path / "run", progress=False)
    data = tmp_path / "no_train"
    data.mkdir()
    (data / "captioning_dataset.json").write_text((FIX / "goodnews" / "captioning_dataset.json").read_text())
    (data / "img_splits.json").write_text(json.dumps({"5a1b2c_1.jpg": "test", "7d8e9f_0.jpg": "val"}))
    (data / "images").symlink_to(FIX / "goodnews" / "images")
    capsys.readouterr()
    argv = ["evaluate", str(tmp_path / "run"), "--data", str(data), "--split", "test", "--no-progress",
            "--out", str(tmp_path / "ev"), "eval.ner=true", "eval.ner_model=fake",
            f"data.features={tmp_path / 'feats2'}"]
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and "training split could not be read" in err[0]
    summary = json.loads((tmp_path / "ev" / "metrics_test.json").read_text())
    assert "training split could not be read" in summary["rare_names"]["note"]
    assert not any(k.startswith("rare_") for k in summary["metrics"])
    assert {"proper_nouns_recall", "reference_length", "bleu4"} <= set(summary["metrics"])


def test_training_captions_keep_up_to_max_caption_tokens(tmp_path):
    """Captions are cut at data.max_caption_tokens (510 by default, as the reference's caption
    indexer), not at the model's generation length; the decoder (positions from 2) takes them."""
    from tellkit.data.sample import CaptionSample
    from tellkit.tasks.captioning import CaptionDataConfig, CaptionDataset

    assert CaptionDataConfig().max_caption_tokens == 510
    r = recipe(tmp_path)
    del r["data"]["features"]
    r["data"]["context"] = "none"
    task = CaptioningTask(r, bundle=FakeBundle(None, ("image", "article", "faces"), context_mode="none"))
    assert task.model_cfg["max_len"] == 20  # tat/tiny generates at most 20 tokens
    img = str(FIX / "goodnews" / "images" / "5a1b2c_0.jpg")
    long = " ".join(f"word{i}" for i in range(400))  # far more than 510 BPE tokens
    samples = [CaptionSample("a", long, img, "a"), CaptionSample("b", "A short one.", img, "b")]
    ds = CaptionDataset(samples, task, "train", per_image=False)
    assert len(ds.caption_ids[0]) == 512 and ds.caption_ids[0][0] == 0 and ds.caption_ids[0][-1] == 2
    assert task.tokenizer.decode(ds.caption_ids[1][1:-1]) == "A short one."
    torch.manual_seed(0)
    model = task.build_model()
    assert model.config.position_start == 2
    out = model(task.collate([ds[0], ds[1]]))
    assert out["ntokens"] == 511 + len(ds.caption_ids[1]) - 1 and torch.isfinite(out["loss"])
    r["data"]["max_caption_tokens"] = 30
    short = CaptionDataset(samples, CaptioningTask(r, bundle=task.bundle), "train", per_image=False)
    assert len(short.caption_ids[0]) == 32
    r["data"]["max_caption_tokens"] = 0
    with pytest.raises(Exception, match="max_caption_tokens must be at least 1"):
        CaptioningTask(r)


def test_feature_cache_keeps_precomputed_faces_and_objects(tmp_path, monkeypatch):
    """Shipped face embeddings and object vectors are stored as given (no detector runs) and
    read back per image; an image without objects gets an empty set."""
    from tellkit.encoders.bundle import CaptionInput, EncodersConfig
    from tellkit.encoders.features import FeatureConfig, FeatureStore, extract_features

    class NoDetector(FakeBundle):
        face_encoder = property(lambda self: pytest.fail("the face detector ran"))

    img = str(FIX / "goodnews" / "images" / "5a1b2c_0.jpg")
    faces = torch.randn(6, 512)
    objects = torch.randn(5, 2048)
    items = [CaptionInput("a", img, faces=faces.numpy(), objects=objects.numpy()),
             CaptionInput("b", img, faces=torch.zeros(0, 512))]  # shipped, but no face in the image
    cfg = FeatureConfig(EncodersConfig(max_faces=3), faces=True, objects=True, dtype="float32")
    monkeypatch.setattr(features_mod, "EncoderBundle", NoDetector)
    extract_features(items, tmp_path / "f", cfg, progress=False)
    store = FeatureStore(tmp_path / "f")
    assert torch.equal(store["a"]["faces"], faces[:3]) and torch.equal(store["a"]["objects"], objects)
    assert store["b"]["faces"].shape == (0, 512) and store["b"]["objects"].shape == (0, 2048)
    assert json.loads((tmp_path / "f" / "features.json").read_text())["config"]["max_faces"] == 3


def test_encoder_sizes_are_checked_before_any_feature_is_extracted(shared_data, tmp_path):
    """tat/tiny reads 16-d image vectors; the packaged MobileNetV2 gives 1280-d ones: the
    mismatch is named before the feature cache is written, not after extraction."""
    from tellkit.errors import TellkitError
    from tellkit.tasks.captioning import CaptioningTask

    recipe = deep_merge(load_yaml("tat/tiny"), {"data": {
        "format": "goodnews", "context": "first_tokens", "root": str(shared_data / "goodnews_sample"),
        "features": str(tmp_path / "feats")}})
    with pytest.raises(TellkitError, match="gives 1280-d features; the model expects image_dim=16"):
        CaptioningTask(recipe).build_dataset("train")
    assert not list(tmp_path.rglob("shard-*"))


def test_rare_name_counts_of_the_real_goodnews_sample(shared_data, tmp_path):
    """spaCy's PROPN counts of the real sample's training split: 'Manila' once (its test caption,
    'The body of a man ... in Manila.', is not counted), 'Leroy' in two training captions,
    'Facebook' in the articles far more often than in the captions."""
    pytest.importorskip("spacy")
    from tellkit.metrics.ner import resolve_model
    from tellkit.tasks.captioning.names import training_name_counts

    counts = training_name_counts("goodnews", str(shared_data / "goodnews_sample"), {}, resolve_model("auto"),
                                  cache_dir=tmp_path)
    assert counts.caption["Manila"] == 1 and counts.caption["Leroy"] == 2
    assert counts.context["Facebook"] > counts.caption["Facebook"] >= 1
    assert counts.info["captions"] == 9 and counts.info["articles"] == 4
    assert json.loads(Path(counts.info["cache"]).read_text())["source"]["format"] == "goodnews"
