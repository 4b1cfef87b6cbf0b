"""LaTeX tokenizer / normaliser / vocabulary."""
import csv

import pytest

from tellkit.data.latex import SYMBOLS, Vocab, lex, normalize, normalize_string
from tellkit.errors import TellkitError


@pytest.mark.parametrize("raw, want", [
    ("x^2", "x ^ { 2 }"),
    ("\\frac 1 2", "\\frac { 1 } { 2 }"),
    ("{x^{2}}", "x ^ { 2 }"),
    ("a \\lt b \\gt c", "a < b > c"),
    ("\\left( x \\right)", "( x )"),
    ("\\mbox { a } + \\mbox{B}", "a + B"),
    ("10.5", "1 0 . 5"),
    ("05", "5"),
    ("6.0", "6"),
    ("\\lim_{n \\to \\infty}", "\\lim _ { n \\rightarrow \\infty }"),
    ("x^\\frac{1}{3}", "x ^ { \\frac { 1 } { 3 } }"),
    ("\\sqrt[n]{x}", "\\sqrt [ n ] { x }"),
    ("\\sqrt {x} ABOVE {n}", "\\sqrt [ n ] { x }"),
    ("\\sqrt x", "\\sqrt { x }"),
    ("( l o g x )", "( \\log x )"),
    ("a_{tan}", "a _ { t a n }"),
    ("M\\ltN", "M < N"),
    ("\\sum\\limits_{i=1}^n", "\\sum \\limits _ { i = 1 } ^ { n }"),
    ("\\{ a \\}", "\\{ a \\}"),
    ("\\Bigg( x \\Bigg)", "( x )"),
    ("\\lim \\limits _ {y \\rightarrow x}} f", "\\lim \\limits _ { y \\rightarrow x } f"),
])
def test_normalize_cases(raw, want):
    assert normalize_string(raw) == want


def test_normalize_is_idempotent_on_normal_form():
    s = "\\frac { - b + \\sqrt { b ^ { 2 } - 4 a c } } { 2 a }"
    assert normalize_string(s) == s


def test_lex_splits_commands():
    assert lex("\\alpha+\\{x") == ["\\alpha", "+", "\\{", "x"]


def test_vocab():
    v = Vocab()
    assert len(SYMBOLS) == 110 and len(v) == 113
    ids = v.encode(["x", "^", "{", "2", "}"])
    assert min(ids) > 2 and v.decode([v.sos] + ids + [v.eos]) == ["x", "^", "{", "2", "}"]
    with pytest.raises(TellkitError):
        v.encode(["\\Pi"])
    with pytest.raises(TellkitError):
        normalize("\\Pi", strict=True)


@pytest.mark.data
def test_train_truth_matches_reference_tokenization(shared_data):
    d = shared_data / "crohme"
    csv.field_size_limit(1 << 24)
    with open(d / "groundtruth_train.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    ref = {}
    for line in (d / "train_caption_tokenized.txt").read_text(encoding="utf-8").splitlines():
        k, v = line.split("\t", 1)
        ref[k] = v.split()
    assert len(rows) == len(ref) == 8835
    same = sum(normalize(raw) == ref[key.split("/")[-1]] for key, raw in rows)
    assert same / len(rows) >= 0.99, same
    vocab = set(SYMBOLS)
    assert all(set(toks) <= vocab for toks in ref.values())
