"""The bitmap releases of the BTTR line of work, read where they lie (``data.layout: caption``).

* ``data.zip`` of BTTR and CoMER, read in place (``--data data.zip``, never unzipped): the
  archive holds a ``data/`` folder (or the split folders at its top) with one folder per split,
  ``train/``, ``2014/``, ``2016/``, ``2019/``, each with ``caption.txt`` (``<id><TAB>tokens``)
  and the images ``<id>.bmp``. Each image is read from the archive when the dataset asks for it;
  a member that would inflate past :data:`MAX_MEMBER_BYTES` is refused.
* TAMER / ICAL's folders: ``<split>/images.pkl`` (a pickled dict ``{id: uint8 array}``) beside
  ``<split>/caption.txt``, read through :func:`tellkit.utils.safe_unpickle.restricted_load`
  with numpy's array names only (arrays, numbers and strings; any other name in the file is
  refused before anything is imported or called).
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path, PurePosixPath

import numpy as np

from tellkit.data.crohme import IMAGE_SUFFIXES, Expression
from tellkit.data.latex import normalize
from tellkit.errors import TellkitError
from tellkit.utils.images import ImageError, open_image
from tellkit.utils.safe_unpickle import NUMPY_ARRAYS, restricted_load

MAX_MEMBER_BYTES = 64 << 20  # an image or caption file larger than this inflated is refused
# numpy's array names, and those of the other pickle protocols' spellings of arrays and bytes
# (protocol 5's in-band buffers, protocol 2's latin-1 strings)
ARRAY_NAMES = NUMPY_ARRAYS | {"numpy._core.numeric._frombuffer", "numpy.core.numeric._frombuffer", "_codecs.encode"}
_OPEN: dict[tuple[str, int], zipfile.ZipFile] = {}  # one handle per archive and process


def _archive(path: str) -> zipfile.ZipFile:
    key = (path, os.getpid())  # data-loading processes each open their own handle
    if key not in _OPEN:
        try:
            _OPEN[key] = zipfile.ZipFile(path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise TellkitError(f"{path}: not a readable zip archive ({exc})") from None
    return _OPEN[key]


def _read_member(path: str, name: str) -> bytes:
    zf = _archive(path)
    info = zf.getinfo(name)
    if info.file_size > MAX_MEMBER_BYTES:
        raise TellkitError(f"{path}: {name} inflates to {info.file_size:,} bytes (at most {MAX_MEMBER_BYTES:,})")
    with zf.open(info) as f:
        data = f.read(MAX_MEMBER_BYTES + 1)
    if len(data) > MAX_MEMBER_BYTES:
        raise TellkitError(f"{path}: {name} inflates past {MAX_MEMBER_BYTES:,} bytes")
    return data


class ZipImage:
    """An image inside a zip archive; :meth:`load` decodes it (a PIL image)."""

    def __init__(self, archive: str, member: str):
        self.archive, self.member = archive, member

    def __str__(self) -> str:
        return f"{self.archive}:{self.member}"

    def load(self):
        try:
            return open_image(_read_member(self.archive, self.member), mode="L")
        except ImageError as exc:
            raise TellkitError(f"{self}: not a readable image ({exc})") from None


class ArrayImage:
    """An image given as a uint8 array (``images.pkl``); :meth:`load` makes it a PIL image."""

    def __init__(self, name: str, array: np.ndarray):
        self.name, self.array = name, array

    def __str__(self) -> str:
        return self.name

    def load(self):
        from PIL import Image  # heavy

        a = np.asarray(self.array)
        if a.ndim == 3 and a.shape[-1] in (1, 3, 4):
            a = a[..., :3].mean(-1) if a.shape[-1] > 1 else a[..., 0]
        if a.ndim != 2 or a.size == 0:
            raise TellkitError(f"{self.name}: expected a grey image array [H, W], got shape {tuple(a.shape)}")
        if a.dtype != np.uint8:
            a = np.clip(a.astype(np.float64) * (255.0 if float(a.max(initial=0)) <= 1.0 else 1.0), 0, 255)
        return Image.fromarray(a.astype(np.uint8), mode="L")


def _captions(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            parts = line.split("\t", 1) if "\t" in line else line.split(None, 1)
            out.append((parts[0].strip(), parts[1].split() if len(parts) > 1 else []))
    return out


def _expressions(where: str, caps: list[tuple[str, list[str]]], image_of) -> list[Expression]:
    exprs = []
    for key, toks in caps:
        raw = " ".join(toks)
        exprs.append(Expression(key, image_of(key), normalize(raw), raw))
    if not exprs:
        raise TellkitError(f"{where}: caption.txt lists no expressions")
    return exprs


def load_zip_split(archive: str | os.PathLike, split: str) -> list[Expression]:
    """The split folder ``split`` (``train``, ``2014``...) of a BTTR/CoMER ``data.zip``."""
    path = str(archive)
    names = set(_archive(path).namelist())
    want = f"{split.strip('/')}/caption.txt"
    found = sorted(n for n in names if n == want or n.endswith("/" + want))
    if not found:
        tops = sorted({PurePosixPath(n).parent.name for n in names if n.endswith("/caption.txt")})
        raise TellkitError(f"{path}: no split '{split}' in the archive (its splits: {', '.join(tops) or 'none'})")
    folder = found[0][: -len("caption.txt")]
    caps = _captions(_read_member(path, found[0]).decode("utf-8"))

    def image_of(key: str) -> ZipImage:
        for sub in ("", "img/", "images/"):
            for suf in IMAGE_SUFFIXES:
                if f"{folder}{sub}{key}{suf}" in names:
                    return ZipImage(path, f"{folder}{sub}{key}{suf}")
        raise TellkitError(f"{path}: no image for '{key}' in {folder} (looked for {key}.bmp/.png/.jpg)")

    return _expressions(f"{path}:{found[0]}", caps, image_of)


def load_pickle_dir(folder: str | os.PathLike) -> list[Expression]:
    """A TAMER / ICAL split folder: ``images.pkl`` and ``caption.txt``."""
    d = Path(folder)
    if not (d / "caption.txt").is_file():
        raise TellkitError(f"{d}: images.pkl without caption.txt")
    with open(d / "images.pkl", "rb") as f:
        images = restricted_load(f, ARRAY_NAMES, str(d / "images.pkl"))
    if not isinstance(images, dict):
        raise TellkitError(f"{d / 'images.pkl'}: expected a dict of image arrays, got a {type(images).__name__}")

    def image_of(key: str) -> ArrayImage:
        a = images.get(key, images.get(f"{key}.bmp"))
        if not isinstance(a, np.ndarray) or a.dtype.hasobject:
            raise TellkitError(f"{d / 'images.pkl'}: no image array for '{key}'")
        return ArrayImage(f"{d / 'images.pkl'}[{key}]", a)

    return _expressions(str(d / "caption.txt"), _captions((d / "caption.txt").read_text(encoding="utf-8")), image_of)
