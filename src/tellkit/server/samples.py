"""The packaged sample inputs that the demo page offers one click away, so that a first visit
shows what the models are for, and what they are not for: the captioning photos of
``tellkit demo`` (``assets/demo_caption``, each with its article when it has one; their sources
and licences are in its SOURCES.md), each marked as inside or outside what the default
captioner learned (Flickr8k: people, dogs, outdoor scenes), and the handwritten sample
formulas (``assets/samples/*.inkml``: pen strokes made for tellkit, which the page draws on its
pad and sends like a drawing).

Only files named by :func:`sample_index` are ever served: a request names a sample, never a path.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tellkit.data.inkml import read_inkml
from tellkit.pipelines.recognition import ASSETS, SAMPLE_INKML, SAMPLE_LATEX, SAMPLE_PATH

CAPTION_DIR = ASSETS / "demo_caption"
MATH_DIR = ASSETS / "samples"
MEDIA_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png"}
URL_PREFIX = "/samples/"

# photo -> (inside / outside the captioner's domain, what it shows); the page lists them in this order
CAPTION_SAMPLES = {
    "dogs.jpg": ("inside", "two spaniels looking over a wooden door"),
    "camera.jpg": ("inside", "a man with a camera on a tripod, outdoors"),
    "mountain_path.jpg": ("inside", "a path across a meadow below mountains"),
    "astronaut.jpg": ("inside", "a portrait of a woman in a flight suit"),
    "chelsea.jpg": ("outside", "a cat: few in Flickr8k"),
    "coffee.jpg": ("outside", "a cup of coffee: an object close up"),
    "rocket.jpg": ("outside", "a rocket on its launch pad"),
}
# sample formula -> the LaTeX it was drawn from, as the model's tokens; the first is the page's default
MATH_SAMPLES = {
    SAMPLE_INKML.name: SAMPLE_LATEX,
    "bttr_frac_a_b.inkml": "\\frac { a } { b }",
    "bttr_sqrt_x_plus_1.inkml": "\\sqrt { x + 1 }",
    "bttr_y_eq_2x_plus_3.inkml": "y = 2 x + 3",
    "bttr_a_plus_b_squared.inkml": "( a + b ) ^ { 2 }",
}


def _files() -> dict[str, Path]:
    """sample file name -> path, for every file the page may fetch."""
    files = {name: CAPTION_DIR / name for name in CAPTION_SAMPLES if (CAPTION_DIR / name).is_file()}
    if SAMPLE_PATH.is_file():
        files[SAMPLE_PATH.name] = SAMPLE_PATH
    return files


def caption_samples() -> list[dict[str, Any]]:
    """The captioning photos, those inside the captioner's domain first: name, url, domain
    (``inside`` / ``outside``), about (what it shows), article text or null."""
    out = []
    for name, (domain, about) in CAPTION_SAMPLES.items():
        path = CAPTION_DIR / name
        if not path.is_file():
            continue
        txt = path.with_suffix(".txt")
        out.append({"name": name, "url": URL_PREFIX + name, "domain": domain, "about": about,
                    "article": txt.read_text(encoding="utf-8") if txt.is_file() else None})
    return out


def math_samples() -> list[dict[str, Any]]:
    """The handwritten formulas: name, strokes as [[x, y], ...] lists (2 decimals), the LaTeX
    they were drawn from, and the url of a rendering when one is packaged (else null)."""
    out = []
    for name, latex in MATH_SAMPLES.items():
        path = MATH_DIR / name
        if not path.is_file():
            continue
        strokes = [[[round(float(x), 2), round(float(y), 2)] for x, y in s[:, :2]] for s in read_inkml(path).strokes]
        png = path.with_suffix(".png")
        out.append({"name": name, "strokes": strokes, "latex": latex,
                    "url": URL_PREFIX + png.name if png.name in _files() else None})
    return out


def sample_index() -> dict[str, Any]:
    """What ``GET /api/samples`` answers, by task: ``caption`` (:func:`caption_samples`) and
    ``recognize`` (:func:`math_samples`)."""
    return {"caption": caption_samples(), "recognize": math_samples()}


def sample_file(name: str) -> tuple[Path, str] | None:
    """(path, media type) of the sample called ``name``, or None when there is no such sample."""
    path = _files().get(name)
    if path is None:
        return None
    return path, MEDIA_TYPES.get(path.suffix.lower(), "application/octet-stream")
