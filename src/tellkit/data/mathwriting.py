"""MathWriting (Google, 2024), read as the release ships it (``data.layout: mathwriting``).

The archive (``mathwriting-2024/``) holds one InkML file per expression, named
``<16 hex digits>.inkml``, in the folders ``train/`` (human-written), ``valid/``, ``test/``,
``synthetic/`` (glyphs stitched along LaTeX bounding boxes) and ``symbols/`` (single glyphs cut
from ``train/``). Each file carries its strokes (``x y t`` points) and ``<annotation>`` elements:
``normalizedLabel`` is the ground truth; ``label`` is the LaTeX as first written, and the only
label of the files under ``symbols/``. Other annotations (``splitTagOriginal``, ``sampleId``,
``inkCreationMethod``, ``labelCreationMethod``) are not read. The label goes through the same
LaTeX normaliser as CROHME truth (:func:`tellkit.data.latex.normalize`); symbols outside the
CROHME set are kept as tokens (the vocabulary grows to them in training).

A split is one folder name, or several joined by ``+`` (``train+synthetic``, the release's
suggested training set). Coordinates are in each device's units; the renderer normalises them
as it does CROHME's.
"""
from __future__ import annotations

import os
from pathlib import Path

from tellkit.data.crohme import Expression, SkipFile, load_inkml_folders
from tellkit.data.inkml import InkExpression
from tellkit.errors import TellkitError

FOLDERS = ("train", "valid", "test", "synthetic", "symbols")
# the task's split roles -> the release's folders (``data.val`` / ``data.test`` naming no folder
# of the release, e.g. a CROHME model's stored "2014", read these)
ROLES = {"train": "train", "val": "valid", "test": "test"}


def label_of(annotations: dict[str, str]) -> str | None:
    """The ground truth: ``normalizedLabel``, else ``label`` (``symbols/``), else None."""
    for key in ("normalizedLabel", "label"):
        text = (annotations.get(key) or "").strip()
        if text:
            return text
    return None


def load_split(root: str | os.PathLike, split: str, skipped: dict[str, int] | None = None) -> list[Expression]:
    """Every expression of the folder(s) ``split`` names (``test``, ``train+synthetic``) under
    the release folder ``root``. Files without strokes, with broken XML or without a label are
    skipped and counted in ``skipped`` (reason -> count)."""
    r = Path(root)
    folders = [r / name.strip() for name in split.split("+")]
    for name, folder in zip(split.split("+"), folders):
        if not folder.is_dir():
            raise TellkitError(f"{r}: no MathWriting folder '{name}' (the release has {', '.join(FOLDERS)})")

    def truth_of(e: InkExpression) -> str:
        label = label_of(e.annotations)
        if label is None:
            raise SkipFile("no label")
        return label

    return load_inkml_folders(folders, truth_of, require_truth=False, unparsable="unparsable label",
                              nothing=f"{r}: no usable MathWriting files in '{split}'", skipped=skipped)
