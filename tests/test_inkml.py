"""InkML reading, rendering and the render cache; the CROHME InkML split; recognize / evaluate on
InkML through the CLI."""
import json

import numpy as np
import pytest
import torch

from tellkit.cli import main
from tellkit.data.inkml import (
    InkMLError,
    InkRenderer,
    RenderConfig,
    parse_inkml,
    read_inkml,
    render_strokes,
    scan_folder,
)
from tellkit.errors import TellkitError

NS = "http://www.w3.org/2003/InkML"


def inkml(traces, truth="x^2", ns=True, channels=("X", "Y"), groups=False, extra=""):
    fmt = "".join(f'<channel name="{c}" type="decimal"/>' for c in channels)
    body = "".join(f'<trace id="{i}">{t}</trace>' for i, t in enumerate(traces))
    if groups:
        body = f'<traceGroup xml:id="g"><annotation type="truth">Segmentation</annotation>{body}</traceGroup>'
    ann = f'<annotation type="truth">{truth}</annotation>' if truth is not None else ""
    attr = f' xmlns="{NS}"' if ns else ""
    return f"<ink{attr}><traceFormat>{fmt}</traceFormat>{ann}{extra}{body}</ink>"


# two strokes of an "x" and a small "2", in tablet units
X_STROKES = ["10 10, 30 40", "30 10, 10 40"]
TWO = "35 5, 40 2, 44 5, 35 15, 45 15"


def test_reads_namespaced_and_plain_files_alike():
    a = parse_inkml(inkml(X_STROKES + [TWO]))
    b = parse_inkml(inkml(X_STROKES + [TWO], ns=False))
    assert a.truth == b.truth == "x^2"
    assert len(a.strokes) == 3 and all(np.array_equal(p, q) for p, q in zip(a.strokes, b.strokes))
    assert a.strokes[2].shape == (5, 2)


def test_three_channel_points_odd_whitespace_and_trace_groups():
    traces = ["10 10 0,30 40 5", "\n  30   10 7 ,\t10 40 9  \n"]
    e = parse_inkml(inkml(traces, channels=("X", "Y", "T"), groups=True))
    assert [s.tolist() for s in e.strokes] == [[[10, 10], [30, 40]], [[30, 10], [10, 40]]]


def test_truth_math_delimiters_are_dropped_everywhere():
    assert parse_inkml(inkml(X_STROKES, truth="$x^2$")).truth == "x^2"
    assert parse_inkml(inkml(X_STROKES, truth=r"\left| $\frac{a}{b} \right|")).truth == r"\left| \frac{a}{b} \right|"


@pytest.mark.parametrize("text, reason", [
    ("", "empty file"),
    ("<ink><trace>1 2, 3", "malformed XML"),
    (inkml([]), "no traces"),
    (inkml(["   "]), "no traces"),
])
def test_unusable_files_raise_with_a_reason(text, reason):
    with pytest.raises(InkMLError) as exc:
        parse_inkml(text.encode(), "f.inkml")
    assert exc.value.reason == reason


def test_missing_truth_only_matters_when_required():
    assert parse_inkml(inkml(X_STROKES, truth=None)).truth is None
    with pytest.raises(InkMLError) as exc:
        parse_inkml(inkml(X_STROKES, truth=None), require_truth=True)
    assert exc.value.reason == "no truth"


def test_latin1_bytes_in_a_utf8_document_are_read():
    data = inkml(X_STROKES, truth="a \\cdot b").replace("<traceFormat>", "<mo>\xb7</mo><traceFormat>")
    e = parse_inkml(data.encode("latin-1"), "latin.inkml")
    assert e.truth == "a \\cdot b" and len(e.strokes) == 2


def test_scan_folder_skips_and_counts(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "good.inkml").write_text(inkml(X_STROKES + [TWO]))
    (tmp_path / "a" / "notruth.inkml").write_text(inkml(X_STROKES, truth=None))
    (tmp_path / "bad.inkml").write_text("<ink")
    (tmp_path / "empty.inkml").write_text("")
    res = scan_folder(tmp_path)
    assert [e.id for e in res.expressions] == ["good"]
    assert dict(res.skipped) == {"no truth": 1, "malformed XML": 1, "empty file": 1}


def _ink_mask(im):
    return np.asarray(im) < 128


def test_render_is_black_on_white_tight_antialiased_and_keeps_aspect():
    cfg = RenderConfig(stroke_size=32, line_width=3, margin=4)
    im = render_strokes([[(0, 0), (100, 0)], [(0, 0), (0, 50)]], cfg)  # an L, 2:1
    a = np.asarray(im)
    assert im.mode == "L" and a.max() == 255 and a.min() < 40
    assert ((a > 0) & (a < 255)).any()  # anti-aliased edges
    ink = _ink_mask(im)
    ys, xs = np.nonzero(ink)
    assert ys.min() <= cfg.margin + 1 and xs.min() <= cfg.margin + 1  # tight crop
    w, h = xs.max() - xs.min(), ys.max() - ys.min()
    assert abs(w / h - 2.0) < 0.15


def test_device_units_do_not_matter():
    """The same handwriting in tablet dots, millimetres or a shifted origin renders identically."""
    s = [np.array([[10, 10], [30, 40]], float), np.array([[30, 10], [10, 40]], float),
         np.array([[35, 5], [40, 2], [44, 5], [35, 15], [45, 15]], float)]
    a = np.asarray(render_strokes(s))
    b = np.asarray(render_strokes([p * 37.5 + 1000 for p in s]))
    assert a.shape == b.shape and np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_stroke_size_sets_the_scale_and_pen_width_is_fixed():
    s = [[(0, 0), (0, 10)], [(5, 0), (5, 10)], [(10, 0), (10, 10)]]
    small = render_strokes(s, RenderConfig(stroke_size=20, line_width=3, margin=0))
    big = render_strokes(s, RenderConfig(stroke_size=40, line_width=3, margin=0))
    assert abs(big.size[1] - 2 * small.size[1]) <= 4
    from itertools import groupby

    row = _ink_mask(big)[big.size[1] // 2]
    runs = [len(list(g)) for ink, g in groupby(row) if ink]
    assert len(runs) == 3 and all(2 <= r <= 4 for r in runs)  # three 3-px pen lines, whatever the scale


def test_pixel_cap_shrinks_instead_of_dropping():
    long_expr = [[(i * 10, 0), (i * 10 + 5, 10)] for i in range(300)]
    im = render_strokes(long_expr, RenderConfig(max_pixels=100_000))
    assert im.size[0] * im.size[1] <= 100_000 and im.size[0] > 10 * im.size[1]


def test_render_cache_is_keyed_by_renderer_and_source(tmp_path):
    src = tmp_path / "e.inkml"
    src.write_text(inkml(X_STROKES + [TWO]))
    cache = tmp_path / "cache"
    r1 = InkRenderer(RenderConfig(stroke_size=32), cache, tmp_path)
    first = np.asarray(r1.image(src))
    assert len(list(cache.rglob("*.png"))) == 1
    assert np.array_equal(np.asarray(InkRenderer(RenderConfig(stroke_size=32), cache, tmp_path).image(src)), first)
    other = np.asarray(InkRenderer(RenderConfig(stroke_size=16), cache, tmp_path).image(src))
    assert other.shape != first.shape and len(list(cache.rglob("*.png"))) == 2  # a changed renderer renders anew
    import os
    import time

    src.write_text(inkml(X_STROKES))  # the source changes: the entry is stale
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    time.sleep(0.01)
    again = np.asarray(InkRenderer(RenderConfig(stroke_size=32), cache, tmp_path).image(src))
    assert again.shape != first.shape


def test_same_renderer_for_files_and_canvas_strokes(tmp_path):
    src = tmp_path / "e.inkml"
    src.write_text(inkml(X_STROKES + [TWO]))
    r = InkRenderer(RenderConfig())
    strokes = [[(float(a), float(b)) for a, b in (p.split() for p in t.split(","))] for t in X_STROKES + [TWO]]
    assert torch.equal(r.tensor(src), r.strokes_tensor(strokes))
    t = r.tensor(src)
    assert t.shape[1] % 16 == 0 and t.shape[2] % 16 == 0 and float(t.max()) > 0.9


# --- the CROHME InkML split, recognise and evaluate through the CLI --------------------------------
def _inkml_dataset(root):
    """A tiny CROHME-like InkML folder: train/S/*.inkml and test/2014/*.inkml."""
    strokes = {"x ^ { 2 }": X_STROKES + [TWO], "x": X_STROKES, "1": ["20 5, 20 40"]}
    truths = {"x ^ { 2 }": "$x^2$", "x": "x", "1": "1"}
    for split in ("train/S", "test/2014"):
        d = root / split
        d.mkdir(parents=True)
        for i, (k, s) in enumerate(strokes.items()):
            (d / f"e{i}.inkml").write_text(inkml(s, truth=truths[k]))
    (root / "train" / "S" / "empty.inkml").write_text("")
    return root


def test_inkml_split_and_recognize_cli(tmp_path, capsys):
    from tellkit.data.crohme import load_split

    root = _inkml_dataset(tmp_path / "crohme")
    skipped = {}
    ex = load_split(root, "train", "inkml", skipped)
    assert sorted(" ".join(e.tokens) for e in ex) == ["1", "x", "x ^ { 2 }"]
    assert skipped == {"empty file": 1}
    assert len(load_split(root, "2014", "inkml")) == 3
    ck = tmp_path / "ck"
    over = [f"data.root={root}", "data.train=train", "data.val=2014", "data.test=2014", "data.limit={}",
            f"data.cache={tmp_path / 'cache'}", "train.max_steps=2", "eval.beam_size=2", "eval.max_len=6"]
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(ck), "--device", "cpu", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["recognize", str(root / "test" / "2014" / "e0.inkml"), "--model", str(ck), "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["input"].endswith("e0.inkml") and isinstance(line["tokens"], list)
    assert main(["recognize", str(root / "test"), "--model", str(ck)]) == 2  # a folder: one-line error
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "folder" in err[0]
    out = tmp_path / "eval"
    assert main(["evaluate", str(ck), "--data", str(root), "data.test=2014", "--split", "test", "--out", str(out)]) == 0
    res = json.loads((out / "metrics_test.json").read_text())
    assert "exprate" in json.dumps(res)
    preds = [json.loads(x) for x in (out / "predictions_test.jsonl").read_text().splitlines()]
    assert sorted(p["reference"] for p in preds) == ["1", "x", "x ^ { 2 }"]


@pytest.mark.data
def test_training_truth_tokenises_like_the_reference_file(shared_data):
    """At least 99% of the CROHME InkML training expressions normalise exactly to the reference
    tokenisation (matched by expression id); the disagreements are listed in docs/bttr.md."""
    from tellkit.data.crohme import load_split

    ref = {}
    for line in (shared_data / "crohme" / "train_caption_tokenized.txt").read_text(encoding="utf-8").splitlines():
        k, _, v = line.partition("\t")
        ref[k] = v.split()
    skipped = {}
    ex = load_split(shared_data / "crohme_inkml", "train", "inkml", skipped)
    assert skipped == {"empty file": 1}  # the one training file without a truth annotation
    assert len(ex) == 8835
    both = [e for e in ex if e.id in ref]
    agree = sum(e.tokens == ref[e.id] for e in both)
    assert len(both) == 8835 and agree / len(both) >= 0.99, agree
    assert len(both) - agree == 3


@pytest.mark.data
def test_real_inkml_renders_like_an_offline_bitmap(shared_data):
    files = sorted((shared_data / "crohme_inkml" / "test" / "2014").glob("*.inkml"))[:20]
    sizes = [render_strokes(read_inkml(f).strokes).size for f in files]
    hs = sorted(h for _, h in sizes)
    assert 40 <= hs[len(hs) // 2] <= 250  # a typical expression is about 100 px high


@pytest.mark.data
def test_training_throughput_bench_runs_on_inkml(shared_data, monkeypatch):
    from tellkit.bench.bttr_train import bench_train

    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(shared_data))
    res = bench_train(recipe="bttr/tiny", n_expressions=12, warmup=0)
    from tellkit.utils.precision import cpu_has_bf16

    names = {"reference", "area_sorted_channels_last", "shape_sorted", "shape_sorted_channels_last",
             "shape_sorted_cap_640k", "shape_sorted_channels_last_fast_dropout"}
    if cpu_has_bf16():
        names.add("shape_sorted_channels_last_fast_dropout_bf16")
        bf16 = res["bf16_paired"]
        assert bf16["pairs"] >= 1 and bf16["min_speedup"] <= bf16["median_speedup"] <= bf16["max_speedup"]
        assert bf16["seconds_bf16"] > 0 and bf16["seconds_fp32"] > 0
    else:
        assert res["bf16_paired"] is None and "bfloat16" in res["bf16_note"]
    assert set(res["variants"]) == names
    for v in res["variants"].values():
        assert v["images_per_s"] > 0 and v["padding_waste"] >= 0 and v["images"] == 12  # all, every variant
    assert res["speedup_images_per_s"]["reference"] == 1.0
    paired = res["dropout_paired"]
    assert paired["pairs"] >= 1 and paired["min_speedup"] <= paired["median_speedup"] <= paired["max_speedup"]


@pytest.mark.data
def test_gpu_training_step_bench_runs_its_variants(shared_data, monkeypatch):
    # the GPU suite's timing code, run on the CPU: every variant trains on all the expressions
    from tellkit.bench.bttr_train import bench_train_cuda

    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(shared_data))
    res = bench_train_cuda(recipe="bttr/tiny", n_expressions=6, device="cpu")
    assert res["device"] == "cpu" and res["split"] == "2014" and res["render_images_per_s_one_worker"] > 0
    assert set(res["variants"]) == {"bs8_cap320k_fp32", "bs8_cap320k_bf16", "bs32_cap1280k_bf16",
                                    "bs32_cap1280k_bf16_channels_last"}
    for v in res["variants"].values():
        assert v["images"] == 6 and v["seconds_per_step"] > 0
    assert res["variants"]["bs32_cap1280k_bf16"]["micro_steps"] <= res["variants"]["bs8_cap320k_fp32"]["micro_steps"]


def test_training_throughput_bench_needs_the_data(monkeypatch):
    from tellkit.bench.bttr_train import bench_train
    from tellkit.errors import TellkitError

    monkeypatch.delenv("TELLKIT_SHARED_DATA", raising=False)
    with pytest.raises(TellkitError, match="TELLKIT_SHARED_DATA"):
        bench_train(recipe="bttr/tiny")


# --- bitmaps brought to the scale of the renders ---------------------------------------------------
def test_ink_components_match_skimage_labelling():
    from skimage.measure import label, regionprops

    from tellkit.data.crohme import ink_component_sizes

    rng = np.random.default_rng(3)
    for density in (0.05, 0.3, 0.55):
        a = (rng.random((37, 53)) < density).astype(np.float32)
        want = sorted(max(r.bbox[2] - r.bbox[0], r.bbox[3] - r.bbox[1])
                      for r in regionprops(label(a > 0.5, connectivity=2)) if r.area >= 4)
        assert sorted(ink_component_sizes(a).tolist()) == want
    # a serpentine: one component whose runs join only through long chains of rows
    a = np.zeros((121, 121), np.float32)
    for k in range(0, 120, 4):
        a[k, 2:119] = 1
        a[k : k + 5, 118 if (k // 4) % 2 == 0 else 2] = 1
    assert ink_component_sizes(a).tolist() == [121]  # rows 0..120
    # touching only at a corner is one component; a one-pixel gap is two
    a = np.zeros((6, 6), np.float32)
    a[0:2, 0:2] = a[2:4, 2:4] = 1
    assert ink_component_sizes(a).tolist() == [4]
    a[2:4, 2:4], a[3:5, 3:5] = 0, 1
    assert sorted(ink_component_sizes(a).tolist()) == [2, 2]


def test_pen_width_and_dilation():
    from tellkit.data.crohme import _dilate, pen_width

    a = np.zeros((20, 220), np.float32)
    a[5:8, 10:210] = 1  # a 3 px stroke
    assert pen_width(a) == pytest.approx(3, rel=0.1) and pen_width(np.zeros((4, 4))) == 0
    b = _dilate(a, 4)
    assert pen_width(b) == pytest.approx(7, rel=0.1) and b[a > 0].min() == 1


def test_bitmaps_for_an_inkml_model_come_to_the_render_scale():
    """A large, thin-pen rendering of the sample (a bigger scan of the same handwriting) is
    brought back to about the size, pen width and margin the renderer gives the strokes; a
    bitmap-trained model's scaling is unchanged."""
    from tellkit.data.crohme import pen_width
    from tellkit.data.recognition import RecognitionDataConfig
    from tellkit.pipelines.recognition import SAMPLE_INKML
    from tellkit.tasks.recognition import RecognitionProcessor

    data = {"layout": "inkml", "render": {"stroke_size": 16, "line_width": 2.0, "margin": 4}}
    rec = RecognitionProcessor(RecognitionDataConfig(**data))
    direct = rec.prepare(SAMPLE_INKML)
    big = render_strokes(read_inkml(SAMPLE_INKML).strokes, RenderConfig(stroke_size=16 * 2.6, line_width=2.0))
    scaled = rec.prepare(big)

    def ink_box(t):
        ys, xs = np.nonzero(t[0].numpy() > 0.5)
        return ys.min(), xs.min(), ys.max() - ys.min() + 1, xs.max() - xs.min() + 1

    (_, _, h0, w0), (y1, x1, h1, w1) = ink_box(direct), ink_box(scaled)
    assert abs(h1 / h0 - 1) < 0.12 and abs(w1 / w0 - 1) < 0.12, ((h0, w0), (h1, w1))
    assert y1 >= 4 and x1 >= 4  # the renderer's margin
    # the 2 px pen of the large image would be under 1 px at this scale: it is widened first
    assert pen_width(scaled[0].numpy()) >= 0.8 * pen_width(direct[0].numpy())
    plain = RecognitionProcessor(RecognitionDataConfig(layout="tsv", scale=1.0))
    assert ink_box(plain.prepare(big))[2] > 2 * h0  # bitmap-trained: no change of scale


def test_evaluate_on_bitmaps_prepares_them_as_recognize_does(tmp_path):
    """data.bitmap_fit=true: a bitmap test set is read the way `tellkit recognize` reads bitmaps
    for a model trained on InkML renders."""
    from tellkit.data.crohme import CrohmeDataset, Expression
    from tellkit.data.recognition import RecognitionDataConfig, bitmap_kwargs, check
    from tellkit.pipelines.recognition import SAMPLE_INKML
    from tellkit.recipes import section
    from tellkit.tasks.recognition import RecognitionProcessor

    def data_section(d):  # the recognition task reads its data section so
        return check(section({"data": d}, "data", RecognitionDataConfig))

    render = {"stroke_size": 16, "line_width": 2.0}
    png = tmp_path / "big.png"
    render_strokes(read_inkml(SAMPLE_INKML).strokes, RenderConfig(stroke_size=40, line_width=1.5)).save(png)
    rec = RecognitionProcessor(data_section({"layout": "inkml", "render": render}))
    d = data_section({"layout": "tsv", "bitmap_fit": True, "render": render})
    ds = CrohmeDataset([Expression("big", png, ["x"])], bitmap=bitmap_kwargs(d))
    assert torch.equal(ds.image(0), rec.prepare(png))
    plain = CrohmeDataset([Expression("big", png, ["x"])], bitmap=bitmap_kwargs(data_section({"layout": "tsv"})))
    assert plain.image(0).shape != ds.image(0).shape


@pytest.mark.parametrize("bad", [{"stroke_size": 0}, {"stroke_size": -16}, {"stroke_size": float("nan")},
                                 {"line_width": 0}, {"supersample": 0}, {"margin": -1}, {"max_pixels": -5},
                                 {"stroke_size": True}, {"stroke_size": "16"}])
def test_render_settings_out_of_range_are_refused(bad):
    # a zero size drew an empty 11 x 11 image, a negative one failed inside PIL
    (name, value), = bad.items()
    with pytest.raises(TellkitError, match=f"data.render.{name}"):
        RenderConfig(**bad)
