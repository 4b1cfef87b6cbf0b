"""How ``tellkit caption`` and ``tellkit recognize`` print an answer without ``--json``.

One input: its text on standard output, and how sure the model is on standard error
(``confidence 0.83``, or ``unsure (confidence 0.12): this looks unlike what the model learned``),
so that ``tellkit recognize formula.png > formula.tex`` keeps the answer alone. Several inputs:
one ``PATH<TAB>TEXT<TAB>SURENESS`` line each, SURENESS being the confidence (``0.83``) followed
by `` unsure`` for a flagged answer (``-`` for a model without calibration whose answer is not
flagged). See :mod:`tellkit.decoding.confidence`.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from tellkit.decoding.confidence import describe


def sureness_column(result: Mapping[str, Any]) -> str:
    conf = result.get("confidence")
    parts = [f"{conf:.2f}"] if isinstance(conf, (int, float)) else []
    if result.get("unsure"):
        parts.append("unsure")
    return " ".join(parts) or "-"


def print_plain(path: str, result: Mapping[str, Any], several: bool) -> None:
    if several:
        print(f"{path}\t{result['text']}\t{sureness_column(result)}")
        return
    print(result["text"])
    words = describe(result)
    if words:
        sys.stdout.flush()
        print(words, file=sys.stderr)
