"""A Flickr8k folder (the full set or a subset): ``captions.txt`` (CSV ``image,caption``,
5 per image) and ``images/<name>.jpg``.

It has no official split, so :func:`split_images` makes a fixed, seeded one by image (all five
captions of an image land in the same split): the sorted image names are shuffled with
``random.Random(seed)`` and cut into train / val / test by ``fractions`` (default 80/10/10,
i.e. 800 / 100 / 100 images for the 1,000-image subset).
"""
from __future__ import annotations

import csv
import os
import random
from pathlib import Path

from tellkit.data.coco import with_other_captions
from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError

SPLIT_SEED = 8
FRACTIONS = (0.8, 0.1, 0.1)


def read_captions(path: str | os.PathLike) -> list[tuple[str, str]]:
    path = Path(path)
    if not path.is_file():
        raise TellkitError(f"Flickr8k captions not found: {path}")
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["image", "caption"]:
        raise TellkitError(f"{path}: expected a CSV with the header 'image,caption'")
    out = []
    for r in rows[1:]:
        if len(r) >= 2 and r[0].strip() and r[1].strip():
            out.append((r[0].strip(), ",".join(r[1:]).strip()))  # an unquoted comma stays in the caption
    return out


def split_images(names: list[str], seed: int = SPLIT_SEED,
                 fractions: tuple[float, float, float] = FRACTIONS) -> dict[str, str]:
    order = sorted(set(names))
    random.Random(seed).shuffle(order)
    n_train = int(round(fractions[0] * len(order)))
    n_val = int(round(fractions[1] * len(order)))
    return {n: ("train" if i < n_train else "val" if i < n_train + n_val else "test") for i, n in enumerate(order)}


def load_flickr8k(root: str | os.PathLike, split: str | None = None, *, context: str = "none",
                  seed: int = SPLIT_SEED) -> list[CaptionSample]:
    """``context``: "none" or "other_captions" (the image's other four captions as context)."""
    root = Path(root)
    rows = read_captions(root / "captions.txt")
    split_of = split_images([name for name, _ in rows], seed)
    counts: dict[str, int] = {}
    out = []
    for name, caption in rows:
        k = counts[name] = counts.get(name, -1) + 1
        if split is None or split_of[name] == split:
            out.append(CaptionSample(id=f"{name}#{k}", caption=caption, image_path=str(root / "images" / name),
                                     image_id=name, split=split_of[name], source="flickr8k"))
    if context == "other_captions":
        with_other_captions(out)
    elif context != "none":
        raise TellkitError(f"Flickr8k context must be 'none' or 'other_captions', got {context!r}")
    return out
