"""A Flickr8k folder, in either of the two layouts it is distributed in:

- **official** (how the data set is downloaded): ``Flickr8k_text/Flickr8k.token.txt``
  (``<image>.jpg#<k><TAB><caption>``) with the official image split
  ``Flickr8k_text/Flickr_8k.{train,dev,test}Images.txt`` (6,000 / 1,000 / 1,000 images; the
  published Flickr8k numbers use this test split). ``dev`` is tellkit's ``val`` split; images in
  no split file (91 of the 8,091) belong to no split.
- **CSV**: ``captions.txt`` (``image,caption``, 5 per image) with no split. :func:`split_images`
  then makes a fixed, seeded one by image (all five captions of an image land in the same split):
  the sorted image names are shuffled with ``random.Random(seed)`` and cut into train / val / test
  by ``fractions`` (default 80/10/10).

Photos are ``images/<name>.jpg`` in both. When the split files are there they decide the split,
and the captions come from ``Flickr8k.token.txt`` (or ``captions.txt`` when only that is there).
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
TEXT_DIR = "Flickr8k_text"
TOKEN_FILE = "Flickr8k.token.txt"
# tellkit's split name -> the official file's (dev is the validation split)
SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "val": "Flickr_8k.devImages.txt",
               "test": "Flickr_8k.testImages.txt"}


def read_captions(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``captions.txt``: CSV ``image,caption`` -> [(image, caption), ...] in file order."""
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


def read_token_file(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``Flickr8k.token.txt``: ``<image>#<k><TAB><caption>`` -> [(image, caption), ...] in file order."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n\r")
            if not line.strip():
                continue
            key, tab, caption = line.partition("\t")
            name, hash_, k = key.rpartition("#")
            if not tab or not hash_ or not k.strip().isdigit() or not name.strip():
                raise TellkitError(f"{path}:{n}: expected '<image>#<k><TAB><caption>', got {line[:80]!r}")
            if caption.strip():
                out.append((name.strip(), caption.strip()))
    return out


def read_split_files(root: str | os.PathLike) -> dict[str, str] | None:
    """image name -> train / val / test from the official split files, or None when the folder
    has none of them. Some but not all of them, or an image in two splits, is an error."""
    text = Path(root) / TEXT_DIR
    present = {s: text / f for s, f in SPLIT_FILES.items() if (text / f).is_file()}
    if not present:
        return None
    if len(present) != len(SPLIT_FILES):
        missing = ", ".join(f for s, f in SPLIT_FILES.items() if s not in present)
        raise TellkitError(f"{text}: the official split is incomplete (missing {missing})")
    split_of: dict[str, str] = {}
    for split, path in present.items():
        for name in path.read_text(encoding="utf-8").split():
            if split_of.setdefault(name, split) != split:
                raise TellkitError(f"{path}: {name} is also in the {split_of[name]} split")
    return split_of


def split_images(names: list[str], seed: int = SPLIT_SEED,
                 fractions: tuple[float, float, float] = FRACTIONS) -> dict[str, str]:
    order = sorted(set(names))
    random.Random(seed).shuffle(order)
    n_train = int(round(fractions[0] * len(order)))
    n_val = int(round(fractions[1] * len(order)))
    return {n: ("train" if i < n_train else "val" if i < n_train + n_val else "test") for i, n in enumerate(order)}


def load_flickr8k(root: str | os.PathLike, split: str | None = None, *, context: str = "none",
                  seed: int = SPLIT_SEED) -> list[CaptionSample]:
    """The samples of ``split`` (train / val / test; None: every captioned image, those in no
    official split with ``split=None`` on the sample). ``context``: "none" or "other_captions"
    (the image's other four captions as context). ``seed`` only matters without split files."""
    root = Path(root)
    if split is not None and split not in SPLIT_FILES:
        raise TellkitError(f"Flickr8k split must be train, val or test, got {split!r}")
    token_file = root / TEXT_DIR / TOKEN_FILE
    rows = read_token_file(token_file) if token_file.is_file() else read_captions(root / "captions.txt")
    split_of = read_split_files(root)
    if split_of is None:
        split_of = split_images([name for name, _ in rows], seed)
    counts: dict[str, int] = {}
    out = []
    for name, caption in rows:
        k = counts[name] = counts.get(name, -1) + 1
        part = split_of.get(name)
        if split is None or part == split:
            out.append(CaptionSample(id=f"{name}#{k}", caption=caption, image_path=str(root / "images" / name),
                                     image_id=name, split=part, source="flickr8k"))
    if context == "other_captions":
        with_other_captions(out)
    elif context != "none":
        raise TellkitError(f"Flickr8k context must be 'none' or 'other_captions', got {context!r}")
    return out
