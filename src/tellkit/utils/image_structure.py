"""How much work an image's decoding will take, counted from its structure without decoding it.

    count_structure(data) -> Structure(format, scans, chunks, frames, segments)
    check_structure(data, where="") -> None, or ImageError(reason="too complex")

A file's pixel count does not bound the work of decoding it: a progressive JPEG decodes every
scan over the whole image (a 4000x4000 JPEG of 837 KB that repeats one scan 25,000 times took
over a minute), a PNG is read chunk by chunk (each in Python), an animation frame by frame.
These walks read only the segment headers (JPEG markers, PNG chunk headers, GIF blocks, RIFF
chunks): the entropy-coded data of a JPEG scan is skipped with one regular-expression search for
the next marker, so a walk over an 8 MiB upload takes milliseconds.

The limits (:data:`MAX_JPEG_SCANS` ...) sit far above what encoders write (a progressive JPEG has
about 10 scans, libjpeg's densest script under 70; PNG writers split IDAT into 8-64 KiB chunks)
and far below what makes decoding slow.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from tellkit.errors import TellkitError

MAX_JPEG_SCANS = 256
# scans x pixels: each scan of a progressive JPEG is decoded over the whole image (a refinement scan
# of a 4000 x 4000 image took 13 ms on a 2-core AVX2 CPU, so 256 of them 3.3 s); this allows 93
# scans at 16 M pixels (the server's cap), 23 at 64 M, and a normal progressive JPEG has about 10
MAX_JPEG_SCAN_PIXELS = 1_500_000_000
MAX_JPEG_SEGMENTS = 4096
MAX_PNG_CHUNKS = 65_536
MAX_FRAMES = 1024
MAX_GIF_BLOCKS = 65_536

# in entropy-coded data, 0xFF is followed by 0x00 (a stuffed byte), a restart marker (D0-D7) or
# another 0xFF (fill): anything else is the next marker
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_STANDALONE = set(range(0xD0, 0xDA)) | {0x01}  # RSTn, SOI, EOI, TEM: no length field
_FRAME_HEADERS = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOF0-SOF15 (not DHT, JPG, DAC)


class ImageStructureError(TellkitError):
    """Decoding would take more work than accepted; ``reason`` is "too complex"."""

    reason = "too complex"


@dataclass
class Structure:
    format: str | None = None   # "JPEG", "PNG", "GIF", "WEBP" or None (not walked)
    scans: int = 0              # JPEG: start-of-scan markers
    chunks: int = 0             # PNG: chunks (all kinds); WebP: RIFF chunks
    idat: int = 0               # PNG: image data chunks
    frames: int = 0             # animation frames (PNG fcTL, GIF images, WebP ANMF); 1 for a still image
    segments: int = 0           # JPEG: marker segments; GIF: blocks
    pixels: int = 0             # JPEG: width x height from its frame header


def _jpeg(data) -> Structure:
    s = Structure("JPEG", frames=1)
    pos, n = 2, len(data)
    while pos + 4 <= n and s.segments <= MAX_JPEG_SEGMENTS and s.scans <= MAX_JPEG_SCANS:
        if data[pos] != 0xFF:
            break  # not a marker where one must be: PIL reports the damage
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        s.segments += 1
        if marker == 0xD9:  # end of image
            break
        if marker in _STANDALONE:
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        if marker in _FRAME_HEADERS and pos + 9 <= n:  # precision, height, width
            s.pixels = ((data[pos + 5] << 8) | data[pos + 6]) * ((data[pos + 7] << 8) | data[pos + 8])
        pos += 2 + length
        if marker == 0xDA:  # start of scan: its entropy-coded data runs to the next marker
            s.scans += 1
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                break
            pos = found.start()
    return s


def _png(data) -> Structure:
    s = Structure("PNG", frames=1)
    pos, n = 8, len(data)
    while pos + 8 <= n and s.chunks <= MAX_PNG_CHUNKS:
        length, kind = struct.unpack_from(">I4s", data, pos)
        s.chunks += 1
        if kind == b"IDAT":
            s.idat += 1
        elif kind == b"acTL" and pos + 12 <= n:
            s.frames = max(s.frames, struct.unpack_from(">I", data, pos + 8)[0])
        elif kind == b"IEND":
            break
        pos += 12 + length
    return s


def _gif(data) -> Structure:
    s = Structure("GIF")
    n = len(data)
    if n < 13:
        return s
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while pos < n and s.segments <= MAX_GIF_BLOCKS and s.frames <= MAX_FRAMES:
        kind = data[pos]
        s.segments += 1
        if kind == 0x3B:  # trailer
            break
        if kind == 0x21:  # extension: label, then sub-blocks
            pos += 2
        elif kind == 0x2C:  # image descriptor, optional local colour table, LZW code size, sub-blocks
            s.frames += 1
            if pos + 10 > n:
                break
            local = data[pos + 9]
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
        else:
            break
        while pos < n:  # sub-blocks: a length byte, then that many bytes; 0 ends them
            size = data[pos]
            pos += 1 + size
            if size == 0:
                break
            s.segments += 1
            if s.segments > MAX_GIF_BLOCKS:
                break
    return s


def _webp(data) -> Structure:
    s = Structure("WEBP", frames=1)
    pos, n, anmf = 12, len(data), 0
    while pos + 8 <= n and s.chunks <= MAX_PNG_CHUNKS:
        kind, length = struct.unpack_from("<4sI", data, pos)
        s.chunks += 1
        anmf += kind == b"ANMF"
        pos += 8 + length + (length & 1)
    s.frames = max(1, anmf)
    return s


def count_structure(data) -> Structure:
    """Walk the structure of an image's bytes (``bytes``, ``memoryview`` or ``mmap``); the walk
    stops early once a count passes its limit. Formats not walked give ``Structure(None)``."""
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return _jpeg(data)
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return _png(data)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(data)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp(data)
    return Structure()


def check_structure(data, where: str = "") -> Structure:
    """:func:`count_structure`, refused with a one-line :class:`ImageStructureError` past a limit."""
    s = count_structure(data)
    checks = (("JPEG", s.scans, MAX_JPEG_SCANS, "scans (a progressive JPEG decodes each over the whole image)"),
              ("JPEG", s.segments, MAX_JPEG_SEGMENTS, "marker segments"),
              ("PNG", s.chunks, MAX_PNG_CHUNKS, "chunks"),
              ("WEBP", s.chunks, MAX_PNG_CHUNKS, "chunks"),
              ("GIF", s.segments, MAX_GIF_BLOCKS, "blocks"),
              (s.format, s.frames, MAX_FRAMES, "animation frames"))
    if s.format == "JPEG" and s.scans * s.pixels > MAX_JPEG_SCAN_PIXELS:
        raise ImageStructureError(f"{where}the JPEG image has {s.scans} scans over {s.pixels:,} pixels, more decoding "
                                  f"work than accepted ({MAX_JPEG_SCAN_PIXELS:,} scan-pixels); refused before "
                                  "decoding")
    for fmt, count, limit, what in checks:
        if fmt == s.format and count > limit:
            name = "WebP" if fmt == "WEBP" else fmt
            raise ImageStructureError(f"{where}the {name} image has more than {limit:,} {what}; refused "
                                      "before decoding")
    return s
