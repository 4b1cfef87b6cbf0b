"""`tellkit features`: shards on disk, skipped unreadable images, resumption, the reader."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from tellkit.cli import main
from tellkit.encoders import features as FT
from tellkit.encoders.features import FeatureStore

skdata = pytest.importorskip("skimage.data")
FIX = Path(__file__).parent / "fixtures"


@pytest.fixture()
def image_dir(tmp_path):
    """Five real photos (small, to keep the test fast), one non-image, one truncated JPEG."""
    d = tmp_path / "imgs"
    (d / "sub").mkdir(parents=True)
    for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg"):
        img = Image.open(os.path.join(skdata.data_dir, name)).convert("RGB")
        img.resize((img.width // 2, img.height // 2)).save(d / f"{Path(name).stem}.jpg", quality=90)
    Image.open(os.path.join(skdata.data_dir, "camera.png")).resize((256, 256)).save(d / "sub" / "camera.png")
    (d / "notes.jpg").write_text("not an image")
    data = (d / "rocket.jpg").read_bytes()
    (d / "broken.jpg").write_bytes(data[: len(data) // 3])
    return d


def _run(*argv) -> int:
    return main(["features", *map(str, argv), "--no-progress", "--shard-size", "3", "--batch-size", "2"])


def test_folder_to_shards_with_skips(image_dir, tmp_path, capsys):
    out = tmp_path / "feats"
    assert _run(out, "--images", image_dir) == 0
    printed = capsys.readouterr()
    assert "features: 5 of 7 images" in printed.out
    assert "skipped: 2 (1 corrupt or truncated, 1 not an image)" in printed.out
    assert "skipped broken" in printed.err and "skipped notes" in printed.err
    summary = json.loads((out / "features.json").read_text())["summary"]
    assert summary["skipped_by_reason"] == {"corrupt or truncated": 1, "not an image": 1}
    shards = ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    assert sorted(p.name for p in out.glob("shard-*")) == shards

    store = FeatureStore(out)
    assert sorted(store.ids) == ["astronaut", "chelsea", "coffee", "rocket", "sub/camera"]
    assert {s["id"] for s in store.skipped} == {"broken", "notes"}
    x = store["astronaut"]
    assert x["image"].shape == (49, 1280) and x["image_mask"].all()
    assert x["faces"].shape == (1, 512) and x["face_boxes"].shape == (1, 4)
    assert store["coffee"]["faces"].shape == (0, 512)
    # stored grids are the encoder's output (float16 storage)
    from tellkit.encoders.image import build_image_encoder
    from tellkit.encoders.preprocess import load_image

    direct, _ = build_image_encoder().encode([load_image(image_dir / "chelsea.jpg")])
    assert torch.allclose(store["chelsea"]["image"], direct[0], atol=2e-2, rtol=1e-2)


def test_interrupted_run_resumes(image_dir, tmp_path, monkeypatch, capsys):
    clean = tmp_path / "clean"
    assert _run(clean, "--images", image_dir, "--no-faces") == 0
    out = tmp_path / "resumed"
    real = FT._encode_shard
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(FT, "_encode_shard", flaky)
    assert _run(out, "--images", image_dir, "--no-faces") == 130  # interrupted
    assert [p.name for p in out.glob("shard-*.safetensors")] == ["shard-00000.safetensors"]
    monkeypatch.setattr(FT, "_encode_shard", real)
    (out / "shard-00001.tmp").write_bytes(b"half-written garbage")  # left by a killed process
    capsys.readouterr()
    assert _run(out, "--images", image_dir, "--no-faces") == 0
    summary = json.loads((out / "features.json").read_text())["summary"]
    assert (summary["shards_reused"], summary["shards_written"]) == (1, 2)
    a, b = FeatureStore(clean), FeatureStore(out)
    assert sorted(a.ids) == sorted(b.ids)
    for i in a.ids:
        assert torch.equal(a[i]["image"], b[i]["image"])
    # a different configuration in the same folder is refused, unless --overwrite
    assert _run(out, "--images", image_dir, "--no-faces", "--dtype", "float32") == 2
    assert "another configuration" in capsys.readouterr().err
    assert _run(out, "--images", image_dir, "--no-faces", "--dtype", "float32", "--overwrite") == 0


def test_dataset_with_article_states_and_copy_ids(tmp_path):
    out = tmp_path / "nyt"
    assert _run(out, "--format", "nytimes800k", "--root", FIX / "nytimes" / "nytimes_tiny.archive.gz",
                "--article", "--no-faces") == 0
    store = FeatureStore(out)
    assert len(store) == 3
    from tellkit.encoders.tokenizer import CaptionTokenizer

    cap = CaptionTokenizer.load()
    for _, x in store.items():
        n_layers, L, D = x["article"].shape
        assert (n_layers, D) == (7, 384) and x["article_mask"].shape == (L,) == x["article_ids"].shape
        assert x["article_ids"][0] == -1 and x["article_ids"][-1] == -1  # [CLS], [SEP]
        text = cap.decode([i for i in x["article_ids"].tolist() if i >= 0])
        assert len(text.split()) > 5


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert _run(tmp_path / "o", "--images", tmp_path / "missing") == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert _run(tmp_path / "o", "--images", tmp_path / "empty") == 2
    assert "no images found" in capsys.readouterr().err
    assert _run(tmp_path / "o", "--format", "goodnews") == 2
    assert "--root" in capsys.readouterr().err


def test_static_word_vectors_go_through_the_feature_cache(tmp_path):
    """`--article-encoder static`: one layer of fixed 384-d vectors, unknown words dropped, no
    special tokens; every stored vector is the table's row of the kept word."""
    from tellkit.encoders.static_vectors import load_article_vectors

    out = tmp_path / "nyt_static"
    assert _run(out, "--format", "nytimes800k", "--root", FIX / "nytimes" / "nytimes_tiny.archive.gz",
                "--article", "--article-encoder", "static", "--no-faces") == 0
    store = FeatureStore(out)
    table = load_article_vectors("static")
    assert len(store) == 3
    for _, x in store.items():
        n_layers, L, D = x["article"].shape
        assert (n_layers, D) == (1, 384) and L > 5
        # each stored state is a row of the table (float16 storage)
        dist = torch.cdist(x["article"][0].float(), table.vectors.half().float())  # [L, V]
        assert dist.min(-1).values.max() < 1e-2  # exact rows, up to cdist rounding
        assert (x["article_ids"] >= 0).float().mean() > 0.9  # whole words: nearly all have a caption piece


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("tellkit features: error:"), err
    return err


def test_binary_image_list_and_an_out_that_is_a_file_are_one_line_errors(image_dir, tmp_path, capsys):
    photo = image_dir / "rocket.jpg"
    assert _run(tmp_path / "o", "--images", photo) == 2  # an image given as the list
    assert "not a text list of image paths" in _one_line(capsys)
    (tmp_path / "list.txt").write_bytes(b"rocket.jpg\n\x00\x01\x02")
    assert _run(tmp_path / "o", "--images", tmp_path / "list.txt") == 2
    assert "binary data at byte 11" in _one_line(capsys)
    (tmp_path / "file").write_text("x")
    assert _run(tmp_path / "file", "--images", image_dir) == 2
    assert "is a file, expected a folder" in _one_line(capsys)
    assert _run(tmp_path / "file" / "sub", "--images", image_dir) == 2
    assert "parent" in _one_line(capsys)
    (tmp_path / "good.txt").write_text(f"{photo}\n", encoding="utf-8")  # a text list still works
    assert _run(tmp_path / "o", "--images", tmp_path / "good.txt", "--no-faces") == 0


def _png_bomb(path, width: int, height: int) -> None:
    """A 70-byte PNG whose header declares width x height RGB pixels."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def test_decompression_bomb_and_refused_formats_are_skipped_before_decoding(tmp_path, capsys):
    """Images go through utils.images.open_image: a small file declaring 9000 x 9000 pixels and an
    EPS file (which PIL would hand to Ghostscript) are skipped with their reason; the rest is encoded."""
    d = tmp_path / "imgs"
    d.mkdir()
    _png_bomb(d / "bomb.png", 9000, 9000)
    assert (d / "bomb.png").stat().st_size < 100
    # an EPS file under a .jpg name
    (d / "page.jpg").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
    Image.new("RGB", (40, 30), (200, 10, 10)).save(d / "ok.png")
    assert _run(tmp_path / "o", "--images", d, "--no-faces") == 0
    out = capsys.readouterr().out
    assert "features: 1 of 3 images" in out
    summary = json.loads((tmp_path / "o" / "features.json").read_text())["summary"]
    assert summary["skipped_by_reason"] == {"too many pixels": 1, "unsupported format": 1}
    assert "decompression-bomb guard" in out and "format EPS is not accepted" in out


def test_goodnews_photos_left_out_for_empty_captions_are_counted(shared_data, tmp_path, capsys):
    """GoodNews keeps no caption-less photo: the 2 of the sample's 12 photos whose caption is empty
    are not encoded, and the summary says so, with the reason, instead of "skipped: 0"."""
    out = tmp_path / "feats"
    assert _run(out, "--format", "goodnews", "--root", shared_data / "goodnews_sample", "--no-faces") == 0
    printed = capsys.readouterr().out
    assert "features: 10 of 12 images" in printed and "skipped: 2 (2 empty caption)" in printed
    summary = json.loads((out / "features.json").read_text())["summary"]
    assert summary["skipped_by_reason"] == {"empty caption": 2} and summary["encoded"] == 10


def test_two_shard_processes_share_one_folder_and_a_later_run_computes_nothing(image_dir, tmp_path):
    """Two `--shard` processes at once on one OUT: disjoint shards that together cover it; the
    unsharded run after them computes nothing. A lock held by a live process keeps its shard from
    everyone else; one left by a dead process on this host is taken over."""
    import subprocess
    import sys

    from tellkit.encoders import shards

    out = tmp_path / "feats"
    cmd = [sys.executable, "-m", "tellkit", "features", str(out), "--images", str(image_dir), "--no-faces",
           "--no-progress", "--shard-size", "1", "--batch-size", "1"]
    procs = [subprocess.Popen([*cmd, "--shard", f"{i}/2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1] for r in results]
    summaries = [json.loads(r[0].strip().splitlines()[-1]) for r in results]
    assert [s["shards_written"] for s in summaries] == [4, 3]  # shards 0,2,4,6 and 1,3,5 (7 images)
    names = sorted(p.name for p in out.glob("shard-*.safetensors"))
    assert names == [f"shard-{k:05d}.safetensors" for k in range(7)] and not list(out.glob("*.lock"))
    assert any(s["complete"] for s in summaries)  # whichever finished last saw every shard
    store = FeatureStore(out)
    assert len(store) == 5 and {s["id"] for s in store.skipped} == {"broken", "notes"}

    again = subprocess.run([*cmd], capture_output=True, text=True, timeout=300)
    last = json.loads(again.stdout.strip().splitlines()[-1])
    assert again.returncode == 0 and last["shards_written"] == 0 and last["complete"]
    assert "shards: all 7 present" in again.stdout

    shard = out / "shard-00099.safetensors"
    assert shards.claim(shard) and not shards.claim(shard)  # held by this (live) process
    shards.lock_path(shard).write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": 2**22 + 7}))
    assert shards.claim(shard)  # its process is gone: taken over
    shards.release(shard)
    assert shards.shard_spec(None, {"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    assert shards.shard_spec(None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4",
                                    "SLURM_ARRAY_TASK_MIN": "2"}) == (3, 4)
    assert shards.shard_spec(None, {}) is None and shards.shard_spec("1/4") == (1, 4)
    assert main(["features", str(out), "--images", str(image_dir), "--shard", "4/4"]) == 2
