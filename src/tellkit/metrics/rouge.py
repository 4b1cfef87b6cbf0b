"""ROUGE-1/2/L for summaries, in two labelled implementations.

``rouge_reference``: what the VG-GPLMs evaluation reports (Yu et al., EMNLP 2021): each
summary is split on whitespace only (no lower-casing, no stemming, punctuation tokens kept),
ROUGE-N uses clipped n-gram counts, ROUGE-L the longest common subsequence, each as the F1
(alpha = 0.5) of one (prediction, reference) pair, then averaged over pairs: the behaviour of the
``rouge`` package's sentence-level functions that the evaluation script calls (0 when a side
has no n-gram).

``rouge_score_package``: Google's ``rouge-score`` package (``pip install tellkit[metrics]``),
which lower-cases, drops non-alphanumeric characters and (here, by default) does not stem;
scores are the mean F-measure over pairs as well. The spec notes it reads ~1.3 points lower
than the reference implementation on How2 outputs.

Both return percentages (0-100) under keys ``rouge1``, ``rouge2``, ``rougeL``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from tellkit.errors import TellkitError
from tellkit.utils.optional import require

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


def _ngrams(tokens: Sequence[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _f1(overlap: float, n_pred: int, n_ref: int) -> float:
    if overlap <= 0 or n_pred == 0 or n_ref == 0:
        return 0.0
    p, r = overlap / n_pred, overlap / n_ref
    return 2 * p * r / (p + r)


def rouge_n_f1(pred: Sequence[str], ref: Sequence[str], n: int) -> float:
    """F1 of clipped n-gram overlap between two token lists."""
    cp, cr = _ngrams(pred, n), _ngrams(ref, n)
    overlap = sum(min(c, cr[g]) for g, c in cp.items())
    return _f1(overlap, sum(cp.values()), sum(cr.values()))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_f1(pred: Sequence[str], ref: Sequence[str]) -> float:
    return _f1(lcs_length(pred, ref), len(pred), len(ref))


def _check(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise TellkitError(f"ROUGE: {len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise TellkitError("ROUGE: no predictions to score")


def rouge_reference(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Sentence-averaged ROUGE F1 on whitespace tokens (the VG-GPLMs evaluation), in percent."""
    _check(predictions, references)
    sums = dict.fromkeys(ROUGE_KEYS, 0.0)
    for p, r in zip(predictions, references):
        pt, rt = p.split(), r.split()
        sums["rouge1"] += rouge_n_f1(pt, rt, 1)
        sums["rouge2"] += rouge_n_f1(pt, rt, 2)
        sums["rougeL"] += rouge_l_f1(pt, rt)
    return {k: 100.0 * v / len(predictions) for k, v in sums.items()}


def rouge_score_package(
    predictions: Sequence[str], references: Sequence[str], use_stemmer: bool = False
) -> dict[str, float]:
    """Mean F-measure from Google's ``rouge-score`` package, in percent."""
    _check(predictions, references)
    scorer_mod = require("rouge_score.rouge_scorer", "metrics", "ROUGE (rouge-score)")
    scorer = scorer_mod.RougeScorer(list(ROUGE_KEYS), use_stemmer=use_stemmer)
    sums = dict.fromkeys(ROUGE_KEYS, 0.0)
    for p, r in zip(predictions, references):
        s = scorer.score(r, p)  # (target, prediction)
        for k in ROUGE_KEYS:
            sums[k] += s[k].fmeasure
    return {k: 100.0 * v / len(predictions) for k, v in sums.items()}
