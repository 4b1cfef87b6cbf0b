"""The rare-name vocabularies of a captioning recipe: the proper nouns (spaCy PROPN tokens) of its
TRAINING split, counted as the Transform and Tell reference's ``name_counters.pkl`` counted them,
``caption`` (the training captions) and ``context`` (the headlines and text of the training
articles), for the two rare-name figures of :mod:`tellkit.metrics.ner`.

The split is read once, one article at a time (:func:`tellkit.data.iter_article_texts`; the set
is never loaded whole), tagged by the evaluation's spaCy pipeline (tagger only), and the counts
are kept as JSON, ``train_name_counts-<pipeline>.json``, in a cache folder (the feature cache,
else the evaluation's output folder). The file records where the counts came from (data format,
location, the size and time of its files); a file whose source differs is counted again.

Differences from the reference: only captions of the training split are counted (the reference's
GoodNews pass counted every caption of an article with a training caption, test captions
included); COCO and Flickr8k have no articles, so they give no ``context`` counts.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tellkit.data import iter_article_texts
from tellkit.errors import TellkitError
from tellkit.metrics.ner import name_counts
from tellkit.utils.files import atomic_write_bytes

VERSION = 1
NEWS_FORMATS = ("goodnews", "nytimes800k")  # the formats with articles
# the loader options that change the text read (the others choose images, objects, limits)
TEXT_OPTIONS = ("clean_captions", "db", "context")


@dataclass
class NameCounts:
    caption: Counter
    context: Counter | None  # None: the data set has no articles, or they were not asked for
    info: dict[str, Any] = field(default_factory=dict)  # where the counts came from


def counts_file(directory: str | os.PathLike, ner_model: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", ner_model)
    return Path(directory) / f"train_name_counts-{safe}.json"


def _stamp(root: str) -> list[list[Any]]:
    """(name, size, mtime) of the files a location is read from: the file itself, or a folder's
    top-level files (GoodNews' JSON files, Flickr8k's caption files); nothing for a MongoDB URI."""
    p = Path(root)
    if root.startswith(("mongodb://", "mongodb+srv://")) or not p.exists():
        return []
    files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
    return [[q.name, q.stat().st_size, q.stat().st_mtime_ns] for q in files]


def source_of(fmt: str, root: str, options: dict[str, Any], split: str = "train") -> dict[str, Any]:
    """What identifies the counted text: format, location (absolute), split, text options, file stamps."""
    where = root if root.startswith(("mongodb://", "mongodb+srv://")) else str(Path(root).resolve())
    return {"format": fmt, "root": where, "split": split,
            "options": {k: options[k] for k in TEXT_OPTIONS if k in options}, "files": _stamp(root)}


def _texts(fmt: str, root: str, options: dict[str, Any], articles: bool, seen: Counter) -> Iterator[tuple[str, str]]:
    for article, captions in iter_article_texts(fmt, root, "train", **options):
        seen["articles"] += 1
        seen["captions"] += len(captions)
        if articles and article:
            yield "context", article
        for c in captions:
            yield "caption", c


def _read_cache(path: Path, source: dict[str, Any], ner_model: str, articles: bool) -> NameCounts | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("source") != source or \
            data.get("ner_model") != ner_model or not isinstance(data.get("caption"), dict) or \
            (articles and not isinstance(data.get("context"), dict)):
        return None
    context = Counter(data["context"]) if articles else None
    return NameCounts(Counter(data["caption"]), context, {**data["info"], "cache": str(path), "cached": True})


def training_name_counts(fmt: str, root: str, options: dict[str, Any], ner_model: str, *,
                         articles: bool = True, cache_dir: str | os.PathLike | None = None,
                         nlp: Any = None) -> NameCounts:
    """The PROPN counts of the training split of ``fmt`` at ``root`` (read from the cache when it
    holds the same source). ``articles``: count the articles too (news formats only). Raises
    :class:`TellkitError` when the training split cannot be read."""
    articles = articles and fmt in NEWS_FORMATS
    source = source_of(fmt, root, options)
    path = counts_file(cache_dir, ner_model) if cache_dir else None
    if path is not None and path.is_file():
        cached = _read_cache(path, source, ner_model, articles)
        if cached is not None:
            return cached
    seen: Counter = Counter()
    counts = name_counts(_texts(fmt, root, options, articles, seen), model=ner_model, nlp=nlp)
    if not seen["captions"]:
        raise TellkitError(f"{root}: no training captions")
    info = {"source": source, "captions": seen["captions"], "articles": seen["articles"],
            "caption_names": len(counts.get("caption", ())),
            "article_names": len(counts.get("context", ())) if articles else None}
    result = NameCounts(counts.get("caption", Counter()), counts.get("context", Counter()) if articles else None,
                        info)
    if path is not None:
        doc = {"version": VERSION, "source": source, "ner_model": ner_model, "info": info,
               "caption": dict(result.caption.most_common()),
               "context": dict(result.context.most_common()) if result.context is not None else None}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(doc, ensure_ascii=False).encode("utf-8"))
    return NameCounts(result.caption, result.context, {**info, "cache": str(path) if path else None,
                                                        "cached": False})
