"""The text lines of a page of handwritten math (a scan of notes), for ``tellkit recognize --lines``.

A page is cut into horizontal bands at its empty rows (the horizontal projection profile: ink
pixels per row). A math line has empty rows of its own, between a numerator, its bar and its
denominator, or above a raised exponent, so a gap splits two lines only when it is wide for the
writing: at least ``gap`` times the median size of the page's ink components
(:func:`tellkit.data.crohme.ink_component_sizes`, about one symbol's height) and at least
``min_gap`` pixels. Bands of only a few ink pixels (specks, dust) are dropped. Lines are
returned top to bottom; a line is the full width of the page between its rows (the recogniser
crops it to its ink).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tellkit.data.crohme import ink_component_sizes
from tellkit.errors import TellkitError


@dataclass(frozen=True)
class LineBox:
    top: int  # first row of the line
    bottom: int  # one past its last row

    @property
    def height(self) -> int:
        return self.bottom - self.top


def ink_mask(gray: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """[H, W] grey values (0..255 or 0..1, dark ink on light paper or the reverse) -> bool, ink True."""
    a = np.asarray(gray, dtype=np.float32)
    if a.ndim != 2 or a.size == 0:
        raise TellkitError(f"a page must be a grey image [H, W], got shape {tuple(a.shape)}")
    if a.max(initial=0) > 1.0:
        a = a / 255.0
    ink = 1.0 - a
    if ink.mean() > 0.5:  # light ink on a dark background
        ink = 1.0 - ink
    return ink > threshold


def find_lines(gray: np.ndarray, gap: float = 0.75, min_gap: int = 4, min_ink: int = 12) -> list[LineBox]:
    """The lines of the page ``gray`` (see the module docstring), top to bottom."""
    ink = ink_mask(gray)
    rows = ink.sum(axis=1)
    if not rows.any():
        raise TellkitError("no ink found on the page (a blank image)")
    sizes = ink_component_sizes(ink.astype(np.float32))
    split_at = max(float(min_gap), gap * float(np.median(sizes)) if len(sizes) else 0.0)
    on = np.flatnonzero(rows > 0)
    # runs of inked rows, then joined across gaps narrower than split_at
    breaks = np.flatnonzero(np.diff(on) > 1)
    starts = np.concatenate([[on[0]], on[breaks + 1]])
    ends = np.concatenate([on[breaks] + 1, [on[-1] + 1]])
    lines: list[list[int]] = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        if lines and s - lines[-1][1] < split_at:
            lines[-1][1] = e
        else:
            lines.append([s, e])
    return [LineBox(s, e) for s, e in lines if int(rows[s:e].sum()) >= min_ink]


def split_page(image, **options) -> list[tuple[LineBox, object]]:
    """A PIL image of a page -> (box, PIL image of the line) for each line, top to bottom."""
    gray = np.asarray(image.convert("L"))
    return [(box, image.crop((0, box.top, image.size[0], box.bottom))) for box in find_lines(gray, **options)]
