"""GoodNews (Biten et al., "Good News, Everyone!", CVPR 2019) in its released format.

- ``captioning_dataset.json``: article id -> ``{"article": text, "headline": {"main": ...},
  "images": {"<index>": caption, ...}, "article_url": ...}``
- ``img_splits.json``: image file name (``<article id>_<index>.jpg``) -> train / val / test
- images: ``<root>/<images_dir>/<article id>_<index>.jpg``

The split is per caption, so test captions can share an article with training captions (as
in the reference). GoodNews gives no image position: context is the article from its start.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError

IMAGE_DIRS = ("images", "resized", "images_processed", ".")
_PARA = re.compile(r"\n\s*\n|\n")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise TellkitError(f"GoodNews: {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TellkitError(f"{path}: not valid JSON ({exc})") from exc


def load_goodnews(root: str | os.PathLike, split: str | None = None, *, images_dir: str | None = None,
                  limit: int | None = None) -> list[CaptionSample]:
    root = Path(root)
    articles = _read_json(root / "captioning_dataset.json")
    splits = _read_json(root / "img_splits.json")
    if not isinstance(articles, dict) or not isinstance(splits, dict):
        raise TellkitError(f"{root}: GoodNews files must hold JSON objects")
    img_dir = root / images_dir if images_dir else next((root / d for d in IMAGE_DIRS if (root / d).is_dir()), root)
    # keys of img_splits may carry the .jpg extension or not
    split_of = {k[:-4] if k.endswith(".jpg") else k: v for k, v in splits.items()}
    out: list[CaptionSample] = []
    for aid, art in articles.items():
        headline = art.get("headline") or {}
        title = headline.get("main", "") if isinstance(headline, dict) else str(headline)
        paragraphs = [p.strip() for p in _PARA.split(art.get("article") or "") if p.strip()]
        for idx, caption in sorted((art.get("images") or {}).items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            name = f"{aid}_{idx}"
            s = split_of.get(name)
            if s is None or (split is not None and s != split) or not (caption or "").strip():
                continue
            out.append(CaptionSample(
                id=name, caption=caption.strip(), image_path=str(img_dir / f"{name}.jpg"), image_id=name,
                article_id=str(aid), title=(title or "").strip(), paragraphs=paragraphs, image_position=None,
                split=s, source="goodnews", extra={"url": art.get("article_url")} if art.get("article_url") else {},
            ))
            if limit is not None and len(out) >= limit:
                return out
    if not out:
        raise TellkitError(f"{root}: no GoodNews captions for split {split!r}")
    return out
