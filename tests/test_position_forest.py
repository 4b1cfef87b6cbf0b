"""PosFormer's position-forest targets against a re-statement of the reference's computation
(SJTU-DeepVisionLab/PosFormer, label_make_muti.py: a label list per token, built level by level,
then layer = len - 1 capped at 4 and position = the second-to-last label)."""
from __future__ import annotations

import pytest

from tellkit.data.position_forest import LOWER, MAIN, UPPER, position_forest


def _reference(tokens: list[str]) -> tuple[list[int], list[int]]:
    """The reference's rule, re-stated on token strings: every token of a level gets 3, tokens
    inside a group first get the group's label (4 upper: ^, numerator, root index; 5 lower: _,
    denominator, radicand), then their own level's labels."""
    labels: list[list[int]] = [[] for _ in tokens]

    def close(i, end, a, b):
        n, j = 1, i + 1
        while n > 0 and j < end:
            n += (tokens[j] == a) - (tokens[j] == b)
            j += 1
        return j - 1 if n == 0 else 0

    def level(start, end):
        i = start + 1
        while i < end:
            t = tokens[i]
            if t in ("^", "_"):
                e = close(i + 1, end, "{", "}")
                for k in (i, i + 1, e):
                    labels[k].append(3)
                for k in range(i + 2, e):
                    labels[k].append(4 if t == "^" else 5)
                level(i + 1, e)
                i = e + 1
            elif t == "\\frac" or (t == "\\sqrt" and tokens[i + 1] == "["):
                a, b = ("[", "]") if t == "\\sqrt" else ("{", "}")
                e1 = close(i + 1, end, a, b)
                e2 = close(e1 + 1, end, "{", "}")
                for k in (i, i + 1, e1, e1 + 1, e2):
                    labels[k].append(3)
                for k in range(i + 2, e1):
                    labels[k].append(4)
                for k in range(e1 + 2, e2):
                    labels[k].append(5)
                level(i + 1, e1)
                level(e1 + 1, e2)
                i = e2 + 1
            elif t == "\\sqrt":
                e = close(i + 1, end, "{", "}")
                for k in (i, i + 1, e):
                    labels[k].append(3)
                for k in range(i + 2, e):
                    labels[k].append(5)
                level(i + 1, e)
                i = e + 1
            else:
                labels[i].append(3)
                i += 1

    level(-1, len(tokens))
    layers, positions = [], []
    for lab in labels:
        if len(lab) == 1:
            layers.append(0)
            positions.append(lab[0] - 3)
        elif len(lab) <= 5:
            layers.append(len(lab) - 1)
            positions.append(lab[-2] - 3)
        else:
            layers.append(4)
            positions.append(lab[3] - 3)
    return layers, positions


CASES = [
    "x",
    "x ^ { 2 } + 1",
    "\\frac { a + b } { c _ { i } }",
    "\\sqrt { x ^ { 2 } + y ^ { 2 } }",
    "\\sqrt [ 3 ] { \\frac { 1 } { 2 } }",
    "e ^ { x ^ { y ^ { z ^ { w ^ { v } } } } }",  # deeper than the cap of 4
    "\\sum _ { i = 1 } ^ { n } a _ { i } { b }",  # a brace that opens no argument
    "\\frac { \\frac { 1 } { x } } { \\sqrt [ n ] { a _ { 1 } ^ { 2 } } } - \\{ x \\}",
]


@pytest.mark.parametrize("text", CASES)
def test_targets_equal_the_reference_rule(text):
    tokens = text.split()
    assert position_forest(tokens) == _reference(tokens)


def test_targets_by_hand():
    layers, pos = position_forest("x ^ { 2 } + \\frac { a } { b }".split())
    assert layers == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0]
    assert pos == [MAIN, MAIN, MAIN, UPPER, MAIN, MAIN, MAIN, MAIN, UPPER, MAIN, MAIN, LOWER, MAIN]
    # six deep: layer capped at 4, position of the fourth group from the outside
    layers, pos = position_forest("a ^ { b _ { c ^ { d _ { e ^ { f _ { g } } } } } }".split())
    assert layers[-7] == 4 and pos[-7] == LOWER  # g: groups ^ _ ^ _ ^ _, the fourth is _
    # unclosed or missing arguments open nothing
    assert position_forest("x ^ { 2".split()) == ([0, 0, 0, 0], [MAIN] * 4)
    assert position_forest("\\frac { 1 }".split()) == ([0, 0, 0, 0], [MAIN] * 4)
    assert position_forest([]) == ([], [])


@pytest.mark.data
def test_crohme_expressions_equal_the_reference_rule(shared_data):
    from tellkit.data.crohme import load_split

    exprs = load_split(shared_data / "crohme_inkml", "2014", "inkml")  # all 986 of 2014 test
    deep = 0
    for e in exprs:
        got = position_forest(e.tokens)
        assert got == _reference(list(e.tokens)), " ".join(e.tokens)
        deep += max(got[0], default=0) >= 2
    assert deep > 10
