"""Expression recognition rate (CROHME): exact match of the token sequence, and the share of
expressions within 1 and 2 token edits (Levenshtein distance over tokens), as BTTR reports."""
from __future__ import annotations

from collections.abc import Sequence


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
