"""Serving API: good inputs through the tiny untrained models (real offline encoders), every bad
input, oversize bodies/images/articles, wrong types, batching of concurrent requests, timeouts,
a full queue, isolation of a failing input, checkpoint loading and the CLI's refusals."""
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")
from fastapi.testclient import TestClient  # noqa: E402

from tellkit.errors import TellkitError  # noqa: E402
from tellkit.server.app import create_app  # noqa: E402
from tellkit.server.backends import CaptioningPipeline, RecognitionPipeline  # noqa: E402
from tellkit.server.limits import Limits  # noqa: E402
from tellkit.server.runner import ServerThread, free_port, post  # noqa: E402

ARTICLE = "Mayor Anne Hidalgo of Paris opened the new bridge over the Seine on Monday, officials said."


def png(w=96, h=72, mode="RGB", color=None) -> bytes:
    if color is not None:
        im = Image.new(mode, (w, h), color)
    else:
        a = np.linspace(0, 255, w * h * 3, dtype=np.float32).reshape(h, w, 3).astype("uint8")
        im = Image.fromarray(a).convert(mode)
    b = io.BytesIO()
    im.save(b, "PNG")
    return b.getvalue()


def expression_png() -> bytes:
    im = Image.new("RGB", (160, 64), "white")
    d = ImageDraw.Draw(im)
    d.line((20, 32, 70, 32), fill="black", width=4)
    d.line((45, 10, 45, 54), fill="black", width=4)
    d.ellipse((95, 15, 135, 50), outline="black", width=4)
    b = io.BytesIO()
    im.save(b, "PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def backends():
    return CaptioningPipeline.untrained(), RecognitionPipeline.untrained()


@pytest.fixture(scope="module")
def client(backends):
    app = create_app(dict(zip(("caption", "recognize"), backends)),
                     Limits(max_upload_bytes=300_000, max_image_pixels=400_000, max_article_chars=2_000))
    with TestClient(app) as c:
        yield c


# --- good inputs --------------------------------------------------------------------------------
def test_the_page_offers_the_packaged_samples(client):
    index = client.get("/api/samples").json()
    names = [s["name"] for s in index["caption"]]
    assert {"chelsea.jpg", "coffee.jpg", "rocket.jpg"} <= set(names)
    rocket = next(s for s in index["caption"] if s["name"] == "rocket.jpg")
    assert rocket["article"] and "Falcon 9" in rocket["article"]
    assert next(s for s in index["caption"] if s["name"] == "chelsea.jpg")["article"] is None
    r = client.get(rocket["url"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg" and r.content[:2] == b"\xff\xd8"
    math = index["recognize"][0]  # the first of the sample formulas
    assert math["latex"] == "x ^ { 2 } + 1" and len(math["strokes"]) >= 4
    assert all(len(p) == 2 for stroke in math["strokes"] for p in stroke)
    assert client.get(math["url"]).headers["content-type"] == "image/png"
    # a sample is named, never a path
    for bad in ("nope.jpg", "..%2Fapp.py", "%2Fetc%2Fpasswd", "chelsea.txt"):
        r = client.get("/samples/" + bad)
        assert r.status_code == 404 and r.json()["error"] == "not_found", bad


def test_health_says_which_models_and_that_they_are_untrained(client):
    h = client.get("/health").json()
    assert h["status"] == "ok"
    assert h["models"]["caption"]["name"] == "transform_and_tell" and h["models"]["caption"]["trained"] is False
    assert h["models"]["recognize"]["name"] == "bttr" and h["models"]["recognize"]["trained"] is False
    assert h["limits"]["max_upload_bytes"] == 300_000
    assert set(h["workers"]) == {"caption", "recognize"}


def test_openapi_schema_published_and_no_cdn_docs(client):
    schema = client.get("/openapi.json").json()
    assert {"/health", "/api/caption", "/api/recognize"} <= set(schema["paths"])
    for path, model in (("/api/caption", "CaptionResponse"), ("/api/recognize", "RecognizeResponse")):
        responses = schema["paths"][path]["post"]["responses"]
        assert model in json.dumps(responses["200"]) and "ErrorBody" in json.dumps(responses["413"])
        assert {"400", "413", "415", "422", "503", "504"} <= set(responses)
    assert client.get("/docs").status_code == 404  # Swagger UI would load from a CDN
    page = client.get("/")
    assert page.status_code == 200 and "/static/vendor/katex/katex.min.js" in page.text
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    assert client.get("/static/vendor/katex/katex.min.js").status_code == 200


def test_caption_with_article_returns_attention_over_every_context(client):
    r = client.post("/api/caption", files={"image": ("a.png", png(), "image/png")}, data={"article": ARTICLE})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["model"]["trained"] is False
    assert res["tokens"], "the tiny model always emits at least one token (min_len=1)"
    assert res["caption"] == "".join(t["text"] for t in res["tokens"]).strip()
    rows, cols = res["grid"]["rows"], res["grid"]["cols"]
    assert rows * cols == 49  # MobileNetV2 7x7 grid at 224 px
    x0, y0, x1, y1 = res["grid"]["box"]
    assert 0 <= x0 < x1 <= 96 + 0.5 and 0 <= y0 < y1 <= 72 + 0.5
    assert res["article_text"] == ARTICLE
    words = [t for t in res["article_tokens"] if t["end"] > t["start"]]
    assert [ARTICLE[t["start"]:t["end"]].lower() for t in words[:3]] == ["mayor", "anne", "hidalgo"]
    for tok in res["tokens"]:
        att = tok["attention"]
        assert len(att["image"]) == rows * cols
        assert len(att["article"]) == len(res["article_tokens"])
        assert len(att["faces"]) == len(res["faces"])
        for name in ("image", "article"):
            # a zero-attention slot takes part of the mass, so each sums to at most 1
            assert all(w >= 0 for w in att[name]) and 0 < sum(att[name]) <= 1 + 1e-3


def test_caption_without_article_and_jpeg(client):
    im = Image.open(io.BytesIO(png(80, 120))).convert("RGB")
    b = io.BytesIO()
    im.save(b, "JPEG")
    r = client.post("/api/caption", files={"image": ("a.jpg", b.getvalue(), "image/jpeg")})
    assert r.status_code == 200, r.text
    assert r.json()["article_text"] == "" and r.json()["image_size"] == [80, 120]


def test_recognize_returns_latex(client):
    r = client.post("/api/recognize", files={"image": ("e.png", expression_png(), "image/png")})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["latex"] == " ".join(res["tokens"]) and res["tokens"]
    assert res["model"]["name"] == "bttr"


def test_recognize_strokes_uses_the_inkml_renderer(client, backends, tmp_path):
    """The drawing pad sends pen strokes; they are rendered like the InkML training data, so the
    answer equals recognising an InkML file with the same strokes."""
    import json

    strokes = [[[10, 10], [30, 40]], [[30, 10], [10, 40]], [[35, 5], [40, 2], [44, 5], [35, 15], [45, 15]]]
    r = client.post("/api/recognize", data={"strokes": json.dumps(strokes)})
    assert r.status_code == 200, r.text
    traces = "".join(f"<trace>{', '.join(f'{x} {y}' for x, y in s)}</trace>" for s in strokes)
    f = tmp_path / "e.inkml"
    f.write_text(f'<ink xmlns="http://www.w3.org/2003/InkML">{traces}</ink>')
    want = backends[1](f)  # the same search, runaway stop included (the model's generation setting)
    assert r.json()["tokens"] == want["tokens"] and r.json()["resized_from"] is None


@pytest.mark.parametrize("strokes, with_image, code", [
    ("not json", False, "bad_input"), ("[]", False, "bad_input"), ('[[[1, "a"]]]', False, "bad_input"),
    ("[[[1, 2]]]", True, "invalid_request"), (None, False, "invalid_request")])
def test_recognize_refuses_bad_strokes(client, strokes, with_image, code):
    files = {"image": ("e.png", expression_png(), "image/png")} if with_image else None
    data = {"strokes": strokes} if strokes is not None else None
    _err(client.post("/api/recognize", data=data, files=files), 422, code)


# --- bad inputs ---------------------------------------------------------------------------------
def _err(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"] == code and body["detail"], body
    return body


@pytest.mark.parametrize("endpoint", ["/api/caption", "/api/recognize"])
def test_bad_files(client, endpoint):
    _err(client.post(endpoint, files={"image": ("a.txt", b"hello", "text/plain")}), 415, "unsupported_media_type")
    _err(client.post(endpoint, files={"image": ("a.png", b"not a png at all", "image/png")}), 415, "not_an_image")
    _err(client.post(endpoint, files={"image": ("a.png", b"", "image/png")}), 400, "empty_file")
    _err(client.post(endpoint, files={"image": ("a.png", png()[:200], "image/png")}), 400, "corrupt_image")
    tiff = io.BytesIO()
    Image.new("RGB", (32, 32), "white").save(tiff, "TIFF")
    _err(client.post(endpoint, files={"image": ("a.tif", tiff.getvalue(), "image/tiff")}), 415,
         "unsupported_image_format")
    _err(client.post(endpoint, files={"image": ("a.png", png(4, 4), "image/png")}), 422, "image_too_small")
    _err(client.post(endpoint, data={"article": "no image"}), 422, "invalid_request")


def test_oversize(client):
    # pixels: a 1000x1000 white PNG is a few KiB on the wire but over the 400,000-pixel cap
    body = _err(client.post("/api/caption", files={"image": ("big.png", png(1000, 1000, color="white"), "image/png")}),
                413, "image_too_large")
    assert "400,000" in body["detail"]
    # body bytes, announced by Content-Length
    _err(client.post("/api/caption", files={"image": ("a.png", b"\x89PNG" + b"0" * 400_000, "image/png")}),
         413, "request_too_large")
    # body bytes, streamed without Content-Length (chunked)
    from tellkit.server.runner import encode_multipart

    data, ctype = encode_multipart(files={"image": ("a.png", b"0" * 400_000, "image/png")})
    r = client.post("/api/caption", content=iter([data[i:i + 65536] for i in range(0, len(data), 65536)]),
                    headers={"Content-Type": ctype})
    _err(r, 413, "request_too_large")
    # article length
    _err(client.post("/api/caption", files={"image": ("a.png", png(), "image/png")}, data={"article": "x" * 2001}),
         413, "article_too_long")
    _err(client.post("/api/caption", files={"image": ("a.png", png(), "image/png")}, data={"article": "a\x00b"}),
         422, "bad_article")


def test_blank_expression_is_a_clear_422(client):
    body = _err(client.post("/api/recognize", files={"image": ("b.png", png(120, 60, color="white"), "image/png")}),
                422, "bad_input")
    assert "no ink" in body["detail"]


def test_unknown_route_and_method(client):
    _err(client.get("/api/nothing"), 404, "not_found")
    _err(client.get("/api/caption"), 405, "method_not_allowed")


def test_model_not_loaded_is_503(backends):
    with TestClient(create_app({"recognize": backends[1]}, serve_page=False)) as c:
        assert c.get("/health").json()["models"]["caption"] is None
        _err(c.post("/api/caption", files={"image": ("a.png", png(), "image/png")}), 503, "model_not_loaded")


# --- batching, timeouts, queue, isolation (a controllable backend over a real socket) -------------
class SlowEcho:
    """Records the size of every group it is called with; 'fail' images raise a user error."""

    def __init__(self, delay=0.3):
        self.delay, self.calls = delay, []
        self.info = {"name": "slow-echo", "trained": False, "checkpoint": None}

    task, api_text = "recognize", "latex"

    def __call__(self, images):
        self.calls.append(len(images))
        time.sleep(self.delay)
        if any(im.width == 77 for im in images):
            raise TellkitError("an image 77 pixels wide is refused by this test backend")
        return [{"text": f"w {im.width}", "tokens": ["w", str(im.width)], "score": 0.0} for im in images]


def _concurrently(fn, n):
    out = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_concurrent_requests_share_forward_passes():
    be = SlowEcho(delay=0.4)
    app = create_app({"recognize": be}, max_batch=8, max_wait_ms=50, serve_page=False)
    with ServerThread(app) as srv:
        res = _concurrently(lambda i: post(srv.url + "/api/recognize",
                                           files={"image": ("x.png", png(40 + i, 30), "image/png")}), 6)
        stats = json.loads(urllib.request.urlopen(srv.url + "/health").read())["workers"]["recognize"]
    assert [s for s, _ in res] == [200] * 6
    assert sorted(b["latex"] for _, b in res) == sorted(f"w {40 + i}" for i in range(6))  # each got its own answer
    assert sum(be.calls) == 6 and len(be.calls) < 6, be.calls
    assert stats["max_batch_seen"] == max(be.calls) > 1 and stats["items"] == 6


def test_one_bad_input_does_not_fail_its_batch():
    be = SlowEcho(delay=0.2)
    app = create_app({"recognize": be}, max_batch=4, max_wait_ms=100, serve_page=False)
    with ServerThread(app) as srv:
        res = _concurrently(lambda i: post(srv.url + "/api/recognize",
                                           files={"image": ("x.png", png(77 if i == 1 else 50, 30), "image/png")}), 3)
    codes = [s for s, _ in res]
    assert codes[1] == 422 and "77 pixels" in res[1][1]["detail"]
    assert codes[0] == codes[2] == 200


def test_timeout_is_504_and_queue_full_is_503():
    be = SlowEcho(delay=1.0)
    app = create_app({"recognize": be}, Limits(request_timeout_s=0.3, max_queue=1), max_batch=1, max_wait_ms=0,
                     serve_page=False)
    with ServerThread(app) as srv:
        s, b = post(srv.url + "/api/recognize", files={"image": ("x.png", png(), "image/png")})
        assert (s, b["error"]) == (504, "timeout")
        time.sleep(1.0)  # let the worker finish the abandoned item
        res = _concurrently(
            lambda i: post(srv.url + "/api/recognize", files={"image": ("x.png", png(), "image/png")}), 4)
        codes = sorted(s for s, _ in res)
        assert 503 in codes and all(c in (503, 504) for c in codes), res
        assert any(b["error"] == "busy" for s, b in res if s == 503)


# --- checkpoints: only the configured ones; trained or not is reported -----------------------------
def test_load_checkpoints_reports_trained_state(tmp_path, backends, monkeypatch):
    from tellkit.checkpoint import save_model
    from tellkit.tasks.captioning import CaptionProcessor

    cap, _ = backends
    save_model(cap.model, tmp_path / "tat", extra={"task": "caption", "train": {"lr": 1e-3}})
    # reuse the loaded encoders
    monkeypatch.setattr(CaptionProcessor, "recipe_bundle", staticmethod(lambda *a, **kw: cap.processor.bundle))
    loaded = CaptioningPipeline.load(tmp_path / "tat")
    assert loaded.info["trained"] is True and loaded.info["checkpoint"] == str(tmp_path / "tat")
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), cap.model.state_dict().values()))

    # a run folder from the training loop: checkpoints/best -> step_N with trainer_state.json
    step = tmp_path / "run" / "checkpoints" / "step_00000007"
    save_model(cap.model, step, extra={"task": "caption", "train": {"lr": 1e-3}})
    (step / "trainer_state.json").write_text(json.dumps({"step": 7, "best": 3.5, "best_step": 7}))
    os.symlink("step_00000007", tmp_path / "run" / "checkpoints" / "best")
    run = CaptioningPipeline.load(tmp_path / "run")
    assert run.info["checkpoint"].endswith("checkpoints/best") and run.info["train_steps"] == 7

    from tellkit.registry import create_model

    bad = create_model("tat/tiny", image_dim=16, article_dim=384, article_layers=7, contexts=["image", "article"])
    save_model(bad, tmp_path / "bad")
    with pytest.raises(TellkitError, match="image_dim=16"):
        CaptioningPipeline.load(tmp_path / "bad")

    bttr = create_model("bttr/tiny")
    save_model(bttr, tmp_path / "bttr")
    rec = RecognitionPipeline.load(tmp_path / "bttr")
    assert rec.info["trained"] is False and rec.info["checkpoint"] == str(tmp_path / "bttr")
    with pytest.raises(TellkitError, match="holds a 'bttr' model, not one for 'caption'"):
        CaptioningPipeline.load(tmp_path / "bttr")
    with pytest.raises(TellkitError, match="the caption endpoint serves a 'caption' model, not a 'recognize' one"):
        create_app({"caption": rec}, serve_page=False)


def test_request_cannot_choose_a_checkpoint(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    bodies = {k: set(v.get("properties", {})) for k, v in schemas.items() if k.startswith("Body_")}
    assert len(bodies) == 2 and set().union(*bodies.values()) == {"image", "article", "strokes"}, bodies


# --- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, msg", [
    (["--checkpoint", "weights=/tmp"], "expected caption or recognize, got 'weights'"),
    (["--checkpoint", "recognize=/tmp", "--checkpoint", "recognize=/tmp"], "given twice"),
    (["--models", "recognize", "--checkpoint", "caption=/tmp"], "not in --models"),
    (["--checkpoint", "recognize=/nonexistent/dir"], "not a directory"),
    (["--models", "video"], "--models"),
    (["--max-batch", "0"], "--max-batch"),
])
def test_cli_refusals_are_one_line(argv, msg, capsys):
    from tellkit.cli import main

    assert main(["serve", "--api-only", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_cli_plan_checkpoints_defaults_and_untrained(tmp_path, monkeypatch):
    import argparse

    from tellkit import recipes
    from tellkit.cli import cmd_serve

    def args(*argv):
        p = argparse.ArgumentParser()
        cmd_serve.add_arguments(p)
        return p.parse_args(list(argv))

    monkeypatch.setitem(recipes.PACKAGED_DEFAULTS, "caption", tmp_path / "no_caption_default")
    monkeypatch.setitem(recipes.PACKAGED_DEFAULTS, "recognize", tmp_path / "math_default")
    (tmp_path / "math_default").mkdir()
    (tmp_path / "math_default" / "model.safetensors").write_bytes(b"")
    with pytest.raises(TellkitError, match="no caption checkpoint"):
        cmd_serve.plan(args())
    assert cmd_serve.plan(args("--models", "recognize")) == {"recognize": str(tmp_path / "math_default")}
    assert cmd_serve.plan(args("--untrained")) == {"caption": None, "recognize": None}
    assert cmd_serve.plan(args("--untrained", "--checkpoint", f"recognize={tmp_path}")) == {
        "caption": None, "recognize": str(tmp_path)}
    assert cmd_serve.plan(args("--checkpoint", f"caption={tmp_path}")) == {
        "caption": str(tmp_path), "recognize": str(tmp_path / "math_default")}
    # the former name of the task, still read
    assert cmd_serve.plan(args("--models", "math", "--model", f"math={tmp_path}")) == {"recognize": str(tmp_path)}


def test_cli_serves_on_localhost_by_default():
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tellkit", "serve", "--untrained", "--models", "recognize",
                             "--port", str(port)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read())
                break
            except OSError:
                time.sleep(0.3)
        assert health is not None, proc.stderr.read() if proc.poll() is not None else "no answer in 60 s"
        assert health["models"]["caption"] is None and health["models"]["recognize"]["trained"] is False
        s, b = post(f"http://127.0.0.1:{port}/api/recognize", files={"image": ("e.png", expression_png(), "image/png")})
        assert s == 200 and b["latex"]
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=15)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[1]
    assert "UNTRAINED" in out and f"http://127.0.0.1:{port}/" in out


def test_load_benchmark_counts_requests_errors_and_percentiles():
    from tellkit.bench.serve_load import _inputs, _percentiles, load_once

    assert _percentiles([0.1, 0.2, 0.3, 0.4]) == {"p50_ms": 200.0, "p90_ms": 400.0, "p99_ms": 400.0,
                                                  "max_ms": 400.0, "mean_ms": 250.0}
    photos, math = _inputs()
    app = create_app({"recognize": SlowEcho(delay=0.01)}, serve_page=False)  # no captioner: caption requests fail (503)
    with ServerThread(app) as srv:
        res = load_once(srv.url, 6, 3, photos, math)
        assert res["requests"] == 6 and res["recognize"]["ok"] == 3 and res["caption"]["ok"] == 0
        assert res["errors"] == 3 and res["error_examples"][0]["status"] == 503
        res = load_once(srv.url, 16, 4, photos, math, bad_every=4)  # 4 bad requests, each of BAD_REQUESTS once
    # limits and validation answer before the (missing) captioner is needed
    assert res["bad_requests"] == {"sent": 4, "answered_expected_4xx": 4}


def test_large_images_are_shrunk_and_the_original_size_reported():
    app = create_app({"recognize": SlowEcho(delay=0.0)}, Limits(math_max_side=50), serve_page=False)
    with TestClient(app) as c:
        r = c.post("/api/recognize", files={"image": ("x.png", png(100, 60), "image/png")})
        assert r.status_code == 200 and r.json()["latex"] == "w 50" and r.json()["resized_from"] == [100, 60]
        r = c.post("/api/recognize", files={"image": ("x.png", png(40, 30), "image/png")})
        assert r.json()["latex"] == "w 40" and r.json()["resized_from"] is None


def test_admitted_requests_are_bounded():
    app = create_app({"recognize": SlowEcho(delay=0.5)}, Limits(max_inflight=2), max_batch=1, serve_page=False)
    with ServerThread(app) as srv:
        res = _concurrently(
            lambda i: post(srv.url + "/api/recognize", files={"image": ("x.png", png(), "image/png")}), 5)
    codes = sorted(s for s, _ in res)
    assert codes.count(200) >= 2 and 503 in codes, codes
    assert all(b["error"] == "busy" for s, b in res if s == 503)


def test_article_context_is_built_as_in_training(backends):
    from tellkit.server.backends import article_input

    assert article_input("Title line\n\nFirst  para\ncontinues.\n\n\nSecond.").paragraphs == \
        ["Title line", "First  para\ncontinues.", "Second."]
    assert article_input("one\ntwo\n\n").paragraphs == ["one", "two"]
    assert article_input("   ").paragraphs == []
    cap, _ = backends
    long = "\n\n".join(f"Paragraph {i} tells of the harbour, the mayor and the storm." for i in range(80))
    im = Image.open(io.BytesIO(png())).convert("RGB")
    res = cap([(im, long), (im, "")])
    read, empty = res[0], res[1]
    # cut to the encoder's budget (512 tokens with [CLS]/[SEP]) at a paragraph/word boundary
    assert len(read["article_tokens"]) <= 512 and read["article_tokens"][-1]["text"] == "[SEP]"
    assert 0 < len(read["article_text"]) < len(long) and long.startswith(read["article_text"].split("\n")[0])
    assert empty["article_text"] == "" and [t["text"] for t in empty["article_tokens"]] == ["[CLS]", "[SEP]"]
    # padding the shorter article in the same batch does not leak into its attention
    assert all(len(t["attention"]["article"]) == 2 for t in empty["tokens"])


def test_batched_caption_equals_caption_alone(backends):
    """Sharing a forward pass must not change a request's answer (padding of articles and faces)."""
    from tellkit.encoders.preprocess import load_image

    cap, _ = backends
    demo = os.path.join(os.path.dirname(__file__), "..", "src", "tellkit", "assets", "demo_caption")
    face = load_image(os.path.join(demo, "astronaut.jpg"))
    cat = load_image(os.path.join(demo, "chelsea.jpg"))
    article = open(os.path.join(demo, "astronaut.txt"), encoding="utf-8").read()
    alone = cap((cat, "A cat."))
    together = cap([(face, article), (cat, "A cat.")])
    assert len(together[0]["faces"]) == 1 and together[1]["faces"] == []
    assert together[1]["text"] == alone["text"]
    for a, b in zip(alone["tokens"], together[1]["tokens"]):
        for name in ("image", "article"):
            assert np.allclose(a["attention"][name], b["attention"][name], atol=1e-4)


def test_missing_katex_fails_clearly(tmp_path, monkeypatch):
    import shutil

    from tellkit.server import app as app_module

    for f in ("index.html", "app.js", "style.css"):
        shutil.copy(app_module.STATIC_DIR / f, tmp_path / f)
    monkeypatch.setattr(app_module, "STATIC_DIR", tmp_path)
    with pytest.raises(TellkitError, match="katex.min.js.*make setup"):
        create_app({})
    create_app({}, serve_page=False)  # the API alone does not need it
