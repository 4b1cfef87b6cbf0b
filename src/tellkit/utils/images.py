"""One safe decoder for untrusted images (server uploads, ``tellkit recognize`` / ``caption`` files).

    open_image(path_or_bytes, max_pixels=None, mode="RGB", max_side=None) -> PIL.Image.Image
    decode_image(...) -> DecodedImage(image, original_size, format)     # the same, with what was read

What it guarantees, in order:

1. Before anything is decoded, the work is bounded: a JPEG's scans, a PNG's chunks, an
   animation's frames are counted from the file's structure and refused past the limits of
   :mod:`tellkit.utils.image_structure` (reason "too complex"). Only the header is read before
   the other checks: the format must be one of ``formats`` (PNG, JPEG, WebP, BMP, GIF, TIFF, PPM
   by default; never EPS, which PIL hands to Ghostscript), and width x height must be at most
   ``max_pixels`` (argument, else ``TELLKIT_MAX_IMAGE_PIXELS``, else :data:`DEFAULT_MAX_PIXELS`).
   A small file that declares a huge bitmap (a decompression bomb) is refused before any pixel is decoded.
2. With ``max_side``, JPEGs are decoded at a reduced DCT scale (``draft``) and every image is
   shrunk (box ``reduce`` then bilinear) before any colour conversion, so conversions run on the
   small image.
3. Conversions never make float64 copies of the whole image: 16-bit / 32-bit / float grayscale
   is rescaled to 8 bits strip by strip in float32; transparency is composited over white
   without RGBA copies of the canvas.

Peak memory of one decode is therefore about one decoded full-size bitmap (bytes per pixel of
the file's mode: 1 for L, 2 for 16-bit gray, 3 for RGB, 4 for RGBA) plus the output, instead of
several float copies. Every refusal is an :class:`ImageError` (a :class:`TellkitError`, one line)
whose ``reason`` is one of :data:`REASONS`.
"""
from __future__ import annotations

import io
import os
import re
import stat
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Union

from tellkit.errors import TellkitError
from tellkit.utils.image_structure import ImageStructureError, check_structure

DEFAULT_MAX_PIXELS = 64_000_000  # ~8000 x 8000; photos and scanned expressions are far smaller
SAFE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF", "PPM")
REASONS = ("not found", "directory", "not a regular file", "empty", "not an image", "unsupported format",
           "too many pixels", "too small", "corrupt or truncated", "too complex")
_STRIP_PIXELS = 1 << 20  # pixels converted at once (a strip of rows)

# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose)
_ORIENTATION = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
                7: "TRANSVERSE", 8: "ROTATE_90"}

Source = Union[str, os.PathLike, bytes, bytearray, memoryview, IO[bytes]]  # noqa: UP007 - a runtime alias on 3.10


class ImageError(TellkitError):
    """An image that cannot be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class DecodedImage:
    image: object               # PIL.Image.Image in the requested mode
    original_size: tuple        # (width, height) upright, before any shrinking
    format: str                 # PIL's format name, e.g. "PNG"

    @property
    def resized(self) -> bool:
        return tuple(self.image.size) != tuple(self.original_size)


def max_pixels_default() -> int:
    env = os.environ.get("TELLKIT_MAX_IMAGE_PIXELS")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise TellkitError(f"TELLKIT_MAX_IMAGE_PIXELS must be an integer, got {env!r}") from None
        if value < 1:
            raise TellkitError(f"TELLKIT_MAX_IMAGE_PIXELS must be >= 1, got {value}")
        return value
    return DEFAULT_MAX_PIXELS


class _TimedFile:
    """``fp`` whose every read checks the clock: past ``deadline`` (``time.monotonic``) a read
    raises an :class:`ImageError` ("too complex"). PIL feeds its decoders from reads of at most
    ``decodermaxblock`` bytes (set to :data:`_READ_PIECE` for a timed decode), and libjpeg decodes
    a progressive JPEG's scans, zlib a PNG's data, as those bytes arrive, so a decode past its time
    stops within about one piece's work and gives its thread back."""

    def __init__(self, fp, deadline: float, budget_s: float, where: str):
        self._fp, self._deadline, self._budget_s, self._where = fp, deadline, budget_s, where

    def read(self, n: int = -1) -> bytes:
        if time.monotonic() > self._deadline:
            raise ImageError(f"{self._where}decoding the image took longer than {self._budget_s:g} s",
                             "too complex")
        return self._fp.read(n)

    def __getattr__(self, name: str):
        return getattr(self._fp, name)


_READ_PIECE = 16 << 10  # bytes a timed decode reads at once


def open_image(source: Source, max_pixels: int | None = None, mode: str = "RGB", max_side: int | None = None,
               formats: tuple[str, ...] | None = SAFE_FORMATS, min_side: int = 1, exif: bool = True):
    """Decode an untrusted image safely (see the module docstring) -> PIL image in ``mode``."""
    return decode_image(source, max_pixels=max_pixels, mode=mode, max_side=max_side, formats=formats,
                        min_side=min_side, exif=exif).image


def decode_image(source: Source, max_pixels: int | None = None, mode: str = "RGB", max_side: int | None = None,
                 formats: tuple[str, ...] | None = SAFE_FORMATS, min_side: int = 1, exif: bool = True,
                 time_budget_s: float | None = None,
                 before_decoding: Callable[[int, int, tuple[int, int]], None] | None = None) -> DecodedImage:
    """``source``: a path, the file's bytes, or a binary file object. ``mode``: "RGB" or "L".
    ``max_side``: shrink (never enlarge) so the longer side is at most this. ``formats``: PIL
    format names accepted (None: any format PIL can read). ``exif``: turn the image upright as
    its EXIF orientation says (False: the pixels as stored, as the Transform and Tell reference
    read its data sets' images). ``time_budget_s``: seconds the decoding may take (None: no
    limit); past it the decode stops with an :class:`ImageError` ("too complex") and its thread
    is free again (:class:`_TimedFile`). ``before_decoding(width, height, out_size)``: called once
    the header has passed the checks, before any pixel is decoded (the server takes the memory
    the decoding needs there; what it raises is raised). Raises :class:`ImageError`."""
    from PIL import Image, UnidentifiedImageError  # heavy

    if mode not in ("RGB", "L"):
        raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
    cap = int(max_pixels) if max_pixels is not None else max_pixels_default()
    fp, label = _open_source(source)
    where = f"{label}: " if label else ""
    try:
        _check_work(fp, where)
        if time_budget_s is not None:
            fp = _TimedFile(fp, time.monotonic() + time_budget_s, time_budget_s, where)
        with warnings.catch_warnings():
            # PIL warns at its own (larger) cap and raises past twice that; ours is checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fp) as img:
                fmt = img.format or "unknown"
                if formats is not None and fmt not in formats:
                    raise ImageError(f"{where}image format {fmt} is not accepted; use {_names(formats)}",
                                     "unsupported format")
                w, h = img.size
                if w * h > cap:
                    raise ImageError(f"{where}image is {w}x{h} = {w * h:,} pixels, over the limit of {cap:,} "
                                     "(a decompression-bomb guard; TELLKIT_MAX_IMAGE_PIXELS raises it for the CLI)",
                                     "too many pixels")
                if min(w, h) < min_side:
                    raise ImageError(f"{where}image is {w}x{h}; each side must be at least {min_side} pixels",
                                     "too small")
                orientation = _orientation(img) if exif else 1
                upright = (h, w) if orientation in (5, 6, 7, 8) else (w, h)
                if before_decoding is not None:
                    before_decoding(w, h, _target((w, h), max_side) or (w, h))
                if isinstance(fp, _TimedFile):
                    img.decodermaxblock = _READ_PIECE
                out = _decode_small(img, mode, max_side)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"{where}not an image (or a format PIL cannot read)", "not an image") from None
    except Image.DecompressionBombError as exc:  # PIL's own guard, at twice Image.MAX_IMAGE_PIXELS

        found = re.search(r"\((\d+) pixels\)", str(exc))
        n = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
        raise ImageError(f"{where}image has {n} per its header, over the limit of {cap:,} (a decompression-bomb "
                         "guard; TELLKIT_MAX_IMAGE_PIXELS raises it for the CLI)", "too many pixels") from None
    except MemoryError:
        raise ImageError(f"{where}not enough memory to decode the image", "too many pixels") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, KeyError, ZeroDivisionError) as exc:
        # PIL's plugins signal broken files with any of these
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageError(f"{where}corrupt or truncated image ({msg})", "corrupt or truncated") from None
    finally:
        if label and hasattr(fp, "close"):
            fp.close()
    if orientation in _ORIENTATION:
        out = out.transpose(getattr(Image.Transpose, _ORIENTATION[orientation]))
    return DecodedImage(out, upright, fmt)


# --- steps -----------------------------------------------------------------------------------------
def _check_work(fp, where: str) -> None:
    """Count the file's scans / chunks / frames before decoding (:mod:`tellkit.utils.image_structure`);
    an :class:`ImageError` ("too complex") past a limit. ``fp`` is left where it was."""
    pos = fp.tell()
    view = None
    try:
        if isinstance(fp, io.BytesIO):
            view = fp.getbuffer()
            data = view
        elif isinstance(fp, io.BufferedReader) and fp.seekable():
            import mmap  # heavy

            data = view = mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ)
        else:
            fp.seek(0)
            data = fp.read()
        check_structure(data, where)
    except ImageStructureError as exc:
        raise ImageError(str(exc), "too complex") from None
    except (OSError, ValueError):
        pass  # unreadable here: PIL's open below reports it
    finally:
        if view is not None:
            view.release() if isinstance(view, memoryview) else view.close()
        fp.seek(pos)


def _open_source(source: Source):
    """-> (binary file object, label for messages: the path, or "" for bytes / file objects)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ImageError("the image is empty (0 bytes)", "empty")
        return io.BytesIO(bytes(source) if not isinstance(source, bytes) else source), ""
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        check_image_path(p)
        try:  # non-blocking, and checked again once open: a FIFO put there since never blocks the read
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise ImageError(f"{p}: cannot read ({exc.strerror or exc})", "not found") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            check_image_path(p)
        return os.fdopen(fd, "rb"), str(p)
    if hasattr(source, "read"):
        pos = source.tell() if hasattr(source, "tell") else 0
        head = source.read(1)
        if not head:
            raise ImageError("the image is empty (0 bytes)", "empty")
        source.seek(pos)
        return source, ""
    raise TypeError(f"expected a path, bytes or a binary file, got {type(source).__name__}")


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


def check_image_path(path: str | os.PathLike) -> None:
    """Refuse a path that is missing, a folder, not a regular file (a device, a FIFO: never
    opened, so nothing blocks or reads without end) or empty, with an :class:`ImageError`."""
    p = Path(path)
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise ImageError(f"{p}: image not found", "not found") from None
    except OSError as exc:
        raise ImageError(f"{p}: cannot read ({exc.strerror or exc})", "not found") from None
    if stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{p}: is a directory, expected an image file", "directory")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "a special file")
        raise ImageError(f"{p}: not a regular file: {kind}, expected an image file", "not a regular file")
    if st.st_size == 0:
        raise ImageError(f"{p}: the image file is empty (0 bytes)", "empty")


def _names(formats) -> str:
    return ", ".join("WebP" if f == "WEBP" else f for f in formats)


def _orientation(img) -> int:
    try:
        return int(img.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001 - a broken EXIF block only loses the orientation
        return 1


def _target(size, max_side: int | None):
    w, h = size
    if not max_side or max(w, h) <= max_side:
        return None
    f = max_side / max(w, h)
    return max(1, round(w * f)), max(1, round(h * f))


def _decode_small(img, mode: str, max_side: int | None):
    """Decode the first frame, then convert and box-reduce it strip by strip (so no full-size
    copy is made in another mode, premultiplied or as floats), then bilinear to the exact size."""
    from PIL import Image  # heavy

    target = _target(img.size, max_side)
    if target is not None and img.format == "JPEG":
        # DCT scaling: decode at 1/2, 1/4 or 1/8 while staying >= the target size
        img.draft(mode if img.mode in ("RGB", "L") else None, target)
    img.load()
    w, h = img.size
    factor = max(1, min(w // target[0], h // target[1])) if target is not None else 1
    if factor == 1 and img.mode == mode:
        return img.resize(target, Image.BILINEAR) if target is not None and img.size != target else img
    extrema = img.getextrema() if img.mode in _HIGH_DEPTH else None
    out = Image.new(mode, (-(-w // factor), -(-h // factor)))
    rows = max(factor, _STRIP_PIXELS // max(w, 1) // factor * factor)
    for top in range(0, h, rows):
        strip = _convert(img.crop((0, top, w, min(h, top + rows))), mode, extrema)
        out.paste(strip.reduce(factor) if factor > 1 else strip, (0, top // factor))
    if target is not None and out.size != target:
        out = out.resize(target, Image.BILINEAR)
    return out


_HIGH_DEPTH = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def _convert(img, mode: str, extrema=None):
    """Any PIL mode -> ``mode`` ("RGB" or "L"): transparency over white; high bit depth rescaled
    linearly from ``extrema`` (the whole image's min, max) to 0..255 in float32 (as
    :func:`tellkit.encoders.preprocess.to_rgb` does for whole images)."""
    import numpy as np  # heavy
    from PIL import Image  # heavy

    if img.mode == mode:
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in _HIGH_DEPTH:
        lo, hi = (float(x) for x in (extrema or img.getextrema()))
        if not (hi > lo) or not (np.isfinite(lo) and np.isfinite(hi)):
            img = Image.new("L", img.size, 0)
        else:
            a = np.array(img, dtype=np.float32)  # a writable copy of the strip (float images give a read-only view)
            a -= np.float32(lo)
            a *= np.float32(255.0 / (hi - lo))
            np.nan_to_num(a, copy=False)
            np.clip(a, 0, 255, out=a)
            img = Image.fromarray(np.rint(a).astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        base = Image.new(mode, img.size, 255 if mode == "L" else (255, 255, 255))
        alpha = img.getchannel("A" if img.mode in ("RGBA", "LA", "PA") else "a")
        base.paste(img.convert(mode), (0, 0), alpha)
        return base
    return img if img.mode == mode else img.convert(mode)
