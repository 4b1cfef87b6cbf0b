"""ROUGE: both labelled implementations against values computed by hand, and the reference
implementation against a brute-force second implementation on random token sequences."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from tellkit.errors import TellkitError
from tellkit.metrics.rouge import lcs_length, rouge_reference, rouge_score_package

PREDS = ["the cat sat on the mat", "Learn to cook ."]
REFS = ["the cat is on the mat", "learn how to cook rice ."]


def test_reference_rouge_by_hand():
    # pair 1: 5/6 unigrams, 3/5 bigrams, LCS "the cat on the mat" = 5 of 6 both ways
    # pair 2 (case kept, "." is a token): unigrams to/cook/. -> P 3/4 R 3/6 -> F 3/5;
    # bigram "to cook" -> P 1/3 R 1/5 -> F 1/4; LCS "to cook ." -> F 3/5
    s = rouge_reference(PREDS, REFS)
    assert s["rouge1"] == pytest.approx(100 * (5 / 6 + 3 / 5) / 2)
    assert s["rouge2"] == pytest.approx(100 * (3 / 5 + 1 / 4) / 2)
    assert s["rougeL"] == pytest.approx(100 * (5 / 6 + 3 / 5) / 2)


def test_rouge_score_package_by_hand():
    # rouge-score lower-cases and drops punctuation: pair 2 becomes "learn to cook" vs
    # "learn how to cook rice": R1 P 1 R 3/5 -> 3/4; R2 P 1/2 R 1/4 -> 1/3; LCS 3 -> 3/4
    s = rouge_score_package(PREDS, REFS)
    assert s["rouge1"] == pytest.approx(100 * (5 / 6 + 3 / 4) / 2)
    assert s["rouge2"] == pytest.approx(100 * (3 / 5 + 1 / 3) / 2)
    assert s["rougeL"] == pytest.approx(100 * (5 / 6 + 3 / 4) / 2)


def test_identical_and_disjoint_and_empty():
    assert rouge_reference(["a b c"], ["a b c"]) == {"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0}
    assert rouge_reference(["x y"], ["a b c"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    assert rouge_reference([""], ["a b c"])["rouge1"] == 0.0
    with pytest.raises(TellkitError):
        rouge_reference(["a"], ["a", "b"])
    with pytest.raises(TellkitError):
        rouge_reference([], [])


def _lcs_brute(a, b):
    # longest subsequence of a (by trying subsets, longest first) that is a subsequence of b
    def is_sub(s, t):
        it = iter(t)
        return all(x in it for x in s)

    for k in range(min(len(a), len(b)), 0, -1):
        for idx in itertools.combinations(range(len(a)), k):
            if is_sub([a[i] for i in idx], b):
                return k
    return 0


def _f1(o, p, r):
    return 0.0 if o == 0 else 2 * (o / p) * (o / r) / (o / p + o / r)


def test_reference_against_brute_force():
    rng = random.Random(0)
    vocab = list("abcde")
    preds, refs = [], []
    for _ in range(30):
        preds.append([rng.choice(vocab) for _ in range(rng.randint(1, 8))])
        refs.append([rng.choice(vocab) for _ in range(rng.randint(1, 8))])
    expect = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for p, r in zip(preds, refs):
        assert lcs_length(p, r) == _lcs_brute(p, r)
        for n, key in ((1, "rouge1"), (2, "rouge2")):
            gp = [tuple(p[i : i + n]) for i in range(len(p) - n + 1)]
            gr = [tuple(r[i : i + n]) for i in range(len(r) - n + 1)]
            overlap = sum((Counter(gp) & Counter(gr)).values())
            expect[key] += _f1(overlap, len(gp), len(gr)) if gp and gr else 0.0
        expect["rougeL"] += _f1(_lcs_brute(p, r), len(p), len(r))
    got = rouge_reference([" ".join(p) for p in preds], [" ".join(r) for r in refs])
    for k in expect:
        assert got[k] == pytest.approx(100 * expect[k] / len(preds))


def test_reference_package_examples():
    """The examples that document the ROUGE package the VG-GPLMs evaluation imports
    (``rouge_n_sentence_level`` / ``rouge_l_sentence_level``, alpha 0.5): same F1 here."""
    from tellkit.metrics.rouge import lcs_length, rouge_l_f1, rouge_n_f1

    summary, reference = "gunman kill the police".split(), "the police killed the gunman".split()
    # recall, precision, F1 as the package documents them: ROUGE-2 (1/4, 1/3, 0.2857), ROUGE-1 (3/5, 3/4, 2/3)
    assert rouge_n_f1(summary, reference, 2) == pytest.approx(0.28571428571428575)
    assert rouge_n_f1(summary, reference, 1) == pytest.approx(0.6666666666666666)
    assert lcs_length("the police killed the gunman".split(), "gunman police killed".split()) == 2
    assert lcs_length(list("ABCDE"), list("CD")) == 2
    # ROUGE-L: LCS "the police" = 2 of 4 predicted and 5 reference words
    assert rouge_l_f1(summary, reference) == pytest.approx(2 * (2 / 4) * (2 / 5) / (2 / 4 + 2 / 5))
