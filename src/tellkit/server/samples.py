"""The packaged sample inputs that the demo page offers one click away, so that a first visit
shows the models working: the captioning photos of ``tellkit demo`` (``assets/demo_caption``,
each with its article when it has one) and the handwritten sample expression (its pen strokes,
which the page draws on its pad and sends like a drawing, and its rendering).

Only files named by :func:`sample_index` are ever served: a request names a sample, never a path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tellkit.data.inkml import read_inkml
from tellkit.pipelines.recognition import ASSETS, SAMPLE_INKML, SAMPLE_LATEX, SAMPLE_PATH

CAPTION_DIR = ASSETS / "demo_caption"
MEDIA_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}
URL_PREFIX = "/samples/"


def _files() -> dict[str, Path]:
    """sample file name -> path, for every file the page may fetch."""
    files = {p.name: p for p in sorted(CAPTION_DIR.glob("*.jpg"))}
    if SAMPLE_PATH.is_file():
        files[SAMPLE_PATH.name] = SAMPLE_PATH
    return files


def sample_index() -> dict[str, Any]:
    """What ``GET /api/samples`` answers: the captioning photos (name, url, article text or
    null) and the math samples (name, strokes as [[x, y], ...] lists, the rendering's url, the
    expected LaTeX)."""
    caption = []
    for name, path in _files().items():
        if path.parent != CAPTION_DIR:
            continue
        txt = path.with_suffix(".txt")
        caption.append({"name": name, "url": URL_PREFIX + name,
                        "article": txt.read_text(encoding="utf-8") if txt.is_file() else None})
    math = []
    if SAMPLE_INKML.is_file():
        strokes = [[[round(float(x), 2), round(float(y), 2)] for x, y in s[:, :2]]
                   for s in read_inkml(SAMPLE_INKML).strokes]
        math.append({"name": SAMPLE_INKML.name, "strokes": strokes, "latex": SAMPLE_LATEX,
                     "url": URL_PREFIX + SAMPLE_PATH.name if SAMPLE_PATH.is_file() else None})
    return {"caption": caption, "math": math}


def sample_file(name: str) -> tuple[Path, str] | None:
    """(path, media type) of the sample called ``name``, or None when there is no such sample."""
    path = _files().get(name)
    if path is None:
        return None
    return path, MEDIA_TYPES.get(path.suffix.lower(), "application/octet-stream")
