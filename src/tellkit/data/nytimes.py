"""NYTimes800k (Tran et al. 2020) in its distributed form: a MongoDB database ``nytimes``.

Read it straight from the ``mongodump --archive --gzip`` file (no server, no 61 GB restore) with
:func:`load_nytimes_archive`, or from a running MongoDB with :func:`load_nytimes_mongo`.

Collection ``articles``: ``_id``, ``split`` (train / valid / test), ``headline.main``,
``image_positions`` (indices into ``parsed_section``), ``parsed_section``: a list of
``{"type": "paragraph" | "caption", "text", "hash", "facenet_details": {"embeddings": ...}}``.
Each caption section gives one sample; its image is ``<image_root>/<hash>.jpg`` (the released
``images_processed`` are already resized to 256 and centre-cropped to 224); its paragraphs are
:func:`tellkit.encoders.context.split_parsed_section`'s (other captions as empty slots).

What a sample carries in ``sample.extra`` (float32 numpy arrays, as the reference fed them):

- ``faces`` [F, 512]: the shipped FaceNet embeddings of the caption section, the first
  ``max_faces`` (4; they are stored largest first). The dump records ``facenet_details`` only
  where faces were found, so a caption section without it is a recorded "no face": F = 0, as the
  reference reads it (never a reason to run a detector);
- ``objects`` [O, 2048]: with ``objects=True``, the image's document in collection ``objects``
  (``_id`` = image hash, ``object_features``: up to 64 YOLOv3 boxes through ResNet-152),
  at most ``max_objects``; O = 0 when the collection has the image with no box, absent when it
  does not have the image;
- ``named_entities``: the section's entities, when present.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tellkit.data.mongo_archive import iter_documents
from tellkit.data.news_store import NewsStore
from tellkit.data.sample import CaptionSample
from tellkit.encoders.context import split_parsed_section
from tellkit.errors import TellkitError
from tellkit.recipes import FACE_DIM, MAX_FACES, OBJECT_DIM
from tellkit.utils.optional import require

SPLITS = {"train": "train", "valid": "val", "val": "val", "test": "test"}
MAX_OBJECTS = 64  # the reference's YOLOv3 pass stores at most 64 boxes


def vectors(value: Any, dim: int, limit: int | None, what: str) -> np.ndarray:
    """A list of vectors (or an array) as float32 [N, dim], at most ``limit`` rows."""
    if value is None or (hasattr(value, "__len__") and len(value) == 0):
        return np.zeros((0, dim), np.float32)
    try:
        a = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise TellkitError(f"{what}: not a list of {dim}-d vectors ({exc})") from None
    if a.ndim != 2 or a.shape[1] != dim:
        raise TellkitError(f"{what}: expected vectors of {dim} numbers, got shape {a.shape}")
    return np.ascontiguousarray(a[:limit] if limit is not None else a)


def headline_text(article: dict[str, Any]) -> str:
    """An article's headline (``headline.main``, or the field itself when it is not an object),
    stripped; "" when there is none. GoodNews stores its headlines the same way."""
    headline = article.get("headline") or {}
    title = headline.get("main") if isinstance(headline, dict) else str(headline)
    return (title or "").strip()


def samples_from_article(article: dict[str, Any], image_root: str | os.PathLike | None = None,
                         objects: dict[str, Any] | None = None, max_faces: int = MAX_FACES,
                         max_objects: int = MAX_OBJECTS) -> Iterator[CaptionSample]:
    """The article's samples; ``objects``: image hash -> object features (collection ``objects``)."""

    sections = article.get("parsed_section") or []
    title = headline_text(article)
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
        found = sec.get("facenet_details")  # stored only where faces were found: absent = none
        extra["faces"] = vectors(found.get("embeddings") if isinstance(found, dict) else None, FACE_DIM,
                                 max_faces, f"faces of image {sec['hash']}")
        if objects is not None and str(sec["hash"]) in objects:
            extra["objects"] = vectors(objects[str(sec["hash"])], OBJECT_DIM, max_objects,
                                       f"objects of image {sec['hash']}")
        if sec.get("named_entities"):
            extra["named_entities"] = sec["named_entities"]
        yield CaptionSample(
            id=str(sec["hash"]),
            caption=caption,
            image_path=str(Path(image_root) / f"{sec['hash']}.jpg") if image_root else None,
            image_id=str(sec["hash"]),
            article_id=str(article.get("_id")),
            title=title,
            paragraphs=paragraphs,
            image_position=image_index,
            split=split,
            source="nytimes800k",
            extra=extra,
        )


def _collect(articles: Iterable[dict[str, Any]], split: str | None, image_root, limit: int | None,
             objects: dict[str, Any] | None = None) -> list[CaptionSample]:
    out: list[CaptionSample] = []
    for art in articles:
        if split is not None and SPLITS.get(str(art.get("split", ""))) != split:
            continue
        out.extend(samples_from_article(art, image_root, objects))
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
    index: bool = True,
    progress: bool = True,
) -> list[CaptionSample]:
    """Samples of ``split`` (None = all) from a mongodump archive of the ``nytimes`` database.
    ``image_root``: the images' folder; by default ``images_processed`` beside the archive when
    it exists (the release's layout). ``index`` (default): the archive is scanned once into an
    embedded index (:mod:`tellkit.data.news_store`, with a progress bar unless ``progress`` is
    false) and every later split is read from it by key; with ``objects`` each sample's object
    vectors stay in the index until used (:class:`StoredVectors`). ``index=False``: a scan of the
    archive per call, with a second pass that reads the chosen images' objects into memory."""

    if image_root is None and (Path(path).parent / "images_processed").is_dir():
        image_root = Path(path).parent / "images_processed"
    store = NewsStore.for_source(path, "nytimes800k", db=db, progress=progress) if index else None
    if store is not None:
        docs: Iterable[dict[str, Any]] = store.articles(
            None if split is None else [k for k, v in SPLITS.items() if v == split])
    else:
        docs = (doc for _, doc in iter_documents(path, {f"{db}.articles"}, skip_fields=("parts_of_speech",)))
    samples = _collect(docs, split, image_root, limit)
    if not samples and limit != 0:
        raise TellkitError(f"{path}: no {split or ''} captions in {db}.articles".replace("  ", " "))
    if objects and store is not None:
        for s in samples:
            if s.image_id and store.has_objects(s.image_id):
                s.extra["objects"] = StoredVectors(store, s.image_id)
    elif objects:
        attach_objects(samples, read_archive_objects(path, {s.image_id for s in samples}, db))
    return samples


def article_texts(article: dict[str, Any]) -> tuple[str, list[str]]:
    """(headline + paragraphs, the captions of the article's images) of one NYTimes800k article:
    the text the rare-name counts are tagged in (captions as :func:`samples_from_article` keeps them)."""
    sections = article.get("parsed_section") or []
    title = headline_text(article)
    paragraphs = [str(s.get("text") or "").strip() for s in sections if isinstance(s, dict)
                  and s.get("type") == "paragraph"]
    captions = []
    for pos in article.get("image_positions") or []:
        sec = sections[pos] if isinstance(pos, int) and 0 <= pos < len(sections) else {}
        text = str(sec.get("text") or "").strip()
        if sec.get("type") == "caption" and text and sec.get("hash"):
            captions.append(text)
    return "\n\n".join(t for t in [title, *paragraphs] if t), captions


def iter_nytimes_texts(path: str | os.PathLike, split: str, *, db: str = "nytimes", index: bool = True,
                       progress: bool = True, **_options: Any) -> Iterator[tuple[str, list[str]]]:
    """One article of ``split`` at a time from a mongodump archive, without loading the split:
    :func:`article_texts` of each article that has a caption. Through the embedded index as
    :func:`load_nytimes_archive` reads it (``index=False``: one scan of the archive)."""
    if index:
        docs: Iterable[dict[str, Any]] = NewsStore.for_source(path, "nytimes800k", db=db, progress=progress).articles(
            [k for k, v in SPLITS.items() if v == split])
    else:
        docs = (doc for _, doc in iter_documents(path, {f"{db}.articles"}, skip_fields=("parts_of_speech",)))
    for art in docs:
        if SPLITS.get(str(art.get("split", ""))) != split:
            continue
        article, captions = article_texts(art)
        if captions:
            yield article, captions


class StoredVectors:
    """One image's object vectors, left in the index until used: ``np.asarray(v)`` (and
    ``shape``, ``dtype``, indexing) read them; nothing is kept in memory in between."""

    def __init__(self, store: NewsStore, image_id: str):
        self.store, self.image_id = store, str(image_id)

    def load(self) -> np.ndarray:
        doc = self.store.object_document(self.image_id)
        if doc is None:
            raise TellkitError(f"{self.store.path}: no objects for image {self.image_id}")
        return vectors(doc.get("object_features"), OBJECT_DIM, MAX_OBJECTS, f"objects of image {self.image_id}")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.load()
        return a if dtype is None else a.astype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.load().shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        return self.load()[key]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the index by path
        return {"path": str(self.store.path), "image_id": self.image_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.store, self.image_id = NewsStore(state["path"]), state["image_id"]


def read_archive_objects(path: str | os.PathLike, hashes: set[str] | None, db: str) -> dict[str, np.ndarray]:
    """Image hash -> float32 [O, 2048] from collection ``<db>.objects`` of a mongodump archive."""

    out: dict[str, np.ndarray] = {}
    for _, doc in iter_documents(path, {f"{db}.objects"}, skip_fields=("confidences", "classes"), ids=hashes):
        key = str(doc.get("_id"))
        out[key] = vectors(doc.get("object_features"), OBJECT_DIM, MAX_OBJECTS, f"objects of image {key}")
    return out


def attach_objects(samples: list[CaptionSample], objects: dict[str, np.ndarray]) -> None:
    for s in samples:
        if s.image_id in objects:
            s.extra["objects"] = objects[s.image_id]


def load_nytimes_mongo(
    uri: str,
    split: str | None = None,
    image_root: str | os.PathLike | None = None,
    *,
    db: str = "nytimes",
    objects: bool = False,
    limit: int | None = None,
    client=None,
) -> list[CaptionSample]:
    """Samples from a running MongoDB (``mongodb://host:27017``); needs ``tellkit[mongo]``.
    ``objects``: also read collection ``objects`` for the chosen images. ``client``: an already
    connected client (tests pass a stand-in)."""
    if client is None:

        pymongo = require("pymongo", "mongo", "reading NYTimes800k from MongoDB")
        client = pymongo.MongoClient(uri, serverSelectionTimeoutMS=10_000)
    query: dict[str, Any] = {}
    if split is not None:
        query["split"] = {"$in": [k for k, v in SPLITS.items() if v == split]}
    projection = ["_id", "split", "headline", "image_positions", "parsed_section"]
    try:
        cursor = client[db]["articles"].find(query, projection=projection)
        samples = _collect(cursor, split, image_root, limit)
        if objects and samples:
            wanted = sorted({s.image_id for s in samples})
            found: dict[str, np.ndarray] = {}
            for start in range(0, len(wanted), 1000):  # bounded queries
                chunk = wanted[start:start + 1000]
                for doc in client[db]["objects"].find({"_id": {"$in": chunk}}, projection=["_id", "object_features"]):
                    key = str(doc.get("_id"))
                    found[key] = vectors(doc.get("object_features"), OBJECT_DIM, MAX_OBJECTS, f"objects of image {key}")
            attach_objects(samples, found)
        return samples
    except Exception as exc:  # pymongo.errors.PyMongoError: unreachable server, auth, ...
        if type(exc).__module__.startswith("pymongo"):
            raise TellkitError(f"MongoDB {uri}: {exc}") from exc
        raise
