"""Dataset loaders into common sample types, and batching.

Captioning (one :class:`~tellkit.data.sample.CaptionSample` per image + caption):
``goodnews.load_goodnews``, ``nytimes.load_nytimes_archive`` / ``load_nytimes_mongo``
(mongodump archive read without a server: ``mongo_archive``), ``coco.load_coco``,
``flickr8k.load_flickr8k``; :func:`load_captions` picks one by ``format``.
Batching: ``batch`` (the captioning batch contract: ``CaptionItem`` / ``CaptionBatch`` TypedDicts,
masks True = a real entry, ``collate_captions``, ``read_context``) and
``bucketing.bucket_batches`` (length buckets with a token cap).
Other tasks: ``crohme`` (+ ``latex``), ``how2``.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

from tellkit.data.coco import load_coco
from tellkit.data.flickr8k import load_flickr8k
from tellkit.data.goodnews import iter_goodnews_texts, load_goodnews
from tellkit.data.nytimes import iter_nytimes_texts, load_nytimes_archive, load_nytimes_mongo
from tellkit.errors import TellkitError
from tellkit.recipes import CAPTION_FORMATS


def load_captions(fmt: str, root: str | os.PathLike, split: str | None = None, **options):
    """Load a captioning data set: ``fmt`` in CAPTION_FORMATS; ``root`` a folder (GoodNews,
    Flickr8k), a mongodump archive or ``mongodb://`` URI (NYTimes800k), a JSON file (COCO)."""
    if fmt == "goodnews":

        return load_goodnews(root, split, **options)
    if fmt == "nytimes800k":

        if str(root).startswith(("mongodb://", "mongodb+srv://")):
            return load_nytimes_mongo(str(root), split, **options)
        return load_nytimes_archive(root, split, **options)
    if fmt == "coco":

        return load_coco(root, split, **options)
    if fmt == "flickr8k":

        return load_flickr8k(root, split, **options)
    raise TellkitError(f"unknown caption data format {fmt!r}; known: {', '.join(CAPTION_FORMATS)}")


def iter_article_texts(fmt: str, root: str | os.PathLike, split: str, **options) -> Iterator[tuple[str, list[str]]]:
    """The text of a captioning split, one article at a time: (article text, its captions in
    ``split``). GoodNews and a NYTimes800k archive are streamed (the set is never held in
    memory); a NYTimes800k MongoDB, COCO and Flickr8k are read by their loaders (article text
    "": they give no article). ``options``: the recipe's loader options."""
    if fmt == "goodnews":
        return iter_goodnews_texts(root, split, **options)
    if fmt == "nytimes800k" and not str(root).startswith(("mongodb://", "mongodb+srv://")):
        return iter_nytimes_texts(root, split, **options)
    samples = load_captions(fmt, root, split, **options)
    if fmt == "nytimes800k":
        by_article: dict[str, tuple[str, list[str]]] = {}
        for s in samples:
            by_article.setdefault(s.article_id or s.id, (s.article_text, []))[1].append(s.caption)
        return iter(by_article.values())
    return (("", [s.caption]) for s in samples)


__all__ = ["CAPTION_FORMATS", "iter_article_texts", "load_captions"]
