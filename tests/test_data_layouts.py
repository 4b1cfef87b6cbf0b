"""The handwriting releases as they ship, read by data.layout (mathwriting, hme100k,
crohme2019, caption from a zip or from images.pkl), and the restricted unpickler.

The small files here are written from the releases' own descriptions:
* MathWriting: the archive's README (``mathwriting-2024/README``): one ``<16 hex>.inkml`` per
  ink in train/ valid/ test/ synthetic/ symbols/, ``x y t`` trace points, the truth in
  ``<annotation type="normalizedLabel">``, only ``label`` under symbols/;
* HME100K: the release's ``train_images/`` + ``train_labels.txt`` and ``test_images/`` +
  ``test_labels.txt``, one ``<name>.jpg<TAB><space-separated LaTeX>`` a line;
* CROHME 2019: InkML without truth and label graphs (``.lg``) in LgEval's object-relationship
  form (``O, id, label, weight, strokes...`` / ``R, parent, child, relation, weight``);
* BTTR / CoMER ``data.zip``: ``data/<split>/caption.txt`` (``<id><TAB>tokens``) + ``<id>.bmp``;
* TAMER / ICAL: ``<split>/images.pkl`` (a pickled dict id -> uint8 array) + ``caption.txt``.
"""
from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tellkit.data.layouts import load_split
from tellkit.errors import TellkitError

# a few strokes: an "x" (two crossing lines), a "+", a "2"-ish curve
STROKES = [[(0, 0), (10, 12)], [(10, 0), (0, 12)], [(14, 6), (22, 6)], [(18, 2), (18, 10)],
           [(26, 2), (32, 0), (34, 5), (26, 12), (35, 12)]]


def _traces(strokes, with_time=True) -> str:
    out = []
    for i, s in enumerate(strokes):
        pts = ", ".join(f"{x} {y} {i * 100 + j * 10}" if with_time else f"{x} {y}" for j, (x, y) in enumerate(s))
        out.append(f'<trace id="{i}">{pts}</trace>' if not with_time else f"<trace>{pts}</trace>")
    return "\n".join(out)


def write_mathwriting(path: Path, label: str | None, normalized: str | None, split: str) -> None:
    notes = []
    if label is not None:
        notes.append(f'<annotation type="label">{label}</annotation>')
    if normalized is not None:
        notes.append(f'<annotation type="normalizedLabel">{normalized}</annotation>')
    notes += [f'<annotation type="splitTagOriginal">{split}</annotation>',
              f'<annotation type="sampleId">{path.stem}</annotation>',
              '<annotation type="inkCreationMethod">human</annotation>']
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('<ink xmlns="http://www.w3.org/2003/InkML">\n' + "\n".join(notes) + "\n" + _traces(STROKES)
                    + "\n</ink>\n", encoding="utf-8")


@pytest.fixture()
def mathwriting(tmp_path) -> Path:
    root = tmp_path / "mathwriting-2024"
    write_mathwriting(root / "test" / "00a1b2c3d4e5f601.inkml", r"x+{2}", r"x+2", "test")
    write_mathwriting(root / "test" / "00a1b2c3d4e5f602.inkml", r"\frac{x}{2}", r"\frac{x}{2}", "test")
    write_mathwriting(root / "test" / "00a1b2c3d4e5f603.inkml", r"\alpha\le\beta", r"\alpha\leq\beta", "test")
    write_mathwriting(root / "train" / "0fedcba987654321.inkml", r"x^2", r"x^{2}", "train")
    write_mathwriting(root / "synthetic" / "1fedcba987654321.inkml", r"\sqrt{x}", r"\sqrt{x}", "synthetic")
    write_mathwriting(root / "symbols" / "2fedcba987654321.inkml", r"\aleph", None, "symbols")
    write_mathwriting(root / "valid" / "3fedcba987654321.inkml", None, None, "valid")  # no label at all
    return root


def test_mathwriting_reads_the_normalized_label_and_skips_files_without_one(mathwriting):
    got = {e.id: e.tokens for e in load_split(mathwriting, "test", "mathwriting")}
    assert got == {"00a1b2c3d4e5f601": ["x", "+", "2"],
                   "00a1b2c3d4e5f602": ["\\frac", "{", "x", "}", "{", "2", "}"],
                   "00a1b2c3d4e5f603": ["\\alpha", "\\leq", "\\beta"]}
    # several folders joined by +; symbols/ has only `label`
    train = load_split(mathwriting, "train+synthetic+symbols", "mathwriting")
    assert [e.tokens for e in train] == [["x", "^", "{", "2", "}"], ["\\sqrt", "{", "x", "}"], ["\\aleph"]]
    skipped: dict[str, int] = {}
    with pytest.raises(TellkitError, match="no usable MathWriting files"):
        load_split(mathwriting, "valid", "mathwriting", skipped)
    assert skipped == {"no label": 1}


def test_mathwriting_maps_a_crohme_split_name_to_the_releases_folder(mathwriting, capsys):
    assert len(load_split(mathwriting, "2014", "mathwriting", role="test")) == 3
    assert "'2014' is not a mathwriting split; reading 'test'" in capsys.readouterr().err
    with pytest.raises(TellkitError, match="no MathWriting folder 'nope'"):
        load_split(mathwriting, "nope", "mathwriting")


def test_the_releases_labels_keep_their_structure():
    """Accents, fonts and matrices (MathWriting's normalizedLabel, HME100K's spaced LaTeX) keep
    their arguments and rows; the normal form reads back to itself."""
    from tellkit.data.latex import normalize

    cases = {r"\hat{ab}+\mathbb{R}": r"\hat { a b } + \mathbb { R }",
             r"\begin{matrix}a&b\\c&d\end{matrix}": r"\begin{matrix} a & b \\ c & d \end{matrix}",
             r"\overline { x y } _ { 1 }": r"\overline { x y } _ { 1 }",
             r"\vec v": r"\vec { v }"}
    for raw, want in cases.items():
        got = normalize(raw)
        assert " ".join(got) == want and normalize(" ".join(got)) == got


def _jpg(path: Path, seed: int = 0) -> None:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (80, 40), (250, 248, 240))
    d = ImageDraw.Draw(im)
    d.line([(10, 10 + seed), (60, 30)], fill=(20, 20, 30), width=3)
    im.save(path, quality=90)


@pytest.fixture()
def hme100k(tmp_path) -> Path:
    root = tmp_path / "HME100K"
    for split, rows in (("train", [("train_0.jpg", "x ^ { 2 }"), ("train_1.jpg", "\\frac { 1 } { 2 }")]),
                        ("test", [("test_0.jpg", "a + b"), ("test_1.jpg", "y = 长 \\times 2")])):
        (root / f"{split}_images").mkdir(parents=True)
        for i, (name, _) in enumerate(rows):
            _jpg(root / f"{split}_images" / name, i)
        (root / f"{split}_labels.txt").write_text("".join(f"{n}\t{t}\n" for n, t in rows), encoding="utf-8")
    return root


def test_hme100k_reads_labels_and_photos_chinese_characters_as_tokens(hme100k):
    got = {e.id: (e.image.name, e.tokens) for e in load_split(hme100k, "test", "hme100k")}
    assert got == {"test_0": ("test_0.jpg", ["a", "+", "b"]),
                   "test_1": ("test_1.jpg", ["y", "=", "长", "\\times", "2"])}
    assert len(load_split(hme100k, "2014", "hme100k", role="test")) == 2
    (hme100k / "test_labels.txt").write_text("test_0.jpg a + b\n", encoding="utf-8")
    with pytest.raises(TellkitError, match="line 1 is not '<name>.jpg<TAB><LaTeX>'"):
        load_split(hme100k, "test", "hme100k")


LG = """# IUD, 2019_0001
# Objects(8):
O, x_1, x, 1.0, 0, 1
O, +_1, +, 1.0, 2, 3
O, -_1, -, 1.0, 4
O, 1_1, 1, 1.0, 5
O, 2_1, 2, 1.0, 6
O, \\sqrt_1, \\sqrt, 1.0, 7
O, y_1, y, 1.0, 8
O, n_1, n, 1.0, 9

# Relations from SRT:
R, x_1, n_1, Sup, 1.0
R, x_1, +_1, Right, 1.0
R, +_1, -_1, Right, 1.0
R, -_1, 1_1, Above, 1.0
R, -_1, 2_1, Below, 1.0
R, -_1, \\sqrt_1, Right, 1.0
R, \\sqrt_1, y_1, Inside, 1.0
"""


def test_crohme2019_takes_the_truth_from_the_label_graph(tmp_path):
    from tellkit.data.crohme2019 import lg_to_latex

    assert lg_to_latex(LG) == "x ^ {n} + \\frac {1} {2} \\sqrt {y}"
    root = tmp_path / "crohme2019"
    (root / "Test2019").mkdir(parents=True)
    (root / "Test2019_GT").mkdir()
    ink = '<ink xmlns="http://www.w3.org/2003/InkML">\n' + _traces(STROKES, with_time=False) + "\n</ink>\n"
    (root / "Test2019" / "2019_0001.inkml").write_text(ink, encoding="utf-8")
    (root / "Test2019" / "2019_0002.inkml").write_text(ink, encoding="utf-8")  # no label graph
    (root / "Test2019_GT" / "2019_0001.lg").write_text(LG, encoding="utf-8")
    skipped: dict[str, int] = {}
    exprs = load_split(root, "Test2019", "crohme2019", skipped)
    assert [(e.id, " ".join(e.tokens)) for e in exprs] == [
        ("2019_0001", "x ^ { n } + \\frac { 1 } { 2 } \\sqrt { y }")]
    assert skipped == {"no label graph": 1}
    with pytest.raises(TellkitError, match="no object lines"):
        lg_to_latex("# only strokes\nN, 0, x, 1.0\n", "a.lg")


def _bmp(seed: int) -> bytes:
    import io

    from PIL import Image, ImageDraw

    im = Image.new("L", (48, 24), 0)  # the releases' bitmaps: white ink on black
    ImageDraw.Draw(im).line([(4, 4 + seed), (40, 20)], fill=255, width=2)
    buf = io.BytesIO()
    im.save(buf, format="BMP")
    return buf.getvalue()


def test_a_bttr_data_zip_is_read_in_place(tmp_path):
    z = tmp_path / "data.zip"
    with zipfile.ZipFile(z, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for split, rows in (("train", [("a_1", "x ^ { 2 }")]),
                            ("2014", [("18_em_0", "a + b"), ("18_em_1", "\\sqrt { x }")])):
            zf.writestr(f"data/{split}/caption.txt", "".join(f"{k}\t{t}\n" for k, t in rows))
            for i, (k, _) in enumerate(rows):
                zf.writestr(f"data/{split}/{k}.bmp", _bmp(i))
    exprs = load_split(z, "2014", "caption")
    assert [(e.id, e.tokens) for e in exprs] == [("18_em_0", ["a", "+", "b"]), ("18_em_1", ["\\sqrt", "{", "x", "}"])]
    assert not (tmp_path / "data").exists()  # nothing unzipped
    from tellkit.data.crohme import CrohmeDataset

    ds = CrohmeDataset(exprs)
    assert ds[0]["image"].shape[0] == 1 and ds[0]["image"].max() > 0.5  # ink high after the auto flip
    with pytest.raises(TellkitError, match="no split '2016' in the archive"):
        load_split(z, "2016", "caption")
    with pytest.raises(TellkitError, match="only the caption layout reads an archive"):
        load_split(z, "2014", "hme100k")


def test_tamer_images_pkl_is_read_through_the_restricted_unpickler(tmp_path):
    d = tmp_path / "crohme" / "2014"
    d.mkdir(parents=True)
    img = np.zeros((20, 30), np.uint8)
    img[5:15, 10] = 255
    (d / "images.pkl").write_bytes(pickle.dumps({"18_em_0": img, "18_em_1": img.copy()}))
    (d / "caption.txt").write_text("18_em_0\tx + 1\n18_em_1\t\\alpha\n", encoding="utf-8")
    from tellkit.data.crohme import CrohmeDataset

    exprs = load_split(tmp_path / "crohme", "2014", "caption")
    assert [e.tokens for e in exprs] == [["x", "+", "1"], ["\\alpha"]]
    assert CrohmeDataset(exprs)[0]["image"].sum() > 0


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_images_pkl_that_would_run_code_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    from tellkit.data.released import ARRAY_NAMES, load_pickle_dir
    from tellkit.utils.safe_unpickle import restricted_load

    monkeypatch.chdir(tmp_path)
    d = tmp_path / "2014"
    d.mkdir()
    (d / "caption.txt").write_text("a\tx\n", encoding="utf-8")
    (d / "images.pkl").write_bytes(pickle.dumps({"a": _RunsCode()}))
    with pytest.raises(TellkitError, match=r"images.pkl: the pickle names posix\.system"):
        load_pickle_dir(d)
    assert not (tmp_path / "PWNED").exists()
    (d / "images.pkl").write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(TellkitError, match="names builtins.eval"):
        load_pickle_dir(d)
    (d / "images.pkl").write_bytes(pickle.dumps({"a": np.array([1, "x"], dtype=object)}))
    with pytest.raises(TellkitError, match="no image array for 'a'"):
        load_pickle_dir(d)[0].image.load()
    # what it accepts: arrays in every protocol's spelling, numpy numbers, strings, plain containers
    for proto in (2, 4, 5):
        import io

        blob = pickle.dumps({"a": np.arange(6, dtype=np.uint8).reshape(2, 3), "n": np.float32(2.5), "s": "text",
                             "l": [1, 2.0]}, protocol=proto)
        got = restricted_load(io.BytesIO(blob), ARRAY_NAMES, "t.pkl")
        assert got["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and got["n"] == 2.5 and got["s"] == "text"


def _tiny_checkpoint(folder: Path) -> Path:
    import torch

    from tellkit.registry import create_model

    torch.manual_seed(0)
    extra = {"task": "recognize", "eval": {"beam_size": 2, "max_len": 8}, "data": {"cache": None}}
    return create_model("bttr/tiny").save_pretrained(folder, extra=extra)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mathwriting", "hme100k"])
def test_evaluate_reads_a_release_laid_out_as_it_ships(tmp_path, mathwriting, hme100k, layout, capsys):
    from tellkit.cli import main

    ck = _tiny_checkpoint(tmp_path / "ck")
    data = mathwriting if layout == "mathwriting" else hme100k
    code = main(["evaluate", str(ck), f"data.layout={layout}", "--data", str(data), "--split", "test",
                 "--out", str(tmp_path / "out"), "--device", "cpu", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "out" / "predictions_test.jsonl").read_text().splitlines()]
    want = {"mathwriting": {"x + 2", "\\frac { x } { 2 }", "\\alpha \\leq \\beta"},
            "hme100k": {"a + b", "y = 长 \\times 2"}}[layout]
    assert {r["reference"] for r in rows} == want
    metrics = json.loads((tmp_path / "out" / "metrics_test.json").read_text())
    if layout == "hme100k":  # 长 is outside the model's vocabulary: counted, said, never dropped
        assert metrics["metrics"]["unknown_symbols"] == 1 and metrics["metrics"]["unknown_expressions"] == 1
        assert "symbol(s) outside the model's vocabulary: 长 1" in capsys.readouterr().err
        assert [r["unknown"] for r in rows if "unknown" in r] == [["长"]]
    else:
        assert "unknown_symbols" not in metrics["metrics"]
