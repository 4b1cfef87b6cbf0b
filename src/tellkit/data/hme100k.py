"""HME100K (Yuan et al., CVPR 2022: 74,502 training and 24,607 test photos of handwritten
expressions, 245 symbols among which Chinese characters), read as the release ships it
(``data.layout: hme100k``)::

    train_images/<name>.jpg     train_labels.txt     one "<name>.jpg<TAB><LaTeX>" a line
    test_images/<name>.jpg      test_labels.txt

The LaTeX is space-separated in the release (``\\frac { 1 } { 2 }``); it goes through the
CROHME normaliser (:func:`tellkit.data.latex.normalize`) like every other label, each Chinese
character becoming one token. Photos are read by the bitmap loader (colour to grey, light
background detected).
"""
from __future__ import annotations

import os
from pathlib import Path

from tellkit.data.crohme import Expression
from tellkit.data.latex import normalize
from tellkit.errors import TellkitError

SPLITS = ("train", "test")
# the task's split roles -> the release's splits (it has no validation split: hold some of
# train out with data.val=... only if you split it yourself)
ROLES = {"train": "train", "val": "test", "test": "test"}


def read_labels(path: Path) -> list[tuple[str, str]]:
    """``name.jpg<TAB>LaTeX`` lines -> (file name, LaTeX); a line without a tab is an error."""
    if not path.is_file():
        raise TellkitError(f"HME100K label file not found: {path}")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        name, tab, latex = line.partition("\t")
        if not tab or not name.strip():
            raise TellkitError(f"{path}: line {n} is not '<name>.jpg<TAB><LaTeX>'")
        rows.append((name.strip(), latex.strip()))
    return rows


def load_split(root: str | os.PathLike, split: str, skipped: dict[str, int] | None = None) -> list[Expression]:
    """``split`` (``train`` or ``test``): ``<split>_labels.txt`` and the photos in
    ``<split>_images/``. A label naming a missing photo, or unparsable LaTeX, is skipped and
    counted in ``skipped``."""
    r = Path(root)
    images = r / f"{split}_images"
    if not images.is_dir():
        raise TellkitError(f"{r}: no HME100K split '{split}' (expected {split}_images/ and {split}_labels.txt)")
    counts: dict[str, int] = {}
    exprs = []
    for name, latex in read_labels(r / f"{split}_labels.txt"):
        img = images / name
        if not img.is_file():
            counts["missing image"] = counts.get("missing image", 0) + 1
            continue
        try:
            toks = normalize(latex)
        except TellkitError:
            counts["unparsable label"] = counts.get("unparsable label", 0) + 1
            continue
        exprs.append(Expression(Path(name).stem, img, toks, latex))
    if skipped is not None:
        for k, v in counts.items():
            skipped[k] = skipped.get(k, 0) + v
    if not exprs:
        raise TellkitError(f"{r}: no usable HME100K expressions in '{split}'"
                           + (f" (skipped: {counts})" if counts else ""))
    return exprs
