"""The three loaders of InkML splits (data.layout ``inkml``, ``crohme2019``, ``mathwriting``) on
small files written here: which files become expressions, in which order, with which id, tokens
and raw truth, which are skipped and counted under which reason, and the errors of a split with
nothing usable. The real CROHME InkML folders are read in the ``data`` tests at the end."""
from __future__ import annotations

from pathlib import Path

import pytest

from tellkit.data import crohme, crohme2019, mathwriting
from tellkit.data.latex import normalize
from tellkit.errors import TellkitError

NS = "http://www.w3.org/2003/InkML"
TRACES = '<trace id="0">10 10, 30 40</trace><trace id="1">30 10, 10 40</trace>'
BAD = "UNPARSABLE"  # a truth that the stand-in normaliser below refuses


def ink(truth: str | None = None, traces: str = TRACES, notes: dict[str, str] | None = None) -> str:
    ann = f'<annotation type="truth">{truth}</annotation>' if truth is not None else ""
    ann += "".join(f'<annotation type="{k}">{v}</annotation>' for k, v in (notes or {}).items())
    return f'<ink xmlns="{NS}"><traceFormat><channel name="X"/><channel name="Y"/></traceFormat>{ann}{traces}</ink>'


def put(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture()
def refusing_normalize(monkeypatch):
    """LaTeX normalisation that refuses ``BAD`` (the real one parses nearly anything), wherever a
    loader module holds the name."""
    def fake(text: str, strict: bool = False) -> list[str]:
        if BAD in text:
            raise TellkitError(f"cannot parse LaTeX {text!r}")
        return normalize(text, strict)

    for mod in (crohme, crohme2019, mathwriting):
        monkeypatch.setattr(mod, "normalize", fake, raising=False)


def rows(exprs) -> list[tuple[str, str, str, str]]:
    """(id, file name relative to its split's parent, tokens, raw) of each expression."""
    return [(e.id, f"{Path(e.image).parent.name}/{Path(e.image).name}", " ".join(e.tokens), e.raw) for e in exprs]


# --- data.layout: inkml (CROHME) -------------------------------------------------------------------
@pytest.fixture()
def crohme_root(tmp_path) -> Path:
    r = tmp_path / "crohme"
    put(r / "train" / "A" / "e1.inkml", ink("$x^2$"))
    put(r / "train" / "A" / "e2.inkml", ink(BAD))
    put(r / "train" / "A" / "empty.inkml", "")
    put(r / "train" / "B" / "broken.inkml", "<ink><trace>1 2, 3")
    put(r / "train" / "B" / "e1.inkml", ink("y"))  # the same file name as A/e1
    put(r / "train" / "B" / "notrace.inkml", ink("z", traces=""))
    put(r / "train" / "B" / "notruth.inkml", ink(None))
    put(r / "train" / "B" / "z.inkml", ink(r"\frac{1}{2}"))
    put(r / "test" / "2014" / "t1.inkml", ink("a"))
    put(r / "test" / "2014" / "t0.inkml", ink("b"))
    return r


def test_inkml_split_order_ids_tokens_and_skipped_reasons(crohme_root, refusing_normalize):
    skipped: dict[str, int] = {}
    exprs = crohme.load_split(crohme_root, "train", "inkml", skipped)
    assert rows(exprs) == [("A/e1", "A/e1.inkml", "x ^ { 2 }", "x^2"),
                           ("B/e1", "B/e1.inkml", "y", "y"),
                           ("z", "B/z.inkml", "\\frac { 1 } { 2 }", "\\frac{1}{2}")]
    assert list(skipped.items()) == [("empty file", 1), ("malformed XML", 1), ("no traces", 1), ("no truth", 1),
                                     ("unparsable truth", 1)]
    # each expression keeps the strokes and truth as read; its image is the InkML file
    assert [(e.ink.id, e.ink.truth, len(e.ink.strokes), e.image == e.ink.path) for e in exprs] == [
        ("e1", "x^2", 2, True), ("e1", "y", 2, True), ("z", "\\frac{1}{2}", 2, True)]
    # a year under test/ is found too, its files in name order
    assert rows(crohme.load_split(crohme_root, "2014", "inkml")) == [("t0", "2014/t0.inkml", "b", "b"),
                                                                      ("t1", "2014/t1.inkml", "a", "a")]


def test_inkml_split_errors(crohme_root, refusing_normalize):
    with pytest.raises(TellkitError, match=r"no InkML split 'nope' \(looked for .*nope and .*test/nope\)"):
        crohme.load_split(crohme_root, "nope", "inkml")
    bad = crohme_root / "bad"
    put(bad / "a.inkml", "")
    put(bad / "b.inkml", ink(BAD))
    skipped: dict[str, int] = {}
    with pytest.raises(TellkitError) as err:
        crohme.load_split(crohme_root, "bad", "inkml", skipped)
    assert str(err.value) == f"{bad}: no usable InkML files (skipped: {{'empty file': 1, 'unparsable truth': 1}})"
    assert skipped == {"empty file": 1, "unparsable truth": 1}  # counted before the error
    put(crohme_root / "none" / "readme.txt", "no InkML here")
    with pytest.raises(TellkitError) as err:
        crohme.load_split(crohme_root, "none", "inkml")
    assert str(err.value) == f"{crohme_root / 'none'}: no usable InkML files"


def test_skip_counts_of_several_loads_into_one_dict_add_up(crohme_root, c19_root, refusing_normalize):
    """A task counts the skipped files of its split and of data.extra_train in one dict."""
    skipped: dict[str, int] = {}
    crohme.load_split(crohme_root, "train", "inkml", skipped)
    crohme.load_split(crohme_root, "train", "inkml", skipped)
    crohme2019.load_split(c19_root, "Test2019", skipped)
    assert skipped == {"empty file": 2, "malformed XML": 3, "no traces": 2, "no truth": 2, "unparsable truth": 3,
                       "no label graph": 2, "unusable label graph": 1}


# --- data.layout: crohme2019 (truth in label graphs) ------------------------------------------------
LG_X2 = "O, x_1, x, 1.0, 0\nO, 2_1, 2, 1.0, 1\nR, x_1, 2_1, Sup, 1.0\n"
LG_Y = "O, y_1, y, 1.0, 0, 1\n"


@pytest.fixture()
def c19_root(tmp_path) -> Path:
    r = tmp_path / "c19"
    t = r / "Test2019"
    put(t / "a.inkml", ink())  # truth from a.lg
    put(t / "b.inkml", ink("q"))  # its own truth, no label graph
    put(t / "c.inkml", ink("ignored"))  # the label graph wins over the file's own truth
    put(t / "d.inkml", ink())  # neither
    put(t / "e.inkml", ink())  # a label graph without objects
    put(t / "f.inkml", ink())  # a label graph whose LaTeX does not parse
    put(t / "g.inkml", ink("$ $"))  # an empty truth and no label graph
    put(t / "h.inkml", "<ink")
    put(t / "sub" / "a.inkml", ink())  # the same name in a sub-folder: the same label graph, the same id
    put(r / "GT1" / "a.lg", LG_X2)
    put(r / "GT2" / "a.lg", LG_Y)  # a second a.lg, later in path order: not read
    put(r / "GT1" / "c.lg", LG_Y)
    put(r / "GT1" / "e.lg", "# strokes only\nN, 0, x, 1.0\n")
    put(r / "GT1" / "f.lg", f"O, b_1, {BAD}, 1.0, 0\n")
    return r


def test_crohme2019_truths_order_and_skipped_reasons(c19_root, refusing_normalize):
    skipped = {"earlier": 2, "no label graph": 1}
    exprs = crohme2019.load_split(c19_root, "Test2019", skipped)
    assert rows(exprs) == [("a", "Test2019/a.inkml", "x ^ { 2 }", "x ^ {2}"),
                           ("b", "Test2019/b.inkml", "q", "q"),
                           ("c", "Test2019/c.inkml", "y", "y"),
                           ("a", "sub/a.inkml", "x ^ { 2 }", "x ^ {2}")]
    assert [e.ink.truth for e in exprs] == ["x ^ {2}", "q", "y", "x ^ {2}"]  # the truth used is stored
    # counts are added to those already in ``skipped``
    assert skipped == {"earlier": 2, "no label graph": 3, "malformed XML": 1, "unusable label graph": 1,
                       "unparsable truth": 1}
    with pytest.raises(TellkitError, match=r"no CROHME 2019 split 'nope' \(looked for"):
        crohme2019.load_split(c19_root, "nope")
    # the split may be a year under test/
    put(c19_root / "test" / "2019" / "a.inkml", ink())
    assert rows(crohme2019.load_split(c19_root, "2019")) == [("a", "2019/a.inkml", "x ^ { 2 }", "x ^ {2}")]


def test_crohme2019_nothing_usable(c19_root, refusing_normalize):
    put(c19_root / "bad" / "d.inkml", ink())
    put(c19_root / "bad" / "h.inkml", "")
    skipped = {"earlier": 1}
    with pytest.raises(TellkitError) as err:
        crohme2019.load_split(c19_root, "bad", skipped)
    assert str(err.value) == (f"{c19_root / 'bad'}: no usable CROHME 2019 expressions "
                              "(skipped: {'empty file': 1, 'no label graph': 1})")
    assert skipped == {"earlier": 1, "empty file": 1, "no label graph": 1}


# --- data.layout: mathwriting -------------------------------------------------------------------
def mw(label: str | None = None, normalized: str | None = None, traces: str = TRACES) -> str:
    notes = {k: v for k, v in (("label", label), ("normalizedLabel", normalized)) if v is not None}
    return ink(None, traces, {**notes, "sampleId": "s"})


@pytest.fixture()
def mw_root(tmp_path) -> Path:
    r = tmp_path / "mathwriting-2024"
    put(r / "train" / "b.inkml", mw("x^{2}", "x^2"))  # normalizedLabel wins
    put(r / "train" / "a.inkml", mw("y", None))  # only label
    put(r / "train" / "c.inkml", mw(None, None))  # no label
    put(r / "train" / "d.inkml", mw(None, "  "))  # a blank label is none
    put(r / "train" / "e.inkml", mw("z", BAD))
    put(r / "train" / "f.inkml", mw("z", "z", traces=""))
    put(r / "symbols" / "s.inkml", mw("\\aleph"))
    put(r / "symbols" / "t.inkml", "")
    put(r / "valid" / "v.inkml", mw(None, None))
    return r


def test_mathwriting_folders_in_the_order_named_labels_and_skipped_reasons(mw_root, refusing_normalize):
    skipped = {"earlier": 1, "no label": 1}
    exprs = mathwriting.load_split(mw_root, "symbols + train", skipped)
    assert rows(exprs) == [("s", "symbols/s.inkml", "\\aleph", "\\aleph"),
                           ("a", "train/a.inkml", "y", "y"),
                           ("b", "train/b.inkml", "x ^ { 2 }", "x^2")]
    assert [e.ink.truth for e in exprs] == ["\\aleph", "y", "x^2"]
    assert skipped == {"earlier": 1, "no label": 3, "empty file": 1, "no traces": 1, "unparsable label": 1}
    with pytest.raises(TellkitError, match="no MathWriting folder 'nope' \\(the release has train, valid, test, "
                                           "synthetic, symbols\\)"):
        mathwriting.load_split(mw_root, "train+nope")


def test_mathwriting_nothing_usable(mw_root, refusing_normalize):
    skipped: dict[str, int] = {}
    with pytest.raises(TellkitError) as err:
        mathwriting.load_split(mw_root, "valid", skipped)
    assert str(err.value) == f"{mw_root}: no usable MathWriting files in 'valid' (skipped: {{'no label': 1}})"
    assert skipped == {"no label": 1}


# --- the real CROHME InkML folders ----------------------------------------------------------------
@pytest.mark.data
def test_real_crohme_extra_and_2014_read_whole(shared_data):
    skipped: dict[str, int] = {}
    extra = crohme.load_split(shared_data / "crohme_extra", "train", "inkml", skipped)
    assert len(extra) == 780 and skipped == {}
    assert len({e.id for e in extra}) == 780
    test = crohme.load_split(shared_data / "crohme_inkml", "2014", "inkml")
    assert len(test) == 986 and [e.id for e in test] == sorted(e.id for e in test)
    # the CROHME 2019 reader keeps a file's own truth when no label graph is found: on the 2014
    # test folder (no .lg files) it reads what the inkml layout reads
    again = crohme2019.load_split(shared_data / "crohme_inkml", "2014")
    assert [(e.id, e.tokens, e.raw) for e in again] == [(e.id, e.tokens, e.raw) for e in test]


def test_a_truth_nested_too_deeply_is_counted_unparsable_not_a_crash(tmp_path):
    deep = "{" * 3000 + "x" + "}" * 3000
    with pytest.raises(TellkitError, match=r"nested too deeply") as err:
        normalize(deep)
    assert len(str(err.value)) < 300  # one readable line, not the 6,000-character truth
    r = tmp_path / "crohme"
    put(r / "train" / "ok.inkml", ink("x"))
    put(r / "train" / "deep.inkml", ink(deep))
    skipped: dict[str, int] = {}
    assert [e.id for e in crohme.load_split(r, "train", "inkml", skipped)] == ["ok"]
    assert skipped == {"unparsable truth": 1}


def test_an_unreadable_label_graph_is_skipped(c19_root):
    (c19_root / "GT1" / "c.lg").unlink()
    (c19_root / "GT1" / "c.lg").mkdir()  # a folder where the label graph should be: reading it fails
    skipped: dict[str, int] = {}
    ids = [e.id for e in crohme2019.load_split(c19_root, "Test2019", skipped)]
    assert "c" not in ids and skipped["unusable label graph"] == 2
