"""The middle layer: the captioning pipeline over one encoder bundle, typed recipe sections,
one generation config (the import layering: test_layering.py)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tellkit.config import load_yaml
from tellkit.encoders.bundle import EncoderBundle
from tellkit.encoders.preprocess import ImageNetTransform
from tellkit.errors import TellkitError
from tellkit.pipelines import captioning as P
from tellkit.tasks.captioning import CaptionGeneration, CaptionProcessor

SRC = Path(__file__).resolve().parents[1] / "src" / "tellkit"
DEMO = SRC / "assets" / "demo_caption"


class _Img:
    out_dim, name = 16, "fake-image"
    preprocess = ImageNetTransform()

    def encode(self, pils):
        x = torch.stack([torch.full((4, 16), float(sum(p.getpixel((0, 0)))) / 765) for p in pils])
        return x, torch.ones(x.shape[:2], dtype=torch.bool)


class FakeBundle(EncoderBundle):
    image_encoder = property(lambda self: _Img())


def tiny(contexts, **kw):
    from tellkit.registry import create_model

    torch.manual_seed(0)
    return create_model("tat/tiny", contexts=list(contexts), max_len=6, **kw)


# --- typed recipe sections -------------------------------------------------------------------------
@pytest.mark.parametrize("section,key", [("data", "contxt"), ("eval", "beamsize"), ("encoders", "imagee")])
def test_a_typo_in_a_captioning_section_is_a_one_line_error(section, key):
    from tellkit.tasks.captioning import CaptioningTask

    r = load_yaml("tat/tiny")
    r[section] = {**(r.get(section) or {}), key: 1}
    with pytest.raises(TellkitError, match=f"{section}: unknown key.*{key}") as exc:
        CaptioningTask(r)
    assert "\n" not in str(exc.value)


def test_bad_values_are_refused():
    from tellkit.tasks.captioning import CaptioningTask

    r = load_yaml("tat/tiny")
    for section, value, msg in [("data", {"context": "everything"}, "data.context"),
                                ("data", {"format": "imagenet"}, "data.format"),
                                ("data", {"limit": {"dev": 3}}, "unknown split"),
                                ("eval", {"beam_size": 0}, "beam_size")]:
        with pytest.raises(TellkitError, match=msg):
            CaptioningTask({**r, section: value})


def test_no_data_location_is_a_clear_error():
    from tellkit.tasks.captioning import CaptioningTask

    r = load_yaml("baselines/flickr8k/show_tell")  # ships without a data location
    assert "root" not in r["data"]
    with pytest.raises(TellkitError, match="no 'root'.*--data"):
        CaptioningTask(r).build_dataset("train")


def test_the_context_policy_reaches_the_article_builder_and_the_cache_identity():
    from tellkit.encoders.bundle import CaptionInput
    from tellkit.encoders.features import FeatureConfig

    class _Words:
        max_tokens, num_special = 40, 2

        def count_tokens(self, text):
            return len(text.split())

    class WordBundle(EncoderBundle):
        article_encoder = property(lambda self: _Words())

    inp = CaptionInput("x", title="Title", paragraphs=[f"paragraph {i} " + "word " * 8 for i in range(10)])
    texts = {p: WordBundle(None, ("article",), context_mode="first_tokens", context_policy=p).context_text(inp)
             for p in ("reference", "cut")}
    assert texts["reference"].startswith("Title\n\nparagraph 0") and texts["cut"].startswith("Title\nparagraph 0")
    assert len(texts["cut"].split()) <= 38 < len(texts["reference"].split())  # cut to the budget / cut by the encoder
    with pytest.raises(TellkitError, match="context_policy"):
        WordBundle(None, ("article",), context_policy="all")
    assert FeatureConfig(article=True, context_policy="cut").identity()["context_policy"] == "cut"
    assert "context_policy" not in FeatureConfig(article=False).identity()  # image-only caches stay valid


def test_generation_config_is_read_once_and_overridden_by_flags():
    gen = CaptionGeneration.from_section({"beam_size": 3, "max_len": 9, "metrics": ["bleu"], "ner": False})
    assert gen == CaptionGeneration(max_len=9, beam_size=3)
    assert gen.updated(beam_size=None, max_len=4) == CaptionGeneration(max_len=4, beam_size=3)
    with pytest.raises(TellkitError, match="max_len"):
        gen.updated(max_len=0)
    with pytest.raises(TellkitError, match="unknown setting"):
        gen.updated(temperature=0.7)


# --- the captioning pipeline ---------------------------------------------------------------------
def test_pipeline_uses_the_checkpoint_generation_settings(tmp_path, monkeypatch):
    model = tiny(["image"])
    model.save_pretrained(tmp_path / "ck", extra={"task": "caption", "eval": {"beam_size": 3, "max_len": 5},
                                                  "data": {"context": "none"}})
    made = []

    def fake(recipe, contexts, **kw):
        made.append(recipe["data"]["context"])
        return FakeBundle(recipe.get("encoders"), contexts)

    monkeypatch.setattr(CaptionProcessor, "recipe_bundle", staticmethod(fake))
    cap = P.CaptioningPipeline.load(tmp_path / "ck")
    assert cap.generation == CaptionGeneration(max_len=5, beam_size=3) and made == ["none"]
    assert P.CaptioningPipeline.load(tmp_path / "ck", beam_size=1).generation.beam_size == 1
    res = cap((Image.new("RGB", (40, 30), "red"), "ignored"))
    assert len(res["tokens"]) <= 5 and (res["grid"]["rows"], res["grid"]["cols"]) == (2, 2)
    assert "objects" not in res and res["article_tokens"] == [] and res["faces"] == []

    model.save_pretrained(tmp_path / "typo", extra={"task": "caption", "eval": {"beam": 3}})
    with pytest.raises(TellkitError, match="eval: unknown key"):
        P.CaptioningPipeline.load(tmp_path / "typo")


def test_a_model_that_reads_objects_says_the_set_is_empty():
    """No object detector ships: a new image gets an empty objects context, and the result and
    the model info say so."""
    model = tiny(["image", "objects"], object_dim=2048)
    cap = P.CaptioningPipeline(model, CaptionProcessor(FakeBundle(None, ("image", "objects"))))
    res = cap([Image.new("RGB", (32, 32), "blue"), Image.new("RGB", (32, 32))])
    for r in res:
        assert r["objects"]["count"] == 0 and r["objects"]["source"] == "none"
        assert "no object detector" in r["objects"]["note"] and r["tokens"]
        assert all(t["attention"]["objects"] == [] for t in r["tokens"])
    assert "no object detector" in cap.info["objects"]


def test_the_api_and_page_say_the_objects_set_is_empty():
    from fastapi.testclient import TestClient

    from tellkit.server.app import create_app

    model = tiny(["image", "objects"], object_dim=2048)
    cap = P.CaptioningPipeline(model, CaptionProcessor(FakeBundle(None, ("image", "objects"))))
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "blue").save(buf, "PNG")
    with TestClient(create_app({"caption": cap})) as c:
        r = c.post("/api/caption", files={"image": ("a.png", buf.getvalue(), "image/png")})
    assert r.status_code == 200, r.text
    assert r.json()["objects"]["count"] == 0 and "no object detector" in r.json()["objects"]["note"]
    from tellkit.server.app import STATIC_DIR

    assert "res.objects.count === 0" in (STATIC_DIR / "app.js").read_text()  # the page shows the note


def test_the_bundle_must_give_the_model_contexts():
    with pytest.raises(TellkitError, match="does not give the model's context"):
        P.CaptioningPipeline(tiny(["image", "faces"]), CaptionProcessor(FakeBundle(None, ("image",))))
    with pytest.raises(TellkitError, match="image_dim=12"):
        P.CaptioningPipeline(tiny(["image"], image_dim=12), CaptionProcessor(FakeBundle(None, ("image",))))


def test_article_input_splits_paragraphs():
    assert P.article_input("Title\n\nOne\ntwo.\n\n\nThree.").paragraphs == ["Title", "One\ntwo.", "Three."]
    assert P.article_input("one\ntwo\n").paragraphs == ["one", "two"] and P.article_input("  ").paragraphs == []


@pytest.mark.slow
def test_caption_json_reports_the_empty_objects_context(tmp_path, capsys):
    """`tellkit caption --json` with a model that reads objects (real offline image encoder)."""
    from tellkit.cli import main

    model = tiny(["image", "objects"], image_dim=1280, object_dim=2048)
    model.save_pretrained(tmp_path / "ck", extra={"task": "caption", "encoders": {"image": "mobilenet_v2"}})
    assert main(["caption", str(DEMO / "coffee.jpg"), "--model", str(tmp_path / "ck"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objects"]["count"] == 0 and "no object detector" in out["objects"]["note"]
    assert "no object detector" in out["model"]["objects"]
    assert main(["caption", str(DEMO / "coffee.jpg"), "--model", str(tmp_path / "ck")]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == out["text"] and "no object detector" in printed.err


def test_faces_of_a_large_photo_are_detected_on_a_bounded_copy():
    """Inference bounds face detection at FACE_DETECT_MAX_SIDE: a larger photo is searched on a
    shrunk copy (boxes mapped back, crops cut from the full image); a photo no larger gives the
    very same result as before, and training / the feature cache detect on the image as given."""
    import numpy as np

    from tellkit.encoders.faces import FaceEncoder
    from tellkit.encoders.preprocess import load_image

    assert P.FACE_DETECT_MAX_SIDE == 1600 and EncoderBundle().face_max_side is None
    enc = FaceEncoder()
    seen = []
    detect = enc.detector.detect
    enc.detector.detect = lambda im: seen.append(im.size) or detect(im)
    photo = load_image(DEMO / "astronaut.jpg")  # 384 x 384, Eileen Collins' face
    plain, bounded = enc.detect_and_embed(photo), enc.detect_and_embed(photo, max_side=1600)
    assert all(torch.equal(plain[k], bounded[k]) for k in plain) and seen == [(384, 384)] * 2
    big = photo.resize((1152, 1152), Image.BILINEAR)  # 3x; searched at 576 px (a smaller bound keeps this fast)
    seen.clear()
    out = enc.detect_and_embed(big, max_side=576)
    assert seen == [(576, 576)] and out["boxes"].shape == (1, 4)
    np.testing.assert_allclose(out["boxes"][0].numpy() / 3, plain["boxes"][0].numpy(), atol=4)
    assert float(out["embeddings"][0] @ plain["embeddings"][0]) > 0.8  # the same face, cut from the full image

    class Faces:
        def detect_and_embed(self, pil, max_side=None):
            seen.append(max_side)
            return {"embeddings": torch.zeros(0, 512), "boxes": torch.zeros(0, 4), "probs": torch.zeros(0)}

    class Bundle(FakeBundle):
        face_encoder = property(lambda self: Faces())

    seen.clear()
    Bundle(None, ("image", "faces"), face_max_side=P.FACE_DETECT_MAX_SIDE).encode([P.article_input("", big)])
    assert seen == [1600]


# --- dtype: bfloat16 autocast where the device has it ----------------------------------------------
def test_dtype_bf16_runs_the_search_in_autocast_or_says_why_not(tmp_path, monkeypatch, capsys):
    """dtype="bf16": encode and search in bfloat16 autocast (weights stay float32) where the CPU
    computes bf16 natively; elsewhere float32 and a note in ``info`` (and on the command's
    stderr). The scores stay float32 (log-softmax in float32)."""
    import tellkit
    from tellkit.cli import main
    from tellkit.pipelines.recognition import SAMPLE_INKML
    from tellkit.registry import create_model
    from tellkit.utils import precision

    torch.manual_seed(0)
    create_model("bttr/tiny").save_pretrained(tmp_path / "bttr", extra={"eval": {"beam_size": 2, "max_len": 6}})
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    pipe = tellkit.pipeline("recognize", tmp_path / "bttr", dtype="bf16")
    seen = []
    generate = pipe.model.generate

    def watched(*a, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        out = generate(*a, **kw)
        seen.append(out["scores"][0].dtype if torch.is_tensor(out["scores"][0]) else type(out["scores"][0]))
        return out

    monkeypatch.setattr(pipe.model, "generate", watched)
    res = pipe(str(SAMPLE_INKML))
    assert pipe.info["dtype"] == "bfloat16" and "dtype_note" not in pipe.info
    assert seen[0] == (True, torch.bfloat16) and seen[1] in (float, torch.float32) and isinstance(res["score"], float)
    assert all(p.dtype == torch.float32 for p in pipe.model.parameters())

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    plain = tellkit.pipeline("recognize", tmp_path / "bttr", dtype="bf16")
    assert plain.info["dtype"] == "float32" and "no native bfloat16" in plain.info["dtype_note"]
    assert main(["recognize", str(SAMPLE_INKML), "--model", str(tmp_path / "bttr"), "--dtype", "bf16"]) == 0
    assert "note: this CPU has no native bfloat16" in capsys.readouterr().err
    with pytest.raises(TellkitError, match="dtype"):
        tellkit.pipeline("recognize", tmp_path / "bttr", dtype="int8")
    with pytest.raises(TellkitError, match="unknown option.*temperature"):
        tellkit.pipeline("recognize", tmp_path / "bttr", temperature=0.5)
    with pytest.raises(TellkitError, match="unknown task 'recognise'.*did you mean 'recognize'"):
        tellkit.pipeline("recognise")


def test_evaluate_with_dtype_writes_under_runs_and_names_the_dtype(tmp_path, monkeypatch, capsys):
    """`tellkit evaluate CHECKPOINT --dtype bf16` on a checkpoint that is not part of a run writes
    under ./runs/eval/<name> (never beside the checkpoint), and its summary says which dtype ran."""
    from tellkit.cli import main
    from tellkit.registry import create_model
    from tellkit.utils import precision

    sample = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "samples" / "bttr_x2_plus_1.inkml"
    (tmp_path / "data" / "test" / "2014").mkdir(parents=True)
    (tmp_path / "data" / "test" / "2014" / "e0.inkml").write_text(sample.read_text())  # it holds its truth
    torch.manual_seed(0)
    ckpt = tmp_path / "models" / "bttr"
    extra = {"task": "recognize", "eval": {"beam_size": 2, "max_len": 6}, "data": {"cache": None}}
    create_model("bttr/tiny").save_pretrained(ckpt, extra=extra)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert main(["evaluate", str(ckpt), "--data", str(tmp_path / "data"), "--dtype", "bf16", "--device", "cpu",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["dtype"] == "float32" and "no native bfloat16" in captured.err
    summary = tmp_path / "runs" / "eval" / "bttr" / "metrics_test.json"
    assert Path(report["summary"]).resolve() == summary and not (ckpt / "eval").exists()
    assert "no native bfloat16" in json.loads(summary.read_text())["dtype_note"]


def test_feature_extraction_picks_its_device_like_every_command():
    """FeatureConfig.device None goes through the one resolver (the GPU when present, else the CPU)."""
    import torch

    from tellkit.encoders.features import FeatureConfig, _bundle
    from tellkit.utils.precision import resolve_device

    assert FeatureConfig().device is None
    assert _bundle(FeatureConfig()).device == resolve_device(None)
    assert _bundle(FeatureConfig(device="cpu")).device == torch.device("cpu")
    assert "device" not in FeatureConfig().identity()
