"""Augmentation in pen-stroke space (tellkit.data.ink_augment): each switch changes the render and
not the label, a seed reproduces it, off is the plain render, bad recipe values are refused;
symbol substitution on the InkML segmentation; a training step with the shipped recipe's
settings."""
import numpy as np
import pytest
import torch

from tellkit.data.crohme import CrohmeDataset, Expression
from tellkit.data.ink_augment import InkAugment, InkAugmenter, build_bank, fit_to_box, load_inks
from tellkit.data.inkml import InkRenderer, RenderConfig, parse_inkml, read_inkml, render_strokes
from tellkit.data.recognition import RecognitionDataConfig, augmenter, check, ink_augmenter
from tellkit.errors import TellkitError
from tellkit.recipes import section

NS = "http://www.w3.org/2003/InkML"

# "x + 1" by two writers: each symbol's strokes in tablet units, y down
WRITER_A = {
    "x": ["10 10, 20 18, 30 30", "30 10, 20 21, 10 30"],
    "+": ["40 20, 52 20", "46 14, 46 26"],
    "1": ["60 12, 64 8, 64 30"],
}
WRITER_B = {
    "x": ["100 100, 112 125, 126 150", "126 100, 110 128, 98 150"],
    "+": ["140 130, 170 131", "155 112, 156 148"],
    "1": ["180 105, 186 98, 187 150, 186 152"],
}
WRITER_C = {
    "x": ["5 5, 9 4, 13 9, 16 20, 20 24, 24 22", "24 6, 14 14, 6 24"],
    "+": ["1 10, 21 8", "10 0, 12 20"],
    "1": ["30 0, 28 22", "24 22, 33 22"],
}


def data_section(d):
    """A recognition recipe's data section, read as the task reads it."""
    return check(section({"data": d}, "data", RecognitionDataConfig))


def inkml_file(symbols, writer, truth="x+1", segmented=True, extra_group=""):
    traces, groups = [], []
    for label, strokes in symbols.items():
        ids = []
        for s in strokes:
            ids.append(len(traces))
            traces.append(f'<trace id="{len(traces)}">{s}</trace>')
        views = "".join(f'<traceView traceDataRef="{i}"/>' for i in ids)
        groups.append(f'<traceGroup xml:id="g{label}"><annotation type="truth">{label}</annotation>'
                      f'{views}</traceGroup>')
    seg = (f'<traceGroup xml:id="seg"><annotation type="truth">Segmentation</annotation>'
           f'{"".join(groups)}{extra_group}</traceGroup>') if segmented else ""
    return (f'<ink xmlns="{NS}"><annotation type="truth">${truth}$</annotation>'
            f'<annotation type="writer">{writer}</annotation>{"".join(traces)}{seg}</ink>')


@pytest.fixture
def ink_root(tmp_path):
    d = tmp_path / "train" / "S"
    d.mkdir(parents=True)
    (d / "a.inkml").write_text(inkml_file(WRITER_A, "w1"))
    (d / "b.inkml").write_text(inkml_file(WRITER_B, "w2"))
    (d / "c.inkml").write_text(inkml_file(WRITER_A, "w3", segmented=False))
    (d / "d.inkml").write_text(inkml_file(WRITER_C, "w4"))
    return tmp_path


# --- reading the segmentation ----------------------------------------------------------------------
def test_reader_returns_the_symbol_segmentation():
    e = parse_inkml(inkml_file(WRITER_A, "w1"))
    assert [(s.label, s.strokes) for s in e.symbols] == [("x", (0, 1)), ("+", (2, 3)), ("1", (4,))]
    assert e.truth == "x+1" and e.writer == "w1"
    assert parse_inkml(inkml_file(WRITER_A, "w1", segmented=False)).symbols == []
    # a symbol naming a trace that is not there is left out; the others stay
    bad_ref = '<traceGroup><annotation type="truth">y</annotation><traceView traceDataRef="99"/></traceGroup>'
    assert [s.label for s in parse_inkml(inkml_file(WRITER_A, "w1", extra_group=bad_ref)).symbols] == ["x", "+", "1"]
    # a stroke claimed twice: the segmentation is not usable
    twice = '<traceGroup><annotation type="truth">y</annotation><traceView traceDataRef="0"/></traceGroup>'
    assert parse_inkml(inkml_file(WRITER_A, "w1", extra_group=twice)).symbols == []


# --- each switch ---------------------------------------------------------------------------------
SWITCHES = {
    "render_scale": {"render_scale": [0.7, 1.4]},
    "rotate_shear": {"ink_rotate": 3.0, "ink_shear": 0.15},
    "stroke_jitter": {"stroke_shift": 0.05, "stroke_scale": 0.1, "stroke_rotate": 5.0},
    "elastic": {"elastic": 0.1},
    "pen_width": {"pen_width": [1.5, 3.0]},
    "substitute": {"substitute": 1.0},
}
BASE = RenderConfig(stroke_size=16, line_width=2.0, margin=4, supersample=4, max_pixels=320_000)


def _dataset(root, augment: dict):
    d = data_section({"root": str(root), "augment": augment, "limit": {}})
    exprs = [Expression(p.stem, p, ["x", "+", "1"]) for p in sorted((root / "train" / "S").glob("*.inkml"))]
    return CrohmeDataset(exprs, render=InkRenderer(BASE), ink_augment=ink_augmenter(d))


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_each_switch_changes_the_image_not_the_label_and_a_seed_reproduces_it(ink_root, name):
    ds = _dataset(ink_root, SWITCHES[name])
    plain = InkRenderer(BASE).tensor(ds.exprs[0].image)

    def item(seed):
        torch.manual_seed(seed)
        return ds[0]

    a, b = item(0), item(0)
    others = [item(s) for s in (1, 2, 3)]
    assert a["tokens"] == ["x", "+", "1"] and all(x["labels"] == a["labels"] for x in [b, *others])
    assert torch.equal(a["image"], b["image"])  # bit for bit
    differs = [not torch.equal(a["image"], x["image"]) for x in others]
    # continuous draws differ for every seed; with two donors per symbol, two seeds can pick the same
    assert all(differs) if name != "substitute" else any(differs)
    assert a["image"].shape != plain.shape or not torch.equal(a["image"], plain)
    assert a["image"].shape[-1] % 16 == 0 and a["image"].shape[-2] % 16 == 0
    # the undistorted sizes drive the batches; the renderer's cache is never asked for a distorted image
    assert ds.sizes()[0] == tuple(plain.shape[-2:])


def test_off_is_the_plain_render(ink_root):
    e = read_inkml(ink_root / "train" / "S" / "a.inkml")
    out = InkAugmenter(InkAugment())(e, np.random.default_rng(0))
    assert out.render(BASE).tobytes() == render_strokes(e.strokes, BASE).tobytes()
    d = data_section({"root": str(ink_root), "augment": {}})
    assert ink_augmenter(d) is None and augmenter(d) is None
    # switched on with nothing to do (zero magnitude ranges are the off values)
    assert ink_augmenter(data_section({"augment": {"render_scale": [1, 1], "pen_width": [0, 0]}})) is None


def test_render_scale_and_pen_width_reach_the_renderer_and_respect_the_pixel_cap(ink_root):
    e = read_inkml(ink_root / "train" / "S" / "a.inkml")
    aug = InkAugmenter(InkAugment(render_scale=(1.4, 1.4), pen_width=(3.0, 3.0)))
    out = aug(e, np.random.default_rng(0))
    rc = out.render_config(BASE)
    assert rc.stroke_size == pytest.approx(16 * 1.4) and rc.line_width == 3.0 and rc.margin == BASE.margin
    big, small = out.render(BASE), render_strokes(e.strokes, BASE)
    assert big.size[0] > small.size[0] and big.size[1] > small.size[1]
    capped = out.render(RenderConfig(stroke_size=16, max_pixels=small.size[0] * small.size[1]))
    assert capped.size[0] * capped.size[1] <= small.size[0] * small.size[1]


def test_image_and_stroke_keys_live_side_by_side():
    d = data_section({"augment": {"rotate": 2, "render_scale": [0.7, 1.4], "substitute": 0.3}})
    assert augmenter(d).rotate == 2 and ink_augmenter(d).substitute == 0.3
    assert ink_augmenter(d).render_scale == (0.7, 1.4)


@pytest.mark.parametrize("augment, key", [
    ({"render_scale": [1.4, 0.7]}, "render_scale"),
    ({"render_scale": 1.2}, "render_scale"),
    ({"render_scale": [0, 1.2]}, "render_scale"),
    ({"ink_rotate": 90}, "ink_rotate"),
    ({"ink_rotate": "a lot"}, "ink_rotate"),
    ({"ink_shear": -0.1}, "ink_shear"),
    ({"stroke_shift": True}, "stroke_shift"),
    ({"stroke_scale": 0.9}, "stroke_scale"),
    ({"stroke_rotate": [5]}, "stroke_rotate"),
    ({"elastic": 2}, "elastic"),
    ({"elastic": 0.1, "elastic_wavelength": 0}, "elastic_wavelength"),
    ({"pen_width": [0, 2]}, "pen_width"),
    ({"pen_width": [3, 2]}, "pen_width"),
    ({"substitute": 1.5}, "substitute"),
    ({"substitution": 0.3}, "unknown key"),
])
def test_bad_values_are_refused_when_the_recipe_is_read(augment, key):
    from tellkit.tasks.recognition import RecognitionTask

    with pytest.raises(TellkitError, match=key) as exc:
        data_section({"augment": augment})
    assert len(str(exc.value).splitlines()) == 1
    if key != "unknown key":
        assert f"data.augment.{key}:" in str(exc.value)
    with pytest.raises(TellkitError, match=key):
        RecognitionTask({"task": "recognize", "data": {"augment": augment}})


def test_stroke_keys_need_inkml():
    with pytest.raises(TellkitError, match="inkml"):
        data_section({"layout": "tsv", "augment": {"substitute": 0.3}})
    data_section({"layout": "tsv", "augment": {"rotate": 2}})  # image space works on any layout


def test_shipped_recipes_keep_augmentation_off_and_crohme_aug_turns_it_on():
    from tellkit.config import load_yaml

    for name in ("crohme", "crohme_cpu"):
        d = data_section(load_yaml(f"configs/bttr/{name}.yaml")["data"])
        assert augmenter(d) is None and ink_augmenter(d) is None
    aug = ink_augmenter(data_section(load_yaml("configs/bttr/crohme_aug.yaml")["data"]))
    assert aug.render_scale == (0.7, 1.4) and 0 < aug.substitute < 1 and aug.pen_width[0] > 0


# --- symbol substitution -------------------------------------------------------------------------
def _box(strokes):
    p = np.concatenate(strokes)
    return p.min(0), p.max(0)


def test_substitution_redraws_symbols_by_another_writer_inside_their_boxes(ink_root):
    # a (w1), b (w2), c (w3, no segmentation), d (w4)
    inks = load_inks(sorted((ink_root / "train" / "S").glob("*.inkml")))
    bank = build_bank(inks)
    assert sorted(bank.by_label) == ["+", "1", "x"] and len(bank) == 9
    aug = InkAugmenter(InkAugment(substitute=1.0), bank)
    a = inks[0]
    out = aug(a, np.random.default_rng(3), source=0)
    assert [s.label for s in out.symbols] == ["x", "+", "1"] and out.substituted == [0, 1, 2]
    S = 18.0  # about the median stroke size of writer A
    for old, new in zip(a.symbols, out.symbols):
        lo, hi = _box([a.strokes[i] for i in old.strokes])
        nlo, nhi = _box([out.strokes[i] for i in new.strokes])
        np.testing.assert_allclose((nlo + nhi) / 2, (lo + hi) / 2, atol=1e-9)  # centred
        if old.label == "1":  # thin: the long side fits, the thin side keeps a pen-like width
            assert nhi[1] - nlo[1] == pytest.approx(hi[1] - lo[1])
            assert nhi[0] - nlo[0] < 0.5 * S
        else:
            assert (nlo >= lo - 1e-9).all() and (nhi <= hi + 1e-9).all()
        # the new strokes are writer B's or D's, not A's, moved and resized
        assert not any(np.array_equal(out.strokes[i], a.strokes[j]) for i in new.strokes for j in old.strokes)
    # the same writer is never the donor, nor the same file; a file without segmentation keeps its strokes
    same_writer = InkAugmenter(InkAugment(substitute=1.0), build_bank([inks[0], inks[0]]))
    assert same_writer(a, np.random.default_rng(0), source=0).substituted == []
    c = aug(inks[2], np.random.default_rng(0), source=2)
    assert c.substituted == [] and all(x is y for x, y in zip(c.strokes, inks[2].strokes))


def test_fit_keeps_thin_symbols_thin_and_dots_small():
    minus = [np.array([[0.0, 0.0], [50.0, 6.0]])]  # a donor minus, slanted
    out = fit_to_box(minus, np.array([0.0, 0.0]), np.array([400.0, 4.0]), target_scale=40.0, donor_scale=40.0)
    lo, hi = _box(out)
    assert hi[0] - lo[0] == pytest.approx(400.0) and hi[1] - lo[1] <= 6.0  # a long bar, not a tall slope
    dot = [np.array([[5.0, 5.0], [6.0, 6.0]])]
    out = fit_to_box(dot, np.array([100.0, 100.0]), np.array([100.5, 100.5]), target_scale=20.0, donor_scale=10.0)
    lo, hi = _box(out)
    assert hi[0] - lo[0] == pytest.approx(2.0)  # the donor's size relative to its handwriting


@pytest.mark.data
def test_substitution_on_real_training_files(shared_data):
    files = sorted((shared_data / "crohme_inkml" / "train" / "expressmatch").glob("*.inkml"))[:150]
    inks = load_inks(files)
    bank = build_bank(inks)
    aug = InkAugmenter(InkAugment(substitute=1.0), bank)
    target = next(i for i, e in enumerate(inks) if len(e.symbols) >= 5)
    e = inks[target]
    from tellkit.data.inkml import stroke_scale

    S = stroke_scale(e.strokes)
    out = aug(e, np.random.default_rng(0), source=target)
    assert len(out.symbols) == len(e.symbols) and [s.label for s in out.symbols] == [s.label for s in e.symbols]
    assert len(out.substituted) >= len(e.symbols) // 2
    for j in out.substituted:
        lo, hi = _box([e.strokes[i] for i in e.symbols[j].strokes])
        nlo, nhi = _box([out.strokes[i] for i in out.symbols[j].strokes])
        np.testing.assert_allclose((nlo + nhi) / 2, (lo + hi) / 2, atol=1e-6 * S)
        assert (nlo >= lo - 0.5 * S).all() and (nhi <= hi + 0.5 * S).all()
    assert render_strokes(out.strokes, BASE).tobytes() != render_strokes(e.strokes, BASE).tobytes()


# --- sub-expressions -----------------------------------------------------------------------------
FRACTION = {  # (x + 1) / 2: label, MathML id, strokes
    "x": ("x_1", ["10 10, 20 18, 30 30", "30 10, 20 21, 10 30"]),
    "+": ("+_1", ["40 20, 52 20", "46 14, 46 26"]),
    "1": ("1_1", ["60 12, 64 8, 64 30"]),
    "-": ("bar_1", ["5 40, 70 40"]),
    "2": ("2_1", ["30 50, 38 46, 42 52, 30 66, 44 66"]),
}
FRACTION_MATHML = ('<math xmlns="http://www.w3.org/1998/Math/MathML"><mfrac xml:id="bar_1"><mrow>'
                   '<mi xml:id="x_1">x</mi><mrow><mo xml:id="+_1">+</mo><mn xml:id="1_1">1</mn></mrow></mrow>'
                   '<mn xml:id="2_1">2</mn></mfrac></math>')


def fraction_file(truth=r"\frac{x+1}{2}", mathml=FRACTION_MATHML):
    traces, groups = [], []
    for label, (ref, strokes) in FRACTION.items():
        views = ""
        for st in strokes:
            views += f'<traceView traceDataRef="{len(traces)}"/>'
            traces.append(f'<trace id="{len(traces)}">{st}</trace>')
        groups.append(f'<traceGroup><annotation type="truth">{label}</annotation>{views}'
                      f'<annotationXML href="{ref}"/></traceGroup>')
    return (f'<ink xmlns="{NS}"><annotation type="truth">${truth}$</annotation>'
            f'<annotationXML type="truth" encoding="Content-MathML">{mathml}</annotationXML>'
            f'{"".join(traces)}<traceGroup><annotation type="truth">Segmentation</annotation>'
            f'{"".join(groups)}</traceGroup></ink>')


def test_subexpressions_of_a_fraction_with_their_own_labels(tmp_path):
    from tellkit.data.ink_augment import subexpressions

    e = parse_inkml(fraction_file())
    assert [s.ref for s in e.symbols] == ["x_1", "+_1", "1_1", "bar_1", "2_1"]
    subs = subexpressions(e)  # the numerator; the denominator is a single symbol
    assert [(s.tokens, s.symbols) for s in subs] == [(("x", "+", "1"), (0, 1, 2))]
    assert subexpressions(e, min_symbols=1)[1].tokens == ("2",)
    # the MathML disagrees with the truth (or is missing): the file is not used
    assert subexpressions(parse_inkml(fraction_file(truth=r"\frac{2}{x+1}"))) == []
    assert subexpressions(parse_inkml(fraction_file(mathml="<math/>"))) == []
    aug = InkAugmenter(InkAugment(subexpr=1.0))
    out = aug(e, np.random.default_rng(0))
    assert out.tokens == ["x", "+", "1"] and len(out.strokes) == 5 and [s.label for s in out.symbols] == ["x", "+", "1"]
    assert all(np.array_equal(a, b) for a, b in zip(out.strokes, e.strokes[:5]))
    # a vocabulary without "+" leaves the item whole
    assert InkAugmenter(InkAugment(subexpr=1.0), vocab={"x", "1"})(e, np.random.default_rng(0)).tokens is None
    # through the dataset: the item's label is the part's, reproducibly
    (tmp_path / "f.inkml").write_text(fraction_file())
    d = data_section({"augment": {"subexpr": 0.5}})
    ds = CrohmeDataset([Expression("f", tmp_path / "f.inkml", ["\\frac", "{", "x", "+", "1", "}", "{", "2", "}"])],
                       render=InkRenderer(BASE), ink_augment=ink_augmenter(d))
    seen = set()
    for seed in range(8):
        torch.manual_seed(seed)
        a = ds[0]
        torch.manual_seed(seed)
        assert torch.equal(ds[0]["image"], a["image"])
        seen.add(" ".join(a["tokens"]))
        assert a["labels"] == [ds.vocab.stoi[t] for t in a["tokens"]]
    assert seen == {"\\frac { x + 1 } { 2 }", "x + 1"}


@pytest.mark.data
def test_real_subexpressions_are_parts_of_the_truth(shared_data):
    from tellkit.data.ink_augment import subexpressions
    from tellkit.data.latex import normalize

    n = 0
    for f in sorted((shared_data / "crohme_inkml" / "train" / "HAMEX").glob("*.inkml"))[:300]:
        e = read_inkml(f)
        full = normalize(e.truth)
        for sub in subexpressions(e):
            n += 1
            k = len(sub.tokens)
            assert any(tuple(full[i:i + k]) == sub.tokens for i in range(len(full) - k + 1)), (f, sub.tokens)
            assert len(sub.symbols) >= 2 and len(set(sub.symbols)) == len(sub.symbols)
    assert n >= 20


# --- training -----------------------------------------------------------------------------------
def test_training_step_with_the_augmentation_recipe_settings(ink_root, tmp_path):
    from tellkit.cli import main
    from tellkit.config import load_yaml

    (ink_root / "test" / "2014").mkdir(parents=True)
    (ink_root / "test" / "2014" / "t.inkml").write_text(inkml_file(WRITER_B, "w9"))
    aug = load_yaml("configs/bttr/crohme_aug.yaml")["data"]["augment"]
    flat = "{" + ", ".join(f"{k}: {list(v) if isinstance(v, (list, tuple)) else v}" for k, v in aug.items()) + "}"
    over = [f"data.root={ink_root}", "data.train=train", "data.val=2014", "data.test=2014", "data.limit={}",
            f"data.cache={tmp_path / 'cache'}", f"data.augment={flat}", "train.max_steps=2",
            "eval.beam_size=2", "eval.max_len=6"]
    run = tmp_path / "run"
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(run), "--device", "cpu", "--no-progress"]) == 0
    assert (run / "checkpoints").is_dir()
