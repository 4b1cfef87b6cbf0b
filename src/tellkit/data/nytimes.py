"""NYTimes800k (Tran et al. 2020) in its distributed form: a MongoDB database ``nytimes``.

Read it straight from the ``mongodump --archive --gzip`` file (no server, no 61 GB restore) with
:func:`load_nytimes_archive`, or from a running MongoDB with :func:`load_nytimes_mongo`.

Collection ``articles``: ``_id``, ``split`` (train / valid / test), ``headline.main``,
``image_positions`` (indices into ``parsed_section``), ``parsed_section``: a list of
``{"type": "paragraph" | "caption", "text", "hash", "facenet_details": {"embeddings": ...}}``.
Each caption section gives one sample; its image is ``<image_root>/<hash>.jpg``; its position
among the article's paragraphs is the number of paragraphs that precede it. Precomputed FaceNet
embeddings and named entities, when present, are kept in ``sample.extra``. Collection
``objects`` (``_id`` = image hash, ``object_features``) is read when ``objects=True``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError

SPLITS = {"train": "train", "valid": "val", "val": "val", "test": "test"}


def samples_from_article(article: dict[str, Any], image_root: str | os.PathLike | None = None) -> Iterator[CaptionSample]:
    from tellkit.encoders.context import split_parsed_section

    sections = article.get("parsed_section") or []
    headline = article.get("headline") or {}
    title = (headline.get("main") if isinstance(headline, dict) else str(headline)) or ""
    split = SPLITS.get(str(article.get("split", "")), article.get("split"))
    for pos in article.get("image_positions") or []:
        if not 0 <= pos < len(sections):
            continue
        sec = sections[pos]
        caption = (sec.get("text") or "").strip()
        if sec.get("type") != "caption" or not caption or not sec.get("hash"):
            continue
        paragraphs, image_index = split_parsed_section(sections, pos)
        extra: dict[str, Any] = {}
        faces = (sec.get("facenet_details") or {}).get("embeddings")
        if faces:
            extra["faces"] = faces
        if sec.get("named_entities"):
            extra["named_entities"] = sec["named_entities"]
        yield CaptionSample(
            id=str(sec["hash"]),
            caption=caption,
            image_path=str(Path(image_root) / f"{sec['hash']}.jpg") if image_root else None,
            image_id=str(sec["hash"]),
            article_id=str(article.get("_id")),
            title=title.strip(),
            paragraphs=paragraphs,
            image_position=image_index,
            split=split,
            source="nytimes800k",
            extra=extra,
        )


def _collect(articles: Iterable[dict[str, Any]], split: str | None, image_root, limit: int | None) -> list[CaptionSample]:
    out: list[CaptionSample] = []
    for art in articles:
        if split is not None and SPLITS.get(str(art.get("split", ""))) != split:
            continue
        out.extend(samples_from_article(art, image_root))
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def load_nytimes_archive(
    path: str | os.PathLike,
    split: str | None = None,
    image_root: str | os.PathLike | None = None,
    *,
    db: str = "nytimes",
    objects: bool = False,
    limit: int | None = None,
) -> list[CaptionSample]:
    """Samples of ``split`` (None = all) from a mongodump archive of the ``nytimes`` database."""
    from tellkit.data.mongo_archive import iter_documents

    wanted = {f"{db}.articles"} | ({f"{db}.objects"} if objects else set())
    object_feats: dict[str, Any] = {}

    def articles():
        for ns, doc in iter_documents(path, wanted, skip_fields=("parts_of_speech",)):  # unused, bulky
            if ns.endswith(".objects"):
                object_feats[str(doc.get("_id"))] = doc.get("object_features")
            else:
                yield doc

    samples = _collect(articles(), split, image_root, limit)
    if not samples and limit != 0:
        raise TellkitError(f"{path}: no {split or ''} captions in {db}.articles".replace("  ", " "))
    if objects:
        for s in samples:
            if s.image_id in object_feats:
                s.extra["objects"] = object_feats[s.image_id]
    return samples


def load_nytimes_mongo(
    uri: str,
    split: str | None = None,
    image_root: str | os.PathLike | None = None,
    *,
    db: str = "nytimes",
    limit: int | None = None,
    client=None,
) -> list[CaptionSample]:
    """Samples from a running MongoDB (``mongodb://host:27017``); needs ``tellkit[mongo]``.
    ``client``: an already connected client (tests pass a stand-in)."""
    if client is None:
        from tellkit.utils.optional import require

        pymongo = require("pymongo", "mongo", "reading NYTimes800k from MongoDB")
        client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=10_000)
    query: dict[str, Any] = {}
    if split is not None:
        query["split"] = {"$in": [k for k, v in SPLITS.items() if v == split]}
    projection = ["_id", "split", "headline", "image_positions", "parsed_section"]
    try:
        cursor = client[db]["articles"].find(query, projection=projection)
        return _collect(cursor, split, image_root, limit)
    except Exception as exc:  # pymongo.errors.PyMongoError: unreachable server, auth, ...
        if type(exc).__module__.startswith("pymongo"):
            raise TellkitError(f"MongoDB {uri}: {exc}") from exc
        raise
