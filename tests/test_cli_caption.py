"""`tellkit caption`: one-line errors for bad input, JSON with faces and attention from a tiny
(untrained) Transform and Tell over the real offline encoders, folders and globs of photos."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tellkit.cli import main

DEMO = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "demo_caption"


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tellkit caption: error:"), err
    return err


def test_bad_inputs_fail_with_one_line(tmp_path, capsys, monkeypatch):
    img = str(DEMO / "astronaut.jpg")
    assert "not found" in one_line_error(capsys, ["caption", str(tmp_path / "nope.jpg")])
    assert "no images in this folder" in one_line_error(capsys, ["caption", str(tmp_path)])
    assert "no file matches" in one_line_error(capsys, ["caption", str(tmp_path / "*.jpg")])
    (tmp_path / "noise.jpg").write_bytes(b"\x00\x01 not an image" * 10)
    assert "not an image" in one_line_error(capsys, ["caption", str(tmp_path / "noise.jpg")])
    data = (DEMO / "astronaut.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    assert "truncated" in one_line_error(capsys, ["caption", str(tmp_path / "cut.jpg")])
    monkeypatch.setenv("TELLKIT_MAX_IMAGE_PIXELS", "10000")
    assert "pixels" in one_line_error(capsys, ["caption", img])
    monkeypatch.delenv("TELLKIT_MAX_IMAGE_PIXELS")
    (tmp_path / "empty.txt").write_text("  \n\n")
    assert "empty" in one_line_error(capsys, ["caption", img, "--article", str(tmp_path / "empty.txt")])
    (tmp_path / "latin1.txt").write_bytes("Caf\xe9 in Paris".encode("latin-1"))
    assert "UTF-8" in one_line_error(capsys, ["caption", img, "--article", str(tmp_path / "latin1.txt")])
    assert "a folder, not a regular file" in one_line_error(capsys, ["caption", img, "--article", str(tmp_path)])
    assert "not found" in one_line_error(capsys, ["caption", img, "--article", str(tmp_path / "x.txt")])
    assert "checkpoint" in one_line_error(capsys, ["caption", img, "--model", str(tmp_path)])


def test_untrusted_images_go_through_the_safe_decoder(tmp_path, capsys):
    """A decompression bomb (a 70-byte PNG declaring 30000 x 30000 pixels) and an EPS file (which
    PIL would hand to Ghostscript) are refused from their header in one line, before any model
    loads; a 16-bit photo is converted without whole-image float64 copies."""
    import struct
    import tracemalloc
    import zlib

    import numpy as np
    from PIL import Image

    from tellkit.encoders.preprocess import load_image

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    assert bomb.stat().st_size < 100
    err = one_line_error(capsys, ["caption", str(bomb)])
    assert "900,000,000 pixels" in err and "decompression-bomb guard" in err
    eps = tmp_path / "photo.jpg"
    eps.write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    assert "format EPS is not accepted" in one_line_error(capsys, ["caption", str(eps)])
    deep = tmp_path / "deep.png"
    Image.fromarray((np.arange(2000 * 2000, dtype=np.uint32) % 65536).astype(np.uint16).reshape(2000, 2000)).save(deep)
    tracemalloc.start()
    try:
        img = load_image(deep)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert img.mode == "RGB" and img.size == (2000, 2000)
    assert peak < 12 * 2**20, f"{peak / 2**20:.0f} MiB of numpy buffers"  # a float64 copy alone is 31 MiB


@pytest.mark.slow
def test_json_with_faces_and_attention(tmp_path, capsys):
    import torch

    from tellkit.registry import create_model

    torch.manual_seed(0)
    model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, face_dim=512, max_len=8)
    ckpt = tmp_path / "ckpt"
    encoders = {"image": "mobilenet_v2", "article": "all-MiniLM-L6-v2", "faces": "facenet_casia"}
    model.save_pretrained(ckpt, extra={"task": "caption", "encoders": encoders})
    argv = ["caption", str(DEMO / "astronaut.jpg"), "--article", str(DEMO / "astronaut.txt"), "--model", str(ckpt)]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["text"], str) and out["tokens"] and out["input"] == str(DEMO / "astronaut.jpg")
    assert len(out["faces"]) >= 1 and len(out["faces"][0]["box"]) == 4  # Eileen Collins' face
    tok = out["tokens"][0]["attention"]
    assert len(tok["image"]) == 49 and len(tok["faces"]) == len(out["faces"])
    assert len(tok["article"]) == len(out["article_tokens"]) > 10
    assert out["article_tokens"][1]["text"] == "eileen"  # MiniLM is uncased; [CLS] first
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == out["text"]


@pytest.mark.slow
def test_default_model_captions_without_a_checkpoint(capsys):
    from tellkit.recipes import PACKAGED_DEFAULTS

    DEFAULT_CHECKPOINT = PACKAGED_DEFAULTS["caption"]

    weights = DEFAULT_CHECKPOINT / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size <= 25 * 2**20
    meta = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
    assert meta["task"] == "caption" and meta["data"]["format"] == "flickr8k"
    assert main(["caption", str(DEMO / "coffee.jpg")]) == 0
    caption = capsys.readouterr().out.strip()
    assert len(caption.split()) >= 3 and caption.endswith(".")  # a trained model writes a sentence


@pytest.mark.slow
def test_a_folder_and_a_glob_answer_for_every_photo_in_batches(tmp_path, capsys):
    """`tellkit caption DIR`: one line per photo of the folder (its other files left alone), the
    same captions as one photo at a time; a glob pattern and the --image / --checkpoint spellings
    name the same photos."""
    from tellkit.cli.answers import sureness_column
    from tellkit.recipes import PACKAGED_DEFAULTS

    photos = sorted(str(p) for p in DEMO.glob("*.jpg"))
    assert main(["caption", str(DEMO), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["input"] for r in rows] == photos and all(r["text"] and r["tokens"] for r in rows)
    assert main(["caption", str(DEMO / "*.jpg"), "--batch-size", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{r['input']}\t{r['text']}\t{sureness_column(r)}" for r in rows]
    assert main(["caption", "--image", photos[1], "--checkpoint", str(PACKAGED_DEFAULTS["caption"])]) == 0
    assert capsys.readouterr().out.strip() == rows[1]["text"]
