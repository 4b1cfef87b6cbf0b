"""Request limits of the serving API and the checks that enforce them.

Every violation raises :class:`RequestError` carrying an HTTP status (4xx), a stable code and a
one-line message; the app turns it into ``{"error": code, "detail": message}``. Images go
through :func:`tellkit.utils.images.decode_image`: the format and the pixel count are checked
from the header BEFORE any pixel is decoded (a small file that expands to a huge bitmap, a
"decompression bomb", is refused cheaply), and large images are shrunk while being decoded.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tellkit.recipes import MAX_BEAM_SIZE, MAX_GENERATION_LEN
from tellkit.utils.images import ImageError
from tellkit.utils.images import decode_image as safe_decode

# Formats a person is likely to upload; anything else PIL might read (TIFF, EPS, ICO, ...) is refused.
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "BMP": "image/bmp",
                 "GIF": "image/gif"}


# Upper bounds of the settings themselves: a flag past one is a mistake (or an attack on the
# operator), refused in one line at start-up instead of serving without a limit.
SETTING_CAPS = {"max_upload_bytes": 1 << 30, "max_image_pixels": 64_000_000, "max_article_chars": 1_000_000,
                "max_queue": 10_000, "max_inflight": 10_000, "max_receiving": 100_000, "max_decoding": 64,
                "caption_max_side": 8192, "math_max_side": 8192, "max_beam_size": MAX_BEAM_SIZE,
                "max_gen_len": MAX_GENERATION_LEN, "max_search_rows": 65_536, "max_stroke_count": 1_000_000,
                "max_stroke_points": 10_000_000, "max_stroke_chars": 1 << 30, "memory_budget_mb": 1 << 20,
                "max_buffered_mb": 1 << 20, "input_budget_mb": 1 << 20,
                "request_timeout_s": 3600.0, "decode_timeout_s": 3600.0, "header_timeout_s": 3600.0,
                "body_idle_timeout_s": 3600.0,
                "body_timeout_s": 3600.0, "body_grace_s": 3600.0, "stalled_body_s": 3600.0, "min_body_rate": 1 << 30}


@dataclass
class Limits:
    max_upload_bytes: int = 8 * 1024 * 1024     # whole request body
    max_image_pixels: int = 16_000_000          # width x height of an uploaded image
    min_image_side: int = 8                     # smaller images carry nothing to caption
    max_article_chars: int = 20_000             # pasted article text (UTF-8); also any other text field
    request_timeout_s: float = 60.0             # queueing + model time per request
    max_queue: int = 64                         # waiting requests per model; beyond: 503
    max_inflight: int = 32                      # API requests admitted at once (once their body is in); beyond: 503
    max_receiving: int = 512                    # requests whose body is still arriving; beyond: 503 at the headers
    max_decoding: int = 2                       # images decoded at once (bounds the decoders' peak memory)
    decode_timeout_s: float = 2.0               # one image's decoding; past it 422 and the decoder is free again
    caption_max_side: int = 1600                # larger photos are shrunk first (MTCNN cost grows with pixels)
    math_max_side: int = 1024                   # larger expression images are shrunk (CROHME: < 320k pixels)
    header_timeout_s: float = 10.0              # the request line and headers must arrive within this
    body_idle_timeout_s: float = 15.0           # longest silence while the body is being received
    body_timeout_s: float = 120.0               # the whole body must arrive within this
    body_grace_s: float = 10.0                  # after this the body must keep up min_body_rate on average ...
    min_body_rate: int = 8 * 1024               # ... bytes a second (a slow upload is cut, not waited for)
    stalled_body_s: float = 5.0                 # a body silent this long is cut (408) when the body buffer is full
    max_discard_bytes: int = 64 * 1024 * 1024   # rest of a refused body read and dropped so the client gets the answer
    max_beam_size: int = 16                     # a checkpoint's larger beam is served at this width
    max_gen_len: int = 256                      # a checkpoint's longer max_len is served at this length
    max_search_rows: int = 64                   # images x beam in one forward pass (smaller batches past it)
    max_stroke_count: int = 2_000               # strokes in one drawing
    max_stroke_points: int = 100_000            # points in all its strokes
    max_stroke_chars: int = 5_000_000           # characters of the 'strokes' field (~40 a point at full precision)
    memory_budget_mb: int = 384                 # estimated model working memory of the batches running at once
    max_buffered_mb: int = 128                  # request bodies held by all connections at once; beyond: 503
    input_budget_mb: int = 256                  # decoded images, parsed strokes, articles held at once; beyond: 503

    def __post_init__(self):
        for name in ("max_upload_bytes", "max_image_pixels", "max_article_chars", "max_queue", "max_inflight",
                     "max_receiving", "max_decoding", "caption_max_side", "math_max_side", "max_beam_size",
                     "max_gen_len", "max_search_rows", "max_stroke_count", "max_stroke_points", "max_stroke_chars",
                     "memory_budget_mb", "max_buffered_mb", "input_budget_mb", "min_body_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= SETTING_CAPS[name]:
                raise ValueError(f"{name} must be a whole number from 1 to {SETTING_CAPS[name]:,}, got {v!r}")
        for name in ("request_timeout_s", "decode_timeout_s", "header_timeout_s", "body_idle_timeout_s",
                     "body_timeout_s", "body_grace_s", "stalled_body_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= SETTING_CAPS[name]:
                raise ValueError(f"{name} must be a number of seconds above 0 and at most "
                                 f"{SETTING_CAPS[name]:g}, got {v!r}")
        if self.max_discard_bytes < 0:
            raise ValueError("max_discard_bytes must be >= 0")

    @property
    def memory_budget_bytes(self) -> int:
        return self.memory_budget_mb << 20

    @property
    def max_buffered_bytes(self) -> int:
        return self.max_buffered_mb << 20

    @property
    def input_budget_bytes(self) -> int:
        return self.input_budget_mb << 20


class RequestError(Exception):
    """A client error: ``status`` (4xx/5xx), ``code`` (stable, machine-readable), message;
    ``retry_after`` (seconds) becomes a ``Retry-After`` header (a 503 busy)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, int(self.retry_after)))}


# tellkit.utils.images.ImageError reasons -> (status, code) of the API
_IMAGE_ERRORS = {"empty": (400, "empty_file"), "not an image": (415, "not_an_image"),
                 "unsupported format": (415, "unsupported_image_format"), "too many pixels": (413, "image_too_large"),
                 "too small": (422, "image_too_small"), "corrupt or truncated": (400, "corrupt_image"),
                 "too complex": (422, "image_too_complex")}


def decode_image(source, limits: Limits, declared_type: str | None = None, max_side: int | None = None,
                 before_decoding=None):
    """Bytes (or a binary file) of an uploaded image -> (RGB PIL image no longer than ``max_side``,
    original ``[width, height]`` or None when not shrunk), or RequestError: 415 for a declared
    non-image type or an unsupported format, 400 for empty or unreadable bytes, 413 over the
    pixel cap, 422 for a degenerate (tiny) image or one whose decoding would take too much work
    (a JPEG's scans, a PNG's chunks, an animation's frames past their limits) or takes longer
    than ``limits.decode_timeout_s`` (the decode stops there, freeing its thread).
    ``before_decoding(width, height, out_size)``: called before any pixel is decoded (what it
    raises is raised)."""

    if declared_type and not (declared_type.startswith("image/") or declared_type == "application/octet-stream"):
        raise RequestError(415, "unsupported_media_type", "expected an image upload (PNG, JPEG, WebP, BMP or GIF), "
                           f"got content type '{declared_type}'")
    try:
        out = safe_decode(source, max_pixels=limits.max_image_pixels, mode="RGB", max_side=max_side,
                          formats=tuple(IMAGE_FORMATS), min_side=limits.min_image_side,
                          time_budget_s=limits.decode_timeout_s, before_decoding=before_decoding)
    except ImageError as exc:
        status, code = _IMAGE_ERRORS.get(exc.reason, (400, "corrupt_image"))
        msg = str(exc)
        if exc.reason == "too many pixels":
            msg = msg.split(" (a decompression-bomb guard")[0]
        elif exc.reason == "empty":
            msg = "the uploaded image file is empty"
        raise RequestError(status, code, msg) from None
    return out.image, (list(out.original_size) if out.resized else None)


MAX_BOUNDARY = 256  # characters of a multipart boundary (RFC 2046 allows 70)


def check_framing(headers: dict, limits: Limits) -> RequestError | None:
    """What the request's headers alone refuse: Content-Length together with Transfer-Encoding
    (RFC 9112 6.3: a smuggling vector; 400 and the connection is closed), a bad or over-limit
    Content-Length, a multipart boundary over :data:`MAX_BOUNDARY` characters."""
    length = headers.get(b"content-length")
    if length is not None and headers.get(b"transfer-encoding") is not None:
        return RequestError(400, "bad_framing", "both Content-Length and Transfer-Encoding are given "
                            "(RFC 9112 section 6.3); send one")
    if length is not None:
        if not length.strip().isdigit():
            return RequestError(400, "bad_content_length", "invalid Content-Length")
        if int(length) > limits.max_upload_bytes:
            return RequestError(413, "request_too_large",
                                f"request body over the limit of {limits.max_upload_bytes:,} bytes")
    ctype = headers.get(b"content-type") or b""
    if ctype.split(b";")[0].strip().lower() == b"multipart/form-data":
        boundary = multipart_boundary(ctype)
        if boundary is not None and len(boundary) > MAX_BOUNDARY:
            return RequestError(400, "bad_request", f"the multipart boundary has {len(boundary):,} characters, "
                                f"over the limit of {MAX_BOUNDARY}")
    return None


_RANGE = re.compile(rb"\s*(\d*)\s*-\s*(\d*)\s*")


def check_range(scope, headers: dict) -> RequestError | None:
    """A GET whose Range header asks for a range that ends before it starts (``bytes=100-1``):
    416 JSON, before the file is opened (the static-file server answered a text/plain 400)."""
    value = headers.get(b"range")
    if value is None or scope.get("method") not in ("GET", "HEAD"):
        return None
    unit, _, specs = value.partition(b"=")
    if unit.strip().lower() != b"bytes":
        return None
    for spec in specs.split(b","):
        m = _RANGE.fullmatch(spec)
        backwards = m is not None and m.group(1) and m.group(2) and int(m.group(1)) > int(m.group(2))
        if m is None or backwards or m.group(1) == m.group(2) == b"":
            return RequestError(416, "range_not_satisfiable", f"Range {value.decode('latin-1')[:80]!r}: a byte "
                                "range must be FIRST-LAST with FIRST <= LAST, FIRST-, or -SUFFIX")
    return None


def multipart_boundary(content_type: bytes) -> bytes | None:
    """The boundary parameter of a multipart Content-Type, or None."""
    from python_multipart.multipart import parse_options_header  # optional

    return parse_options_header(content_type)[1].get(b"boundary") or None


def check_article(text: str | None, limits: Limits) -> str:
    """Normalise an optional article: None -> "", refuse over-long text (413) and NUL bytes."""
    if text is None:
        return ""
    if "\x00" in text:
        raise RequestError(422, "bad_article", "the article contains NUL characters")
    if len(text) > limits.max_article_chars:
        raise RequestError(413, "article_too_long",
                           f"article has {len(text):,} characters, over the limit of {limits.max_article_chars:,}")
    return text.strip()
