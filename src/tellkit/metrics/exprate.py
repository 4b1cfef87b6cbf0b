"""Expression recognition rate (CROHME): exact match of the token sequence, and the share of
expressions within 1 and 2 token edits (Levenshtein distance over tokens), as BTTR reports;
:func:`breakdown` splits them by length and structure of the true expression."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two token sequences (insert, delete, substitute = 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def exprate(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """-> {"exprate", "exprate_le1", "exprate_le2"} in percent, and "n"."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    n = len(references)
    if n == 0:
        return {"exprate": 0.0, "exprate_le1": 0.0, "exprate_le2": 0.0, "n": 0}
    d = [edit_distance(list(p), list(r)) for p, r in zip(predictions, references)]
    return {
        "exprate": 100.0 * sum(x == 0 for x in d) / n,
        "exprate_le1": 100.0 * sum(x <= 1 for x in d) / n,
        "exprate_le2": 100.0 * sum(x <= 2 for x in d) / n,
        "n": n,
    }


# length buckets of the TRUE token sequence: (name, lowest length, highest length or None)
LENGTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0-9", 0, 9), ("10-19", 10, 19), ("20-29", 20, 29), ("30-39", 30, 39), ("40+", 40, None))
LONG = 30  # "long" expressions: this many true tokens or more

# structures read from the TRUE token sequence; an expression can have several
STRUCTURES: dict[str, Callable[[Sequence[str]], bool]] = {
    "fraction": lambda t: "\\frac" in t,
    "script": lambda t: "^" in t or "_" in t,
    "root": lambda t: "\\sqrt" in t,
    "matrix": lambda t: any(x in ("\\begin", "\\end", "\\\\") or "matrix" in x or "array" in x for x in t),
}


def _group(pairs: list[tuple[Sequence[str], Sequence[str]]]) -> dict[str, Any]:
    """ExpRate, <= 1 error and the predicted / true length ratio (total tokens over total tokens)
    of a group of (prediction, reference) pairs; a group with no pairs has n 0 and no rates."""
    if not pairs:
        return {"n": 0}
    d = [edit_distance(list(p), list(r)) for p, r in pairs]
    true_len = sum(len(r) for _, r in pairs)
    return {"n": len(pairs), "exprate": 100.0 * sum(x == 0 for x in d) / len(d),
            "exprate_le1": 100.0 * sum(x <= 1 for x in d) / len(d),
            "length_ratio": sum(len(p) for p, _ in pairs) / true_len if true_len else None}


def breakdown(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Where a recogniser fails: :func:`_group`'s figures by length bucket of the true tokens
    (``by_length``), by structure of the true expression (``by_structure``: fractions, scripts
    ``^`` / ``_``, roots, matrices or arrays) and for the expressions of :data:`LONG` tokens or more
    (``long``)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    pairs = list(zip(predictions, references))
    by_length = {name: _group([(p, r) for p, r in pairs if lo <= len(r) and (hi is None or len(r) <= hi)])
                 for name, lo, hi in LENGTH_BUCKETS}
    by_structure = {name: _group([(p, r) for p, r in pairs if has(r)]) for name, has in STRUCTURES.items()}
    return {"by_length": by_length, "by_structure": by_structure,
            "long": {"min_tokens": LONG, **_group([(p, r) for p, r in pairs if len(r) >= LONG])}}
