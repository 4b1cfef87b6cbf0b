"""An embedded index of a news data set (SQLite): the archive or JSON is read ONCE, then every
split, article and image is found by key, and object vectors are read only when used.

    store = NewsStore.for_source("nytimes.archive.gz", "nytimes800k")   # built on first use
    store.articles("train")        # the decoded articles of a split, in archive order
    store.article("5a1b...")       # one article by id
    store.object_document("<image hash>")  # decoded when asked (None: the image has none)

NYTimes800k's ``mongodump --archive --gzip`` file is one gzip stream: reading a split without
an index means decompressing and decoding the whole archive again (4.4 ms an article). Indexing scans it
once, with a progress bar: each article is decoded (its bulky ``parts_of_speech`` skipped) and
stored compressed under its id with its split; each ``objects`` document is stored as its raw
BSON bytes under the image hash, undecoded, and decoded only when a sample's objects are read
(:class:`tellkit.data.nytimes.StoredVectors`), so a split's object vectors are never all held in
memory.
GoodNews's ``captioning_dataset.json`` is indexed the same way (one JSON read, one row per
article).

Where the index lives: ``$TELLKIT_CACHE/news`` (else ``$XDG_CACHE_HOME/tellkit/news``, else
``~/.cache/tellkit/news``), named after the source's absolute path; it records the source's
size and modification time and is rebuilt when they change. It is written to a temporary file
and renamed, so an interrupted indexing leaves no half index.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tellkit.data.mongo_archive import decode_document, iter_documents, peek_id
from tellkit.errors import TellkitError

VERSION = 1
FORMATS = ("nytimes800k", "goodnews")
_BATCH = 2000  # rows per transaction while indexing


def cache_dir() -> Path:
    base = os.environ.get("TELLKIT_CACHE")
    if base:
        return Path(base) / "news"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tellkit" / "news"


def _source_file(source: str | os.PathLike, fmt: str) -> Path:
    p = Path(source)
    return p / "captioning_dataset.json" if fmt == "goodnews" and p.is_dir() else p


def _stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _pack(doc: Any) -> bytes:
    return zlib.compress(json.dumps(doc, default=str, separators=(",", ":")).encode("utf-8"), 3)


def _unpack(blob: bytes) -> Any:
    return json.loads(zlib.decompress(blob))


class NewsStore:
    """Read access to an index written by :func:`build_index` (one connection per thread)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise TellkitError(f"{self.path}: no such news index")
        self._local = threading.local()
        meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        self.meta = {k: json.loads(v) for k, v in meta.items()}

    @property
    def _db(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None or getattr(self._local, "pid", None) != os.getpid():  # a forked worker opens its own
            con = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._local.con, self._local.pid = con, os.getpid()
        return con

    @classmethod
    def for_source(cls, source: str | os.PathLike, fmt: str, *, db: str = "nytimes",
                   progress: bool = True) -> NewsStore:
        """The index of ``source`` (built first when missing or when the source changed)."""
        return cls(ensure_index(source, fmt, db=db, progress=progress))

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM articles").fetchone()[0])

    def articles(self, splits: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
        """The articles whose stored ``split`` is one of ``splits`` (None: all), in source order."""
        if splits is None:
            rows = self._db.execute("SELECT doc FROM articles ORDER BY rowid")
        else:
            marks = ", ".join("?" * len(splits))
            rows = self._db.execute(f"SELECT doc FROM articles WHERE split IN ({marks}) ORDER BY rowid",
                                    [str(x) for x in splits])
        for (blob,) in rows:
            yield _unpack(blob)

    def article(self, article_id: str) -> dict[str, Any]:
        row = self._db.execute("SELECT doc FROM articles WHERE id = ?", (str(article_id),)).fetchone()
        if row is None:
            raise KeyError(article_id)
        return _unpack(row[0])

    def splits(self) -> dict[str | None, int]:
        return dict(self._db.execute("SELECT split, COUNT(*) FROM articles GROUP BY split").fetchall())

    def has_objects(self, image_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM objects WHERE id = ?", (str(image_id),)).fetchone() is not None

    def object_document(self, image_id: str) -> dict[str, Any] | None:
        """The image's ``objects`` document, decoded now (its per-box ``confidences`` and
        ``classes`` skipped); None when the archive has none for it."""
        row = self._db.execute("SELECT doc FROM objects WHERE id = ?", (str(image_id),)).fetchone()
        return None if row is None else decode_document(row[0], ("confidences", "classes"))


def index_path(source: str | os.PathLike, fmt: str) -> Path:
    src = _source_file(source, fmt).resolve()
    key = hashlib.sha1(f"{fmt}\0{src}".encode()).hexdigest()[:16]
    return cache_dir() / f"{src.name}-{key}.sqlite"


def ensure_index(source: str | os.PathLike, fmt: str, *, db: str = "nytimes", progress: bool = True) -> Path:
    """The index file of ``source``: reused when it records the source's current size and
    modification time, else built (:func:`build_index`)."""
    if fmt not in FORMATS:
        raise TellkitError(f"no news index for {fmt!r} ({', '.join(FORMATS)})")
    src = _source_file(source, fmt)
    if src.is_dir():
        raise TellkitError(f"{src}: a directory, not a {fmt} file")
    if not src.is_file():
        raise TellkitError(f"{src}: not found")
    path = index_path(source, fmt)
    if path.is_file():
        try:
            store = NewsStore(path)
            if (store.meta.get("stamp") == _stamp(src) and store.meta.get("version") == VERSION
                    and store.meta.get("db") == db):
                return path
        except (sqlite3.Error, TellkitError, ValueError):
            pass  # an unreadable or older index is rebuilt
    return build_index(src, fmt, path, db=db, progress=progress)


def build_index(src: Path, fmt: str, path: Path, *, db: str = "nytimes", progress: bool = True) -> Path:
    """Scan ``src`` once into the SQLite file ``path`` (written beside as a temporary, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.executescript("""
            PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
            CREATE TABLE articles (rowid INTEGER PRIMARY KEY, id TEXT UNIQUE, split TEXT, doc BLOB);
            CREATE TABLE objects (id TEXT PRIMARY KEY, doc BLOB);
        """)
        bar = tqdm(unit="doc", desc=f"indexing {src.name}", disable=not progress, dynamic_ncols=True)
        try:
            counts = _index_archive(con, src, db, bar) if fmt == "nytimes800k" else _index_goodnews(con, src, bar)
        finally:
            bar.close()
        con.execute("CREATE INDEX articles_split ON articles (split)")
        meta = {"version": VERSION, "format": fmt, "db": db, "stamp": _stamp(src), **counts}
        con.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
        con.commit()
    except BaseException:
        con.close()
        tmp.unlink(missing_ok=True)
        raise
    con.close()
    os.replace(tmp, path)
    return path


def _index_archive(con: sqlite3.Connection, src: Path, db: str, bar) -> dict[str, int]:
    articles, objects = f"{db}.articles", f"{db}.objects"
    n_art = n_obj = 0
    rows_a: list[tuple] = []
    rows_o: list[tuple] = []
    for ns, doc in iter_documents(src, {articles, objects}, skip_fields=("parts_of_speech",), raw={objects}):
        if ns == articles:
            rows_a.append((str(doc.get("_id")), doc.get("split"), _pack(doc)))
            n_art += 1
        else:
            rows_o.append((str(peek_id(doc)), bytes(doc)))
            n_obj += 1
        bar.update(1)
        if len(rows_a) + len(rows_o) >= _BATCH:
            _flush(con, rows_a, rows_o)
    _flush(con, rows_a, rows_o)
    return {"articles": n_art, "objects": n_obj}


def _index_goodnews(con: sqlite3.Connection, src: Path, bar) -> dict[str, int]:
    try:
        with open(src, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TellkitError(f"{src}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TellkitError(f"{src}: GoodNews files must hold JSON objects")
    rows: list[tuple] = []
    for aid, art in data.items():
        rows.append((str(aid), None, _pack({"_id": aid, **(art if isinstance(art, dict) else {})})))
        bar.update(1)
        if len(rows) >= _BATCH:
            _flush(con, rows, [])
    _flush(con, rows, [])
    return {"articles": len(data), "objects": 0}


def _flush(con: sqlite3.Connection, rows_a: list[tuple], rows_o: list[tuple]) -> None:
    con.executemany("INSERT OR REPLACE INTO articles (id, split, doc) VALUES (?, ?, ?)", rows_a)
    con.executemany("INSERT OR REPLACE INTO objects (id, doc) VALUES (?, ?)", rows_o)
    con.commit()
    rows_a.clear()
    rows_o.clear()
