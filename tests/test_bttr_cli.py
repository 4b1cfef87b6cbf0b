"""BTTR end to end through the real command line: train a few steps, evaluate, recognise;
ExpRate; the packaged sample and default model; the benchmark function."""
import json

import pytest
from PIL import Image

from tellkit.bench.bttr import SAMPLE_PATH, draw_sample
from tellkit.cli import main
from tellkit.metrics.exprate import breakdown, edit_distance, exprate

LABELS = ["x^2", "a+b", "\\frac 1 2", "y_1", "x^2", "a+b", "\\frac 1 2", "y_1"]


def _dataset(root):
    (root / "train" / "S").mkdir(parents=True)
    lines = []
    for i, lab in enumerate(LABELS):
        strokes = [[(0, 0), (10 + 5 * (i % 4), 20)], [(0, 20), (10, i % 4)]]
        from tellkit.data.crohme import render_square

        render_square(strokes).save(root / "train" / "S" / f"e{i}.png")
        lines.append(f"S/e{i}\t{lab}")
    (root / "groundtruth_train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_exprate():
    assert edit_distance(list("abc"), list("abd")) == 1 and edit_distance([], list("ab")) == 2
    r = exprate([["a", "b"], ["a"], ["x", "y", "z"]], [["a", "b"], ["a", "c"], ["a", "b", "c"]])
    assert r["exprate"] == pytest.approx(100 / 3) and r["exprate_le1"] == pytest.approx(200 / 3)
    assert r["exprate_le2"] == pytest.approx(200 / 3) and r["n"] == 3


def test_breakdown_by_length_and_structure():
    long_ref = ["x", "_", "{", "1", "}"] * 7  # 35 tokens, with scripts
    frac = ["\\frac", "{", "a", "}", "{", "b", "}"]  # 7 tokens
    root = ["\\sqrt", "{", "x", "}"] + ["+", "y"] * 4  # 12 tokens
    refs = [frac, frac, root, long_ref, long_ref + ["+", "1"] * 3, ["a"] * 20]
    hyps = [frac, frac[:-1], root, long_ref[:20], long_ref + ["+", "1"] * 3, ["a"] * 20]
    t = breakdown(hyps, refs)
    n = {k: v["n"] for k, v in t["by_length"].items()}
    assert n == {"0-9": 2, "10-19": 1, "20-29": 1, "30-39": 1, "40+": 1}
    assert t["by_length"]["0-9"]["exprate"] == 50.0 and t["by_length"]["0-9"]["exprate_le1"] == 100.0
    assert t["by_length"]["0-9"]["length_ratio"] == pytest.approx(13 / 14)
    b30 = t["by_length"]["30-39"]
    assert b30["exprate"] == 0.0 and b30["length_ratio"] == pytest.approx(20 / 35)
    assert t["by_length"]["40+"]["exprate"] == 100.0 and t["by_length"]["40+"]["length_ratio"] == 1.0
    assert t["long"]["n"] == 2 and t["long"]["exprate"] == 50.0 and t["long"]["length_ratio"] == pytest.approx(61 / 76)
    s = t["by_structure"]
    assert (s["fraction"]["n"], s["fraction"]["exprate"]) == (2, 50.0)
    assert (s["root"]["n"], s["root"]["exprate"]) == (1, 100.0)
    assert (s["script"]["n"], s["script"]["exprate"]) == (2, 50.0)
    assert s["matrix"] == {"n": 0}
    m = breakdown([["a"]], [["\\begin", "{", "matrix", "}", "a", "\\end", "{", "matrix", "}"]])["by_structure"]
    assert m["matrix"]["n"] == 1 and m["matrix"]["exprate"] == 0.0
    with pytest.raises(ValueError):
        breakdown([["a"]], [])


def test_sample_is_drawn_by_our_code():
    assert SAMPLE_PATH.is_file()
    a, b = Image.open(SAMPLE_PATH).convert("L"), draw_sample()
    assert a.size == b.size == (256, 256) and a.tobytes() == b.tobytes()


def test_train_evaluate_recognize_cli(tmp_path, capsys):
    _dataset(tmp_path / "data")
    run = tmp_path / "run"
    over = [f"data.root={tmp_path / 'data'}", "data.layout=tsv", "data.train=train", "data.val=train",
            "data.test=train", "data.limit={}", "data.scale=0.5", "train.max_steps=2", "eval.beam_size=2",
            "eval.max_len=6"]
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(run), "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "test", "--device", "cpu", "--no-progress",
                 "--out", str(tmp_path / "ev")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 8 and set(out["metrics"]) >= {"exprate", "exprate_le1", "exprate_le2"}
    rows = [json.loads(line) for line in (tmp_path / "ev" / "predictions_test.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {"id", "prediction", "reference", "distance", "correct"} <= set(rows[0])
    assert sum(r["correct"] for r in rows) / 8 * 100 == pytest.approx(out["metrics"]["exprate"])
    # the metrics file carries the table by length and structure, recomputed here from the predictions
    saved = json.loads((tmp_path / "ev" / "metrics_test.json").read_text())
    again = breakdown([r["prediction"].split() for r in rows], [r["reference"].split() for r in rows])
    assert saved["breakdown"] == json.loads(json.dumps(again))
    assert sum(v["n"] for v in saved["breakdown"]["by_length"].values()) == 8
    assert saved["metrics"]["n_long"] == 0 and "exprate_long" not in saved["metrics"]
    assert saved["metrics"]["length_ratio"] == pytest.approx(
        sum(len(r["prediction"].split()) for r in rows) / sum(len(r["reference"].split()) for r in rows))

    img = str(tmp_path / "data" / "train" / "S" / "e0.png")
    assert main(["recognize", img, "--model", str(run), "--json", "--beam-size", "2", "--max-len", "6"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["input"] == img and isinstance(res["text"], str) and len(res["tokens"]) <= 6

    # the compact (float16) export used for the packaged default model gives the same answer
    from tellkit.export.safetensors import export_safetensors

    export_safetensors(run / "checkpoints" / "best", tmp_path / "small")
    meta = json.loads((tmp_path / "small" / "config.json").read_text())
    assert meta["data"]["root"] is None and meta["data"]["layout"] == "tsv"  # no training-machine paths
    assert main(["recognize", img, "--model", str(tmp_path / "small"), "--json",
                 "--beam-size", "2", "--max-len", "6"]) == 0
    res16 = json.loads(capsys.readouterr().out)
    assert res16["tokens"] == res["tokens"] and abs(res16["score"] - res["score"]) < 0.05

    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    assert main(["recognize", str(bad), "--model", str(run)]) == 2
    err = capsys.readouterr().err
    assert "not a readable image" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    blank = tmp_path / "blank.png"
    Image.new("L", (64, 64), 255).save(blank)
    assert main(["recognize", str(blank), "--model", str(run)]) == 2
    assert "no ink" in capsys.readouterr().err


def test_bench_function(tmp_path):
    from tellkit.bench.bttr import bench_bttr
    from tellkit.models.bttr import BTTR, BTTRConfig

    m = BTTR(BTTRConfig(growth_rate=4, block_depth=1, stem_channels=8, d_model=16, nhead=2,
                        num_decoder_layers=1, dim_feedforward=32))
    m.save_pretrained(tmp_path / "ck", extra={"data": {"scale": 0.25}, "eval": {"beam_size": 2, "max_len": 5}})
    r = bench_bttr(tmp_path / "ck", images=[SAMPLE_PATH] * 3, batch_size=2)
    assert r["images"] == 3 and r["same_outputs"] is True and r["batched_cached_images_per_s"] > 0
    json.dumps(r)


def test_packaged_default_model(capsys):
    """The committed default of `tellkit recognize`: a trained BTTR of the reference's layout (not
    a placeholder), trained on the InkML renders, float16 safetensors under 25 MB, that reads the
    project's own sample correctly from its pen strokes and from a bitmap of another scale."""
    from tellkit.bench.bttr import SAMPLE_LATEX
    from tellkit.pipelines.recognition import SAMPLE_INKML, RecognitionPipeline
    from tellkit.recipes import PACKAGED_DEFAULTS

    DEFAULT_CHECKPOINT = PACKAGED_DEFAULTS["recognize"]

    assert (DEFAULT_CHECKPOINT / "model.safetensors").stat().st_size <= 25 * 2**20
    meta = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text(encoding="utf-8"))
    assert meta["family"] == "bttr" and meta["weights_dtype"] == "float16"
    assert meta["config"]["variant"] == "reference" and meta["data"]["layout"] == "inkml"
    assert meta["data"]["root"] is None and "placeholder" not in json.dumps(meta).lower()
    rec = RecognitionPipeline.load()
    assert sum(p.numel() for p in rec.model.parameters()) == 6_375_425 == rec.info["parameters"]
    assert main(["recognize", str(SAMPLE_INKML), str(SAMPLE_PATH), "--json"]) == 0  # no --model: the packaged one
    out = capsys.readouterr().out
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in results] == [SAMPLE_LATEX, SAMPLE_LATEX]


def _png_header_only(path, width, height):
    """A tiny PNG file that declares a huge image (a decompression bomb's header)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + idat + chunk(b"IEND", b""))


def test_recognize_refuses_a_decompression_bomb_and_a_folder(tmp_path, capsys):
    bomb = tmp_path / "bomb.png"
    _png_header_only(bomb, 30000, 30000)
    assert main(["recognize", str(bomb)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pixels" in err[0]
    assert main(["recognize", str(tmp_path / "*.inkml")]) == 2  # a pattern without matches
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no file matches" in err[0]
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("no images here")
    assert main(["recognize", str(tmp_path / "notes")]) == 2  # a folder without images or InkML files
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no images or InkML files in this folder" in err[0]
    import tellkit

    with pytest.raises(tellkit.TellkitError, match="is a folder"):  # the Python API takes files
        tellkit.pipeline("recognize")(str(tmp_path))


def test_recognize_reads_the_packaged_inkml_sample(capsys):
    from tellkit.pipelines.recognition import SAMPLE_INKML, SAMPLE_LATEX

    assert main(["recognize", str(SAMPLE_INKML)]) == 0
    assert capsys.readouterr().out.strip() == SAMPLE_LATEX


def test_recognize_reads_at_another_stroke_size(tmp_path, capsys):
    """--stroke-size replaces the checkpoint's reading size for InkML and bitmaps alike; bad values
    and models trained on bitmaps get a one-line error."""
    from tellkit.models.bttr import BTTR, BTTRConfig
    from tellkit.pipelines.recognition import SAMPLE_INKML, SAMPLE_LATEX, RecognitionPipeline

    stored = RecognitionPipeline.load()
    assert stored.processor.data.render["stroke_size"] == 22
    small = RecognitionPipeline.load(stroke_size=11)
    for item in (SAMPLE_INKML, SAMPLE_PATH):
        h, w = stored.processor.prepare(item).shape[-2:]
        h2, w2 = small.processor.prepare(item).shape[-2:]
        # half the stroke size: about half the ink (the margin and the pen do not scale)
        assert 1.4 < w / w2 < 2.4 and 1.4 < h / h2 < 2.4, (item, (h, w), (h2, w2))
    assert main(["recognize", str(SAMPLE_INKML), "--stroke-size", "16"]) == 0
    assert capsys.readouterr().out.strip() == SAMPLE_LATEX
    for bad in ("0", "-3", "nan", "inf", "big"):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error
            main(["recognize", str(SAMPLE_INKML), "--stroke-size", bad])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "argument --stroke-size" in err and "Traceback" not in err, err

    m = BTTR(BTTRConfig(growth_rate=4, block_depth=1, stem_channels=8, d_model=16, nhead=2,
                        num_decoder_layers=1, dim_feedforward=32))
    m.save_pretrained(tmp_path / "ck", extra={"data": {"layout": "tsv", "scale": 0.25}})
    assert main(["recognize", str(SAMPLE_PATH), "--model", str(tmp_path / "ck"), "--stroke-size", "20"]) == 2
    err = capsys.readouterr().err
    assert "bitmaps" in err and "Traceback" not in err


def test_evaluate_reads_bitmaps_with_a_model_trained_with_pen_stroke_augmentation(tmp_path, capsys):
    """The packaged default's stored recipe augments in pen-stroke space (InkML only); evaluating it
    on a bitmap test set must not trip over that training-only setting."""
    from tellkit.recipes import PACKAGED_DEFAULTS

    default = PACKAGED_DEFAULTS["recognize"]
    assert json.loads((default / "config.json").read_text())["data"]["augment"]["substitute"] > 0
    _dataset(tmp_path / "data")
    assert main(["evaluate", str(default), "--data", str(tmp_path / "data"), "data.layout=tsv",
                 "data.bitmap_fit=true", "data.test=train", "data.limit={}", "eval.beam_size=2", "eval.max_len=8",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "ev")]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == len(LABELS)
