"""CROHME 2019 test data: InkML strokes whose truth comes in separate label-graph files
(``data.layout: crohme2019``).

The release gives the test expressions as InkML files (``<name>.inkml``, strokes and no
usable truth) and their ground truth as label graphs (``<name>.lg``, the format of the LgEval
tools), in a folder beside them or anywhere under the data root; they are matched by name.
A label graph in object-relationship form lists the symbols and the spatial relations::

    # IUD, 2019_0001
    # Objects(3):
    O, x_1, x, 1.0, 0          # O, <object id>, <label>, <weight>, <stroke ids...>
    O, +_1, +, 1.0, 1, 2
    O, 2_1, 2, 1.0, 3
    # Relations from SRT:
    R, x_1, +_1, Right, 1.0    # R, <parent id>, <child id>, <relation>, <weight>
    R, +_1, 2_1, Right, 1.0

Relations: ``Right`` (the next symbol on the baseline), ``Sup`` / ``Sub`` (scripts), ``Above``
/ ``Below`` (fraction numerator and denominator under a bar ``-``, limits of a large operator,
or scripts set above or below), ``Inside`` (the radicand of ``\\sqrt``), and ``PreSup`` (a
root's index). The label ``COMMA`` stands for ``,``. The symbol-layout tree is turned back
into LaTeX (:func:`lg_to_latex`) and normalised like every CROHME truth. A file holding only
stroke-level lines (``N`` / ``E``) has no objects and is refused with its name.
"""
from __future__ import annotations

import os
from pathlib import Path

from tellkit.data.crohme import Expression, SkipFile, inkml_split_folder, load_inkml_folders
from tellkit.data.inkml import InkExpression
from tellkit.errors import TellkitError

ROLES = {"train": "train", "val": "2019", "test": "2019"}
LABELS = {"COMMA": ",", "\\lt": "<", "\\gt": ">"}
SCRIPTED = {"\\sum", "\\int", "\\lim", "\\prod", "\\bigcup", "\\bigcap"}


def read_lg(text: str, where: str = "<lg>") -> tuple[dict[str, tuple[str, int]], dict[str, dict[str, str]]]:
    """Object lines -> ``{id: (label, first stroke)}``; relation lines -> ``{parent: {relation: child}}``."""
    objects: dict[str, tuple[str, int]] = {}
    rels: dict[str, dict[str, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if parts[0] == "O" and len(parts) >= 3:
            # a label that is itself a comma is written COMMA; strokes come after the weight
            strokes = [int(p) for p in parts[4:] if p.lstrip("-").isdigit()]
            objects[parts[1]] = (LABELS.get(parts[2], parts[2]), min(strokes) if strokes else n)
        elif parts[0] in ("R", "EO") and len(parts) >= 4:
            rels.setdefault(parts[1], {})[parts[3]] = parts[2]
    if not objects:
        raise TellkitError(f"{where}: no object lines (O, id, label, weight, strokes) in the label graph")
    for parent, kids in rels.items():
        for child in (parent, *kids.values()):
            if child not in objects:
                raise TellkitError(f"{where}: a relation names object '{child}', which is not listed")
    return objects, rels


def lg_to_latex(text: str, where: str = "<lg>") -> str:
    """A label graph (object-relationship form) -> LaTeX of its symbol-layout tree."""
    objects, rels = read_lg(text, where)
    children = {c for kids in rels.values() for c in kids.values()}
    roots = sorted((o for o in objects if o not in children), key=lambda o: objects[o][1])
    if not roots:
        raise TellkitError(f"{where}: the label graph has a cycle (no symbol without a parent)")
    seen: set[str] = set()

    def group(node: str | None) -> str:
        return "{" + (line(node) if node else "") + "}"

    def line(node: str | None) -> str:
        out = []
        while node is not None:
            if node in seen:
                raise TellkitError(f"{where}: the label graph is not a tree (object '{node}' is reached twice)")
            seen.add(node)
            out.append(symbol(node))
            node = rels.get(node, {}).get("Right")
        return " ".join(out)

    def symbol(node: str) -> str:
        label, kids = objects[node][0], rels.get(node, {})
        if label in ("-", "\\frac") and "Above" in kids and "Below" in kids:
            s = f"\\frac {group(kids['Above'])} {group(kids['Below'])}"
        elif label == "\\sqrt":
            index = kids.get("PreSup") or kids.get("Above")
            s = "\\sqrt" + (f" [ {line(index)} ]" if index else "") + " " + group(kids.get("Inside"))
        else:
            s = label
            if label in SCRIPTED or "Sub" not in kids and "Sup" not in kids:
                s += "".join(f" {op} {group(kids[rel])}" for rel, op in (("Below", "_"), ("Above", "^"))
                             if rel in kids)
        s += "".join(f" {op} {group(kids[rel])}" for rel, op in (("Sub", "_"), ("Sup", "^")) if rel in kids)
        return s

    return " ".join(line(r) for r in roots)


def load_split(root: str | os.PathLike, split: str, skipped: dict[str, int] | None = None) -> list[Expression]:
    """The InkML files of ``root/<split>`` (or ``root/test/<split>``), each with the LaTeX of the
    ``<name>.lg`` found under ``root`` (recursively); a file whose InkML holds its own truth
    annotation and has no label graph keeps that truth. Files with neither are skipped and
    counted in ``skipped``."""
    r = Path(root)
    folder = inkml_split_folder(r, split, "CROHME 2019")
    graphs = {p.stem: p for p in sorted(r.rglob("*.lg"), reverse=True)}

    def truth_of(e: InkExpression) -> str:
        g = graphs.get(e.id)
        try:
            truth = lg_to_latex(g.read_text(encoding="utf-8", errors="replace"), str(g)) if g else e.truth
        except (TellkitError, OSError):  # a broken or unreadable label graph
            raise SkipFile("unusable label graph") from None
        if not truth:
            raise SkipFile("no label graph")
        return truth

    return load_inkml_folders([folder], truth_of, require_truth=False, unparsable="unparsable truth",
                              nothing=f"{folder}: no usable CROHME 2019 expressions", skipped=skipped)
