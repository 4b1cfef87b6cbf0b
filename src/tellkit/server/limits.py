"""Request limits of the serving API and the checks that enforce them.

Every violation raises :class:`RequestError` carrying an HTTP status (4xx), a stable code and a
one-line message; the app turns it into ``{"error": code, "detail": message}``. Images are
checked BEFORE their pixels are decoded (the header gives the size), so a small file that
expands to a huge bitmap (a "decompression bomb") is refused cheaply.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

# Formats a person is likely to upload; anything else PIL might read (EPS, ICO, ...) is refused.
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "BMP": "image/bmp",
                 "GIF": "image/gif"}


@dataclass
class Limits:
    max_upload_bytes: int = 8 * 1024 * 1024     # whole request body
    max_image_pixels: int = 16_000_000          # width x height of an uploaded image
    min_image_side: int = 8                     # smaller images carry nothing to caption
    max_article_chars: int = 20_000             # pasted article text
    request_timeout_s: float = 60.0             # queueing + model time per request
    max_queue: int = 64                         # waiting requests per model; beyond: 503
    max_inflight: int = 32                      # requests admitted at once (all endpoints); beyond: 503
    caption_max_side: int = 1600                # larger photos are shrunk first (MTCNN cost grows with pixels)
    math_max_side: int = 1024                   # larger expression images are shrunk (CROHME: < 320k pixels)

    def __post_init__(self):
        for name in ("max_upload_bytes", "max_image_pixels", "max_article_chars", "max_queue", "max_inflight",
                     "caption_max_side", "math_max_side"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be > 0")


class RequestError(Exception):
    """A client error: ``status`` (4xx/5xx), ``code`` (stable, machine-readable), message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def decode_image(data: bytes, limits: Limits, declared_type: str | None = None):
    """Bytes of an uploaded file -> RGB PIL image (EXIF orientation applied), or RequestError:
    415 for a declared non-image type or an unsupported format, 400 for unreadable bytes,
    413 over the pixel cap, 422 for a degenerate (tiny) image."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    from tellkit.encoders.preprocess import to_rgb

    if declared_type and not (declared_type.startswith("image/") or declared_type == "application/octet-stream"):
        raise RequestError(415, "unsupported_media_type",
                           f"expected an image upload (PNG, JPEG, WebP, BMP or GIF), got content type '{declared_type}'")
    if not data:
        raise RequestError(400, "empty_file", "the uploaded image file is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                fmt = img.format
                if fmt not in IMAGE_FORMATS:
                    raise RequestError(415, "unsupported_image_format",
                                       f"image format {fmt or 'unknown'} is not accepted; use PNG, JPEG, WebP, BMP or GIF")
                w, h = img.size
                if w * h > limits.max_image_pixels:
                    raise RequestError(413, "image_too_large",
                                       f"image is {w}x{h} = {w * h:,} pixels, over the limit of {limits.max_image_pixels:,}")
                if min(w, h) < limits.min_image_side:
                    raise RequestError(422, "image_too_small",
                                       f"image is {w}x{h}; each side must be at least {limits.min_image_side} pixels")
                if getattr(img, "n_frames", 1) > 1:
                    img.seek(0)  # animated GIF/WebP: the first frame
                img.load()
                out = to_rgb(ImageOps.exif_transpose(img))
                return out.copy() if out is img else out
    except RequestError:
        raise
    except UnidentifiedImageError:
        raise RequestError(415, "not_an_image", "the uploaded file is not an image PIL can read") from None
    except Image.DecompressionBombError:
        raise RequestError(413, "image_too_large", "image is too large to decode safely") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RequestError(400, "corrupt_image", f"the image is corrupt or truncated ({msg})") from None


def fit_side(img, max_side: int):
    """Shrink (never enlarge) so that the longer side is at most ``max_side``; -> (image, original
    size or None when unchanged). The response reports the original size."""
    from PIL import Image

    w, h = img.size
    if max(w, h) <= max_side:
        return img, None
    f = max_side / max(w, h)
    return img.resize((max(1, round(w * f)), max(1, round(h * f))), Image.BILINEAR), [w, h]


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
