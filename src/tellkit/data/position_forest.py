"""PosFormer's position forest, read from the LaTeX alone (Guan et al., ECCV 2024; reference code
SJTU-DeepVisionLab/PosFormer): for every symbol, how deeply it is nested and where it sits.

A structure opens groups: ``^ { .. }`` an upper one, ``_ { .. }`` a lower one, ``\\frac { num }
{ den }`` an upper then a lower one, ``\\sqrt [ index ] { radicand }`` an upper then a lower one,
``\\sqrt { radicand }`` a lower one. The structure's own tokens (``^``, ``\\frac``, the braces and
brackets of its groups) belong to the level around it; every token inside a group is one level
deeper, with the group's relation. A symbol's targets are:

* ``layer``: its depth (the number of groups around it), at most :data:`MAX_LAYER` (4), as the
  reference caps it;
* ``position``: :data:`MAIN` at depth 0, else the relation of the group around it
  (:data:`UPPER` or :data:`LOWER`), and beyond depth 4 that of the fourth group from the
  outside (the reference's rule).

A brace that opens no argument is a token like any other, and a structure whose argument is
missing or unclosed opens no group. The reference numbers positions 3, 4, 5 (0-2 mark its pad,
start and end tokens); here they are 0, 1, 2. It also gives the end token of each direction a
target (that of its padding or start token, by where the sequence lies in the batch); here the
end token and padding have none (``IGNORE``).
"""
from __future__ import annotations

from collections.abc import Sequence

MAIN, UPPER, LOWER = 0, 1, 2
NUM_POSITIONS = 3
MAX_LAYER = 4
NUM_LAYERS = MAX_LAYER + 1
IGNORE = -100  # no target (cross-entropy's ignore_index)


def _closing(tokens: Sequence[str], i: int, end: int, opener: str, closer: str) -> int | None:
    """The index of the token that closes the ``opener`` at ``i`` (before ``end``), or None."""
    if i >= end or tokens[i] != opener:
        return None
    depth = 0
    for j in range(i, end):
        depth += (tokens[j] == opener) - (tokens[j] == closer)
        if depth == 0:
            return j
    return None


def _groups(tokens: Sequence[str], i: int, end: int) -> list[tuple[int, int, int]]:
    """The groups the structure at ``i`` opens: (opening index, closing index, relation)."""
    t = tokens[i]
    if t in ("^", "_"):
        c = _closing(tokens, i + 1, end, "{", "}")
        return [] if c is None else [(i + 1, c, UPPER if t == "^" else LOWER)]
    if t == "\\frac":
        c1 = _closing(tokens, i + 1, end, "{", "}")
        c2 = None if c1 is None else _closing(tokens, c1 + 1, end, "{", "}")
        return [] if c2 is None else [(i + 1, c1, UPPER), (c1 + 1, c2, LOWER)]
    if t == "\\sqrt":
        if i + 1 < end and tokens[i + 1] == "[":
            c1 = _closing(tokens, i + 1, end, "[", "]")
            c2 = None if c1 is None else _closing(tokens, c1 + 1, end, "{", "}")
            return [] if c2 is None else [(i + 1, c1, UPPER), (c1 + 1, c2, LOWER)]
        c = _closing(tokens, i + 1, end, "{", "}")
        return [] if c is None else [(i + 1, c, LOWER)]
    return []


def relation_paths(tokens: Sequence[str]) -> list[tuple[int, ...]]:
    """Per token, the relations of the groups around it, outermost first."""
    paths: list[tuple[int, ...]] = [()] * len(tokens)
    todo = [(0, len(tokens), ())]
    while todo:
        start, end, path = todo.pop()
        i = start
        while i < end:
            paths[i] = path
            groups = _groups(tokens, i, end)
            for opening, closing, rel in groups:
                paths[opening] = paths[closing] = path
                todo.append((opening + 1, closing, (*path, rel)))
            i = groups[-1][1] + 1 if groups else i + 1
    return paths


def position_forest(tokens: Sequence[str]) -> tuple[list[int], list[int]]:
    """-> (layer, position) per token (see the module's docstring)."""
    layers, positions = [], []
    for path in relation_paths(tokens):
        depth = min(len(path), MAX_LAYER)
        layers.append(depth)
        positions.append(MAIN if depth == 0 else path[depth - 1])
    return layers, positions
