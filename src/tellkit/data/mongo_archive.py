"""Read a ``mongodump --archive [--gzip]`` file directly, without a MongoDB server.

Archive layout (mongo-tools' archive format, version 0.1)::

    magic 0x8199e26d (little-endian int32)
    header document {concurrent_collections, version, server_version, tool_version}
    collection-metadata documents {db, collection, metadata (extended JSON), size} ...
    0xffffffff
    then, interleaved across collections, until the end of the stream:
      namespace header {db, collection, EOF: false, CRC: 0}, documents ..., 0xffffffff
      or an end-of-namespace header {db, collection, EOF: true, CRC}, 0xffffffff

With ``--gzip`` the whole stream is gzip-compressed (detected from its first bytes). Documents
are BSON; :func:`decode_document` is a small decoder for the types mongodump writes. Documents
of namespaces not asked for are skipped without being decoded.
"""
from __future__ import annotations

import datetime as _dt
import gzip
import io
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from tellkit.errors import TellkitError

MAGIC = 0x8199E26D
TERMINATOR = b"\xff\xff\xff\xff"

_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


class ObjectId(str):
    """A BSON ObjectId, kept as its 24-digit hex string."""


def _cstring(buf: bytes, i: int) -> tuple[str, int]:
    end = buf.index(b"\x00", i)
    return buf[i:end].decode("utf-8", "surrogateescape"), end + 1


_FAST_MIN_BYTES = 1024  # arrays at least this long try the vectorised all-doubles path


def _double_array(buf: bytes, i: int, end: int) -> list[float] | None:
    """The elements ``buf[i:end-1]`` of an array as floats when every one is a double with the
    key mongodump writes ("0", "1", ...); None otherwise (the caller decodes element by element).
    One numpy pass instead of a Python step per number: object vectors are 2048 doubles each."""
    import numpy as np  # heavy

    size = end - 1 - i
    offsets, pos, k, digits = [], 0, 0, 1
    while pos < size:
        per = 10 + digits  # type byte + key + NUL + 8 bytes
        count = min(10**digits - k, (size - pos) // per)
        if count <= 0:
            return None
        offsets.append(pos + per * np.arange(count, dtype=np.int64))
        pos += per * count
        k += count
        if k == 10**digits:
            digits += 1
        elif pos != size:
            return None
    if pos != size or k == 0:
        return None
    off = np.concatenate(offsets) + i
    raw = np.frombuffer(buf, dtype=np.uint8)
    key_len = np.where(np.arange(k) < 10, 1, np.floor(np.log10(np.maximum(np.arange(k), 1))).astype(np.int64) + 1)
    if not (raw[off] == 0x01).all() or not (raw[off + 1 + key_len] == 0).all():
        return None
    first = off + 2 + key_len
    values = raw[first[:, None] + np.arange(8)].copy().view("<f8").reshape(-1)
    return values.tolist()


def peek_id(data: bytes) -> Any:
    """The ``_id`` of a raw BSON document when it is its first field (as MongoDB stores it) and
    a string or ObjectId; None otherwise. Lets a reader skip documents without decoding them."""
    if len(data) < 8 or data[5:9] != b"_id\x00":
        return None
    t = data[4]
    if t == 0x02:
        n = _I32.unpack_from(data, 9)[0]
        return data[13:12 + n].decode("utf-8", "surrogateescape")
    if t == 0x07:
        return ObjectId(data[9:21].hex())
    return None


def _decode(buf: bytes, i: int, end: int, as_list: bool, skip: frozenset[str] = frozenset()) -> Any:
    out_d: dict[str, Any] = {}
    out_l: list[Any] = []
    while i < end - 1:
        t = buf[i]
        name, i = _cstring(buf, i + 1)
        if name in skip and t in (0x02, 0x03, 0x04):  # not wanted: jump over its bytes
            i += _I32.unpack_from(buf, i)[0] + (4 if t == 0x02 else 0)
            continue
        if t == 0x01:  # double
            v = _F64.unpack_from(buf, i)[0]
            i += 8
        elif t in (0x02, 0x0D, 0x0E):  # string, JavaScript code, symbol
            n = _I32.unpack_from(buf, i)[0]
            v = buf[i + 4 : i + 3 + n].decode("utf-8", "surrogateescape")
            i += 4 + n
        elif t in (0x03, 0x04):  # embedded document, array
            n = _I32.unpack_from(buf, i)[0]
            v = _double_array(buf, i + 4, i + n) if t == 0x04 and n >= _FAST_MIN_BYTES else None
            if v is None:
                v = _decode(buf, i + 4, i + n, t == 0x04, skip)
            i += n
        elif t == 0x05:  # binary
            n = _I32.unpack_from(buf, i)[0]
            v = bytes(buf[i + 5 : i + 5 + n])
            i += 5 + n
        elif t in (0x06, 0x0A, 0x7F, 0xFF):  # undefined, null, max key, min key
            v = None
        elif t == 0x07:  # ObjectId
            v = ObjectId(buf[i : i + 12].hex())
            i += 12
        elif t == 0x08:
            v = buf[i] != 0
            i += 1
        elif t == 0x09:  # UTC datetime, milliseconds since the epoch
            ms = _I64.unpack_from(buf, i)[0]
            v = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc) + _dt.timedelta(milliseconds=ms)
            i += 8
        elif t == 0x0B:  # regex: pattern, options
            pat, i = _cstring(buf, i)
            opts, i = _cstring(buf, i)
            v = {"$regex": pat, "$options": opts}
        elif t == 0x10:
            v = _I32.unpack_from(buf, i)[0]
            i += 4
        elif t == 0x11:  # timestamp
            v = _U64.unpack_from(buf, i)[0]
            i += 8
        elif t == 0x12:
            v = _I64.unpack_from(buf, i)[0]
            i += 8
        elif t == 0x13:  # decimal128: kept as raw bytes
            v = bytes(buf[i : i + 16])
            i += 16
        else:
            raise TellkitError(f"unsupported BSON element type 0x{t:02x} (field {name!r})")
        if as_list:
            out_l.append(v)
        else:
            out_d[name] = v
    if i != end - 1 or buf[end - 1] != 0:
        raise TellkitError("malformed BSON document")
    return out_l if as_list else out_d


def decode_document(data: bytes, skip_fields: Iterable[str] = ()) -> dict[str, Any]:
    """Decode one BSON document (``data`` starts with its int32 length). Fields named in
    ``skip_fields`` (strings, documents or arrays, at any depth) are left out undecoded."""
    if len(data) < 5 or _I32.unpack_from(data, 0)[0] != len(data):
        raise TellkitError("malformed BSON document (bad length)")
    try:
        return _decode(data, 4, len(data), False, frozenset(skip_fields))
    except (struct.error, ValueError, IndexError) as exc:
        raise TellkitError(f"malformed BSON document ({exc})") from exc


def _open(path: str | os.PathLike) -> BinaryIO:
    if os.path.isdir(path):
        raise TellkitError(f"{path}: is a directory (mongodump --out layout); expected a --archive file")
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise TellkitError(f"cannot open archive {path}: {exc.strerror}") from exc
    head = f.read(2)
    f.seek(0)
    if head == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f)  # type: ignore[return-value]
    return io.BufferedReader(f)  # type: ignore[arg-type]


class _Reader:
    def __init__(self, stream: BinaryIO, where: str, skip_fields: Iterable[str] = ()):
        self.s, self.where, self.skip = stream, where, frozenset(skip_fields)

    def exact(self, n: int) -> bytes:
        try:
            b = self.s.read(n)
        except (OSError, EOFError, zlib.error) as exc:  # gzip: truncated or corrupt
            raise TellkitError(f"{self.where}: corrupt or truncated archive ({exc})") from exc
        if len(b) != n:
            raise TellkitError(f"{self.where}: truncated archive (wanted {n} bytes, got {len(b)})")
        return b

    def block(self, decode: bool = True) -> dict[str, Any] | bytes | None:
        """The next document, or None at a terminator, or b"" at a clean end of stream."""
        try:
            head = self.s.read(4)
        except (OSError, EOFError, zlib.error) as exc:
            raise TellkitError(f"{self.where}: corrupt or truncated archive ({exc})") from exc
        if head == b"":
            return b""
        if len(head) < 4:
            raise TellkitError(f"{self.where}: truncated archive")
        if head == TERMINATOR:
            return None
        n = _I32.unpack(head)[0]
        if n < 5:
            raise TellkitError(f"{self.where}: corrupt archive (document length {n})")
        body = head + self.exact(n - 4)
        return decode_document(body, self.skip) if decode else body


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The archive header and its collection-metadata documents."""
    with _open(path) as s:
        r = _Reader(s, str(path))
        return _prelude(r)


def _prelude(r: _Reader) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        magic = r.s.read(4)
    except (OSError, EOFError, zlib.error) as exc:
        raise TellkitError(f"{r.where}: not a mongodump archive or corrupt gzip ({exc})") from exc
    if magic != struct.pack("<I", MAGIC):
        raise TellkitError(f"{r.where}: not a mongodump archive (bad magic number)")
    header = r.block()
    if not isinstance(header, dict):
        raise TellkitError(f"{r.where}: archive header missing")
    metas = []
    while True:
        b = r.block()
        if b is None:
            break
        if b == b"":
            raise TellkitError(f"{r.where}: truncated archive (inside the collection metadata)")
        metas.append(b)
    return header, metas


def iter_documents(path: str | os.PathLike, namespaces: set[str] | None = None,
                   skip_fields: Iterable[str] = (), ids: set | None = None,
                   raw: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """Yield ``("db.collection", document)`` for every document of the wanted namespaces;
    ``skip_fields``: field names not to decode (e.g. NYTimes800k's bulky ``parts_of_speech``);
    ``ids``: only documents whose ``_id`` (read without decoding the rest) is in it; ``raw``:
    namespaces whose documents are yielded as their BSON bytes, undecoded."""
    with _open(path) as s:
        r = _Reader(s, str(path), skip_fields)
        _prelude(r)
        while True:
            ns_head = r.block()
            if ns_head == b"":
                return
            if not isinstance(ns_head, dict) or "collection" not in ns_head:
                raise TellkitError(f"{r.where}: corrupt archive (expected a namespace header)")
            ns = f"{ns_head.get('db', '')}.{ns_head['collection']}"
            if ns_head.get("EOF"):
                if r.block() is not None:
                    raise TellkitError(f"{r.where}: corrupt archive (no terminator after end of {ns})")
                continue
            want = namespaces is None or ns in namespaces
            while True:
                doc = r.block(decode=want and ids is None and ns not in raw)
                if doc is None:
                    break
                if doc == b"":
                    raise TellkitError(f"{r.where}: truncated archive (inside {ns})")
                if want and ids is not None:
                    if peek_id(doc) not in ids:  # type: ignore[arg-type]
                        continue
                    if ns not in raw:
                        doc = decode_document(doc, r.skip)  # type: ignore[arg-type]
                if want:
                    yield ns, doc  # type: ignore[misc]
