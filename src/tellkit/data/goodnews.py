"""GoodNews (Biten et al., "Good News, Everyone!", CVPR 2019) in its released format.

- ``captioning_dataset.json``: article id -> ``{"article": text, "headline": {"main": ...},
  "images": {"<index>": caption, ...}, "article_url": ...}``
- ``img_splits.json``: image file name (``<article id>_<index>.jpg``) -> train / val / test
  (released beside the captions; without it, ``split=None`` reads every caption and a split
  is drawn by GoodNews's own rule, :func:`goodnews_splits`)
- images: ``<root>/<images_dir>/<article id>_<index>.jpg``

The split is per caption, so test captions can share an article with training captions (as
in the reference). GoodNews gives no image position: the context is ``title + "\n\n" +
article`` from its start (:mod:`tellkit.encoders.context`); ``sample.paragraphs`` are the
article's blank-line-separated blocks as stored, so joining them gives the article back.

Captions are cleaned as the reference cleaned them before training and scoring: HTML removed
(tags dropped, entities decoded) and every ``[...]`` annotation deleted, then stripped
(``clean_captions=False`` keeps them raw).

``objects``: a mongodump archive holding ``goodnews.objects`` (``_id`` = ``<article id>_<index>``,
``object_features``), as the reference's YOLOv3 pass wrote it; its vectors become
``sample.extra["objects"]`` (float32 [O, 2048]). The public release ships none.

``captioning_dataset.json`` is parsed once into an embedded index (:mod:`tellkit.data.news_store`,
in the user cache, rebuilt when the file changes); every later read comes from it.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np

from tellkit.data.news_store import NewsStore
from tellkit.data.nytimes import attach_objects, headline_text, read_archive_objects
from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError

# the reference read images_processed (its own 224 x 224 crops); raw folders come after it
IMAGE_DIRS = ("images_processed", "images", "resized", ".")
_BRACKETS = re.compile(r"\[[^]]*\]")


class _Text(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def strip_html(text: str) -> str:
    """The text of an HTML fragment: tags dropped, entities decoded."""
    p = _Text()
    p.feed(text)
    p.close()
    return "".join(p.parts)


def clean_caption(text: str) -> str:
    """The reference's caption cleaning: strip, HTML to text, ``[...]`` removed, strip."""
    return _BRACKETS.sub("", strip_html(text.strip())).strip()


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise TellkitError(f"GoodNews: {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TellkitError(f"{path}: not valid JSON ({exc})") from exc


SPLIT_SEED = 42  # GoodNews's clean_captions.py: np.random.seed(42)


def goodnews_splits(articles: dict[str, Any], seed: int = SPLIT_SEED) -> dict[str, str]:
    """Each photo's split by GoodNews's own rule (its ``clean_captions.py``): one uniform draw
    per caption, in the order of the articles and of each article's images, from NumPy's
    generator seeded with 42: above 0.95 test, strictly between 0.91 and 0.95 val, else train
    (about 5 / 4 / 91 %). Every caption takes a draw, an empty one too. GoodNews drew in the
    order of a Python 2 dict, which cannot be re-created, so the split has GoodNews's rule and
    proportions but not its released assignment: use the released ``img_splits.json`` to compare
    with published numbers. -> {"<article id>_<index>.jpg": split}."""
    rng = np.random.RandomState(seed)
    out: dict[str, str] = {}
    for aid, art in articles.items():
        for idx in (art.get("images") or {}) if isinstance(art, dict) else ():
            out[f"{aid}_{idx}.jpg"] = _drawn_split(rng)
    return out


def _drawn_split(rng: np.random.RandomState) -> str:
    u = rng.uniform()
    return "test" if u > 0.95 else "val" if 0.91 < u < 0.95 else "train"


def iter_goodnews_texts(root: str | os.PathLike, split: str, *, clean_captions: bool = True,
                        progress: bool = True, **_options: Any) -> Iterator[tuple[str, list[str]]]:
    """One article at a time, without loading the set: (headline + article text, the article's
    non-empty captions in ``split``), for each article with at least one. Splits as
    :func:`load_goodnews` reads them (``img_splits.json``, else GoodNews's rule drawn again in the
    same order). Other loader options (``images_dir``, ``objects`` ...) do not change the text."""
    root = Path(root)
    if not (root / "captioning_dataset.json").is_file():
        raise TellkitError(f"GoodNews: {root / 'captioning_dataset.json'} not found")
    store = NewsStore.for_source(root, "goodnews", progress=progress)
    splits = _read_json(root / "img_splits.json") if (root / "img_splits.json").is_file() else None
    if not isinstance(splits, (dict, type(None))):
        raise TellkitError(f"{root}: GoodNews files must hold JSON objects")
    split_of = {k[:-4] if k.endswith(".jpg") else k: v for k, v in (splits or {}).items()}
    rng = np.random.RandomState(SPLIT_SEED) if splits is None else None
    for art in store.articles():
        aid = art.get("_id")
        captions = []
        for idx, caption in (art.get("images") or {}).items():
            s = _drawn_split(rng) if rng is not None else split_of.get(f"{aid}_{idx}")
            caption = clean_caption(caption or "") if clean_captions else (caption or "").strip()
            if s == split and caption:
                captions.append(caption)
        if captions:
            yield "\n\n".join(t for t in (headline_text(art), (art.get("article") or "").strip()) if t), captions


def load_goodnews(root: str | os.PathLike, split: str | None = None, *, images_dir: str | None = None,
                  limit: int | None = None, clean_captions: bool = True,
                  objects: str | os.PathLike | None = None, dropped: list[dict] | None = None,
                  progress: bool = True) -> list[CaptionSample]:
    """The captions of ``split`` (None: all) as samples. ``dropped``: a list that receives each
    photo of the split left out because its caption is empty once cleaned ({"id", "path",
    "reason": "empty caption", "message"}), so that a feature pass can count it."""
    root = Path(root)
    if not (root / "captioning_dataset.json").is_file():
        raise TellkitError(f"GoodNews: {root / 'captioning_dataset.json'} not found")
    # the JSON is parsed once into the embedded index (tellkit.data.news_store); later reads come from it
    store = NewsStore.for_source(root, "goodnews", progress=progress)
    articles = {a.pop("_id"): a for a in store.articles()}
    if (root / "img_splits.json").is_file():
        splits = _read_json(root / "img_splits.json")
    elif split is None:  # no split file: every caption, in no split
        splits = None
    else:  # GoodNews's own rule, drawn again (see goodnews_splits)
        splits = goodnews_splits(articles)
    if not isinstance(splits, (dict, type(None))):
        raise TellkitError(f"{root}: GoodNews files must hold JSON objects")
    img_dir = root / images_dir if images_dir else next((root / d for d in IMAGE_DIRS if (root / d).is_dir()), root)
    # keys of img_splits may carry the .jpg extension or not
    split_of = {k[:-4] if k.endswith(".jpg") else k: v for k, v in (splits or {}).items()}
    out: list[CaptionSample] = []
    for aid, art in articles.items():
        title = headline_text(art)
        article = (art.get("article") or "").strip()
        paragraphs = article.split("\n\n") if article else []
        images = (art.get("images") or {}).items()
        for idx, caption in sorted(images, key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            name = f"{aid}_{idx}"
            s = split_of.get(name)
            caption = clean_caption(caption or "") if clean_captions else (caption or "").strip()
            if (splits is not None and s is None) or (split is not None and s != split):
                continue
            if not caption:
                if dropped is not None:
                    dropped.append({"id": name, "path": str(img_dir / f"{name}.jpg"), "reason": "empty caption",
                                    "message": "its caption is empty (GoodNews keeps no caption-less photo)"})
                continue
            out.append(CaptionSample(
                id=name, caption=caption, image_path=str(img_dir / f"{name}.jpg"), image_id=name,
                article_id=str(aid), title=title, paragraphs=paragraphs, image_position=None,
                split=s, source="goodnews", extra={"url": art.get("article_url")} if art.get("article_url") else {},
            ))
            if limit is not None and len(out) >= limit:
                break
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TellkitError(f"{root}: no GoodNews captions for split {split!r}")
    if objects is not None:

        attach_objects(out, read_archive_objects(objects, {x.image_id for x in out}, "goodnews"))
    return out
