"""ONNX export and the ONNX Runtime path (:mod:`tellkit.runtime`): the exported graphs carry the
state in and out as PyTorch's incremental decoding does, the same searches driven over them give
PyTorch's answers (tiny models; the packaged models on a few real inputs), the commands take
``--runtime onnx`` and ``tellkit export --format onnx``, and a missing extra is named."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tellkit.errors import TellkitError

pytest.importorskip("onnxruntime")

SRC = Path(__file__).resolve().parents[1] / "src" / "tellkit"
SAMPLES = SRC / "assets" / "samples"
DEMO = SRC / "assets" / "demo_caption"
INKML = sorted(SAMPLES.glob("*.inkml"))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TELLKIT_CACHE", str(tmp_path / "cache"))


def tiny_bttr(folder: Path, seed: int = 0) -> Path:
    from tellkit.registry import create_model

    torch.manual_seed(seed)
    extra = {"task": "recognize", "eval": {"beam_size": 3, "max_len": 12}, "data": {"cache": None}}
    create_model("bttr/tiny").save_pretrained(folder, extra=extra)
    return folder


def tiny_sat(folder: Path, seed: int = 0) -> Path:
    """A tiny Show, Attend and Tell with the banded input embedding and adaptive softmax of the
    packaged captioner, over the real EfficientNet-Lite0 grid (TF 'same' padding)."""
    from tellkit.registry import create_model

    torch.manual_seed(seed)
    model = create_model("show_attend_tell", image_dim=1280, embed_dim=16, hidden_dim=16, attention_dim=8,
                         adaptive_cutoffs=[5000, 20000], adaptive_input=True, max_len=8)
    with torch.no_grad():  # a readable head: common words likelier, so captions are not all one token
        model.out.adaptive.head_words.mul_(4)
    model.save_pretrained(folder, extra={"task": "caption", "encoders": {"image": "efficientnet_lite0"},
                                         "data": {"context": "none"}, "eval": {"beam_size": 3, "max_len": 8}})
    return folder


# --- the graphs carry the state in and out ---------------------------------------------------------
def test_bttr_step_and_score_graphs_match_pytorch_step_by_step(tmp_path):
    """The step graph, fed its own keys/values back (re-indexed as beams are re-ranked, images
    leaving), gives PyTorch's incremental log-probabilities; the rescoring graph its teacher-forced
    sums; images of three sizes batched with padding give PyTorch's memory."""
    from tellkit.checkpoint import load_model
    from tellkit.export.onnx import export_onnx
    from tellkit.runtime.ort import open_model

    ck = tiny_bttr(tmp_path / "bttr")
    out = export_onnx(ck, tmp_path / "onnx")
    model, ox = load_model(ck).eval(), open_model(out)
    torch.manual_seed(1)
    image = torch.zeros(3, 1, 48, 80)
    mask = torch.zeros(3, 48, 80, dtype=torch.bool)
    for i, (h, w) in enumerate([(48, 80), (33, 47), (48, 80)]):
        image[i, :, :h, :w] = torch.rand(1, h, w)
        mask[i, :h, :w] = True
    with torch.no_grad():
        memory, mmask = model.encode_by_size(image, mask)
    omemory, omask = ox.encode_by_size(image, mask)
    assert torch.equal(mmask, omask) and torch.allclose(memory, omemory, atol=1e-4)

    owner = torch.tensor([0, 0, 1, 2, 2])
    inc, oinc = model.incremental(memory, mmask, owner), ox.incremental(memory, mmask, owner)
    tokens = torch.tensor([[1], [2], [1], [1], [2]])
    for index in ([0, 1, 1, 2, 4], [0, 1, 3, 4], [2, 3]):  # beams re-ranked, image 1 then image 0 leave
        with torch.no_grad():
            lp = inc.step(tokens)
        olp = oinc.step(tokens)
        assert torch.allclose(lp, olp, atol=1e-4), (lp - olp).abs().max()
        index = torch.tensor(index)
        nxt = lp.index_select(0, index).argmax(-1, keepdim=True)
        tokens = torch.cat([tokens.index_select(0, index), nxt], 1)
        inc.reorder(index)
        oinc.reorder(index)

    inputs = torch.tensor([[1, 5, 6, 7], [2, 9, 0, 0], [1, 4, 4, 0]])
    targets = torch.tensor([[5, 6, 7, 2], [9, 1, 0, 0], [4, 4, 2, 0]])
    who = torch.tensor([2, 2, 0])
    with torch.no_grad():
        ref = model.sequence_logprob(inputs, targets, memory, mmask, owner=who)
    assert torch.allclose(ref, ox.sequence_logprob(inputs, targets, memory, mmask, owner=who), atol=1e-4)


def test_sat_graphs_match_pytorch(tmp_path):
    from tellkit.checkpoint import load_model
    from tellkit.export.onnx import export_onnx
    from tellkit.runtime.ort import open_model

    ck = tiny_sat(tmp_path / "sat")
    model, ox = load_model(ck).eval(), open_model(export_onnx(ck, tmp_path / "onnx"))
    torch.manual_seed(2)
    batch = {"image": torch.rand(2, 5, 1280), "image_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).bool()}
    with torch.no_grad():
        s = model.encode(batch)
    o = ox.encode(batch)
    tokens = torch.tensor([0, 0])
    for nxt in ([7, 30000], [6000, 2]):  # every band of the embedding
        with torch.no_grad():
            deep, alpha, s = model.step(tokens, s)
            lp = model.out.log_probs(deep)
        olp, oalpha, o = ox.step(tokens, o)
        assert torch.allclose(lp, olp, atol=1e-4) and torch.allclose(alpha, oalpha, atol=1e-5)
        assert torch.allclose(s["h"], o["h"], atol=1e-5) and torch.allclose(s["c"], o["c"], atol=1e-5)
        tokens = torch.tensor(nxt)


# --- the same answers through the pipelines, the commands and evaluation ----------------------------
def test_bttr_pipeline_on_onnx_gives_pytorchs_answers(tmp_path, capsys):
    """``tellkit export --format onnx`` writes the graphs beside the checkpoint it copies; the
    joint search over them reads InkML files and a bitmap as PyTorch does (text equal, scores
    within float rounding); the commands take --runtime onnx and refuse what it cannot do."""
    import tellkit
    from tellkit.cli import main

    ck = tiny_bttr(tmp_path / "bttr")
    assert main(["export", str(ck), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    assert "ONNX graphs" in capsys.readouterr().out
    meta = json.loads((tmp_path / "onnx" / "config.json").read_text())
    assert meta["task"] == "recognize" and meta["family"] == "bttr" and meta["eval"]["beam_size"] == 3
    assert sorted(meta["onnx"]["graphs"]) == ["encoder", "memory", "score", "step"]
    inputs = [str(p) for p in INKML] + [str(SAMPLES / "bttr_x2_plus_1.png")]
    ref = tellkit.pipeline("recognize", ck)(inputs)
    pipe = tellkit.pipeline("recognize", tmp_path / "onnx", runtime="onnx")
    got = pipe(inputs)
    assert pipe.info["runtime"] == "onnx"
    assert [r["text"] for r in got] == [r["text"] for r in ref]
    assert all(abs(a["score"] - b["score"]) < 1e-4 for a, b in zip(got, ref))

    assert main(["recognize", *inputs[:2], "--model", str(ck), "--runtime", "onnx", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["text"] for x in lines] == [r["text"] for r in ref[:2]]
    for bad, match in ((["--dtype", "bf16"], "float32"), (["--device", "cuda"], "CPU|CUDA")):
        assert main(["recognize", inputs[0], "--model", str(ck), "--runtime", "onnx", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(match, err), err
    with pytest.raises(TellkitError, match="runtime 'tensorrt'"):
        tellkit.pipeline("recognize", ck, runtime="tensorrt")


def test_serve_runtime_onnx_answers_through_onnx_runtime(tmp_path):
    """``tellkit serve --runtime onnx`` loads its models as ``recognize --runtime onnx`` does: the
    server's recognizer runs its ONNX graphs, says so in every answer, and reads a bitmap and a
    drawing as PyTorch does."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    import tellkit
    from tellkit.cli import build_parser
    from tellkit.cli.cmd_serve import load_backends
    from tellkit.server.app import create_app

    ck = tiny_bttr(tmp_path / "bttr")
    args = build_parser().parse_args(["serve", "--models", "recognize", "--model", f"recognize={ck}",
                                      "--runtime", "onnx"])
    served = load_backends(args)
    assert served["recognize"].info["runtime"] == "onnx"
    assert served["recognize"].runner is not served["recognize"].model
    png = (SAMPLES / "bttr_x2_plus_1.png").read_bytes()
    strokes = json.dumps([[[0.0, 0.0], [10.0, 12.0], [20.0, 4.0]], [[30.0, 0.0], [30.0, 20.0]]])
    with TestClient(create_app(served, serve_page=False)) as client:
        by_image = client.post("/api/recognize", files={"image": ("x.png", png, "image/png")})
        by_strokes = client.post("/api/recognize", data={"strokes": strokes})
    assert by_image.status_code == by_strokes.status_code == 200, (by_image.text, by_strokes.text)
    assert by_image.json()["model"]["runtime"] == "onnx"
    on_torch = tellkit.pipeline("recognize", ck)
    assert on_torch.info.get("runtime", "torch") == "torch"
    assert by_image.json()["latex"] == on_torch([str(SAMPLES / "bttr_x2_plus_1.png")])[0]["text"]


def test_a_checkpoint_is_exported_once_into_the_cache(tmp_path, capsys):
    import tellkit

    ck = tiny_bttr(tmp_path / "bttr")
    first = tellkit.pipeline("recognize", ck, runtime="onnx")
    assert "exporting" in capsys.readouterr().err
    second = tellkit.pipeline("recognize", ck, runtime="onnx")
    assert "exporting" not in capsys.readouterr().err
    assert first.info["onnx"] == second.info["onnx"]
    assert Path(first.info["onnx"]).parent == tmp_path / "cache" / "onnx"


def test_evaluate_with_the_onnx_runtime_writes_the_same_predictions(tmp_path, monkeypatch, capsys):
    from tellkit.cli import main

    data = tmp_path / "data" / "test" / "2014"
    data.mkdir(parents=True)
    for p in INKML[:3]:
        (data / p.name).write_text(p.read_text())
    ck = tiny_bttr(tmp_path / "bttr")
    monkeypatch.chdir(tmp_path)
    preds = {}
    for runtime in ("torch", "onnx"):
        out = tmp_path / f"eval_{runtime}"
        assert main(["evaluate", str(ck), "--data", str(tmp_path / "data"), "--runtime", runtime, "--out", str(out),
                     "--no-progress"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report.get("runtime", "torch") == runtime
        preds[runtime] = [json.loads(x) for x in (out / "predictions_test.jsonl").read_text().splitlines()]
    assert [p["prediction"] for p in preds["onnx"]] == [p["prediction"] for p in preds["torch"]]


def test_captioning_pipeline_on_onnx_gives_pytorchs_answers(tmp_path, capsys):
    """The captioner's image encoder, init and step graphs under the project's beam search: the
    same captions, scores and per-token attention as PyTorch on real photos."""
    import tellkit
    from tellkit.cli import main

    ck = tiny_sat(tmp_path / "sat")
    photos = [str(DEMO / n) for n in ("dogs.jpg", "coffee.jpg", "mountain_path.jpg")]
    ref = tellkit.pipeline("caption", ck)(photos)
    pipe = tellkit.pipeline("caption", ck, runtime="onnx")
    assert type(pipe.processor.bundle.image_encoder).__name__ == "OnnxImageEncoder"
    got = pipe(photos)
    assert [r["text"] for r in got] == [r["text"] for r in ref] and any(r["text"] for r in ref)
    for a, b in zip(got, ref):
        assert abs(a["score"] - b["score"]) < 1e-4 and len(a["tokens"]) == len(b["tokens"])
        for ta, tb in zip(a["tokens"], b["tokens"]):
            assert max(abs(x - y) for x, y in zip(ta["attention"]["image"], tb["attention"]["image"])) < 1e-4
    assert main(["caption", photos[0], "--model", str(ck), "--runtime", "onnx"]) == 0
    assert capsys.readouterr().out.strip() == ref[0]["text"]


# --- the extra ------------------------------------------------------------------------------------
def test_a_missing_onnx_extra_is_named(tmp_path, monkeypatch, capsys):
    import importlib

    import tellkit
    from tellkit.cli import main
    from tellkit.errors import MissingExtraError

    real = importlib.import_module

    def without_onnx(name, *a, **kw):
        if name.split(".")[0] in ("onnx", "onnxruntime"):
            raise ImportError(f"No module named '{name}'")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", without_onnx)
    ck = tiny_bttr(tmp_path / "bttr")
    with pytest.raises(MissingExtraError, match=r"tellkit\[onnx\]"):
        tellkit.pipeline("recognize", ck, runtime="onnx")
    assert main(["export", str(ck), "--format", "onnx", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tellkit[onnx]" in err and len(err.splitlines()) == 1


def test_export_refuses_what_it_does_not_cover(tmp_path, capsys):
    from tellkit.cli import main
    from tellkit.registry import create_model

    create_model("configs/bttr/cpu.yaml", growth_rate=4, block_depth=2, stem_channels=8, d_model=32,
                 dim_feedforward=64).save_pretrained(tmp_path / "old", extra={"task": "recognize"})
    assert main(["export", str(tmp_path / "old"), "--format", "onnx", "--out", str(tmp_path / "o")]) == 2
    assert "tellkit 0.1's own (bttr_legacy)" in capsys.readouterr().err
    ck = tiny_bttr(tmp_path / "bttr")
    assert main(["export", str(ck), "--format", "onnx", "--int8", "--out", str(tmp_path / "o")]) == 2
    assert "--format safetensors" in capsys.readouterr().err


# --- the packaged models on a few real inputs -----------------------------------------------------------
@pytest.mark.slow
def test_packaged_models_on_onnx_read_real_inputs_as_pytorch(shared_data):
    """The packaged BTTR on 8 CROHME 2014 test expressions and the packaged captioner on 4
    Flickr8k test photos: the same outputs on both runtimes (the full sets: docs/runtimes.md)."""
    import tellkit

    inkml = sorted((shared_data / "crohme_inkml" / "test" / "2014").glob("*.inkml"))[:8]
    assert len(inkml) == 8
    ref = tellkit.pipeline("recognize")(inkml)
    got = tellkit.pipeline("recognize", runtime="onnx")(inkml)
    assert [r["text"] for r in got] == [r["text"] for r in ref]
    names = (shared_data / "flickr8k" / "Flickr8k_text" / "Flickr_8k.testImages.txt").read_text().split()[:4]
    photos = [shared_data / "flickr8k" / "images" / n for n in names]
    ref = tellkit.pipeline("caption")(photos, details=False)
    got = tellkit.pipeline("caption", runtime="onnx")(photos, details=False)
    assert [r["text"] for r in got] == [r["text"] for r in ref]
