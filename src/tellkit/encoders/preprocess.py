"""Image loading and the ImageNet pre-processing, owned by tellkit (no torchvision).

Contract used across the project::

    load_image(path, max_pixels=None, exif=True) -> PIL.Image.Image   # RGB, EXIF orientation applied
    to_rgb(img) -> PIL.Image.Image                          # any PIL mode -> RGB
    ImageNetTransform(resize=256, crop=224, fit="crop")(img) -> float[3, crop, crop]

``load_image`` decodes through :func:`tellkit.utils.images.open_image`, the one decoder for
untrusted images (``tellkit caption``, ``demo``, ``features``, the data sets' images): the format
(:data:`IMAGE_FORMATS`; never EPS) and the pixel count are checked from the header before any
pixel is decoded, so a small file that declares a huge bitmap is refused at once, and high bit
depths are converted strip by strip without float64 copies. It raises :class:`ImageLoadError`
(:class:`tellkit.utils.images.ImageError`, a :class:`~tellkit.errors.TellkitError`) with a
one-line message for a missing path, a directory, an empty file, a file that is not an image or
is in a refused format, a corrupt or truncated image, and an image with more pixels than the cap;
its ``reason`` is one of :data:`LOAD_ERRORS` (for summaries such as ``tellkit features``). The
cap is ``max_pixels``, else the environment variable ``TELLKIT_MAX_IMAGE_PIXELS``, else
:data:`DEFAULT_MAX_PIXELS`.

The transform follows the recipe that ImageNet CNNs (and the paper's ResNet-152) were trained
with: resize the short side to 256 (bilinear, antialiased; the long side is truncated to an int
as torchvision does), centre crop 224 (offsets rounded as torchvision does), scale to [0, 1],
normalise with the ImageNet mean/std.

Resize and crop happen once. An image that is already ``crop`` x ``crop`` is taken as prepared
and only normalised: NYTimes800k's ``images_processed`` were resized to 256 and centre-cropped
to 224 before release, and the reference fed them to ResNet-152 as they are (resizing them to
256 and cropping again would show the model only their central 196 pixels).
``prepared="never"`` always resizes and crops; ``resample="lanczos"`` resizes as the
reference's own image preparation did (PIL's ANTIALIAS filter).

``fit`` says how a photo of another shape becomes the ``crop`` x ``crop`` square: ``"crop"``
(resize the short side to ``resize``, centre crop: the aspect ratio is kept, the borders of the
long side are lost) or ``"squash"`` (resize straight to ``crop`` x ``crop``: the whole photo is
seen, the aspect ratio is not kept, as Flickr8k's released photos were prepared). ``resize`` is
unused by ``"squash"``. :meth:`ImageNetTransform.kept_box` gives the part of the photo the model
sees under either fit.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from tellkit.utils.images import DEFAULT_MAX_PIXELS, REASONS, SAFE_FORMATS, ImageError, open_image  # noqa: F401

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# the decoder's safe formats, and MPO: the JPEG (with extra frames) that many cameras write
IMAGE_FORMATS = (*SAFE_FORMATS, "MPO")
LOAD_ERRORS = REASONS
ImageLoadError = ImageError  # an image that cannot be used; ``reason`` in LOAD_ERRORS


def to_rgb(img: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """Any PIL mode to RGB: transparency is composited over ``background`` (white), CMYK and
    palettes are converted, 16-bit / float grayscale is rescaled to 8 bits."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(img, dtype=np.float64)
        lo, hi = float(a.min()), float(a.max())
        a = (a - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(a)
        img = Image.fromarray(a.round().astype(np.uint8), "L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        base = Image.new("RGBA", rgba.size, background + (255,))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(path: str | os.PathLike, max_pixels: int | None = None, exif: bool = True) -> Image.Image:
    """Open an image file as RGB with its EXIF orientation applied (see module docstring);
    ``exif=False``: the pixels as stored (a data set's image as the reference read it)."""
    return open_image(path, max_pixels=max_pixels, mode="RGB", formats=IMAGE_FORMATS, exif=exif)


RESAMPLE = {"bilinear": Image.BILINEAR, "lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC}
FITS = ("crop", "squash")  # how a photo becomes the square input; see the module docstring


def resize_short_side(img: Image.Image, size: int, resample: str = "bilinear") -> Image.Image:
    """Resize so that the short side is ``size`` (long side truncated to int, as torchvision)."""
    w, h = img.size
    if min(w, h) == size:
        return img
    if w <= h:
        new = (size, int(size * h / w))
    else:
        new = (int(size * w / h), size)
    return img.resize(new, RESAMPLE[resample])  # PIL's filters antialias when shrinking


def center_crop(img: Image.Image, size: int) -> Image.Image:
    """Centre crop ``size`` x ``size`` (an image smaller than that is padded with black first)."""
    w, h = img.size
    if w < size or h < size:
        canvas = Image.new("RGB", (max(w, size), max(h, size)))
        canvas.paste(img, ((max(w, size) - w) // 2, (max(h, size) - h) // 2))
        img, (w, h) = canvas, canvas.size
    left = int(round((w - size) / 2.0))
    top = int(round((h - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


def to_tensor(img: Image.Image, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """RGB PIL image -> normalised float[3, H, W]."""
    a = np.asarray(to_rgb(img), dtype=np.float32) / 255.0
    a = (a - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))


class ImageNetTransform:
    """PIL image -> float[3, crop, crop]: resize short side and centre crop (``fit="crop"``) or
    resize to the square (``fit="squash"``), then normalise; an image already ``crop`` x ``crop``
    is only normalised (``prepared="auto"``, see the module docstring)."""

    def __init__(self, resize: int = 256, crop: int = 224, mean=IMAGENET_MEAN, std=IMAGENET_STD,
                 prepared: str = "auto", resample: str = "bilinear", fit: str = "crop"):
        if prepared not in ("auto", "never"):
            raise ValueError(f"prepared must be 'auto' or 'never', got {prepared!r}")
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {sorted(RESAMPLE)}, got {resample!r}")
        if fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        self.resize, self.crop, self.mean, self.std = resize, crop, mean, std
        self.prepared, self.resample, self.fit = prepared, resample, fit

    def is_prepared(self, img: Image.Image) -> bool:
        return self.prepared == "auto" and img.size == (self.crop, self.crop)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        img = to_rgb(img)
        if not self.is_prepared(img):
            if self.fit == "squash":
                img = img.resize((self.crop, self.crop), RESAMPLE[self.resample])
            else:
                img = center_crop(resize_short_side(img, self.resize, self.resample), self.crop)
        return to_tensor(img, self.mean, self.std)

    def kept_box(self, width: int, height: int) -> list[float]:
        """The part of a ``width`` x ``height`` photo that the model sees, in its pixel
        coordinates ``[x0, y0, x1, y1]`` (the image grid covers this box)."""
        if self.fit == "squash" or (self.prepared == "auto" and (width, height) == (self.crop, self.crop)):
            return [0.0, 0.0, float(width), float(height)]
        if min(width, height) == self.resize:
            rw, rh = width, height
        elif width <= height:
            rw, rh = self.resize, int(self.resize * height / width)
        else:
            rw, rh = int(self.resize * width / height), self.resize
        left, top = int(round((rw - self.crop) / 2.0)), int(round((rh - self.crop) / 2.0))
        sx, sy = width / rw, height / rh
        return [round(left * sx, 1), round(top * sy, 1), round((left + self.crop) * sx, 1),
                round((top + self.crop) * sy, 1)]

    def batch(self, images: list[Image.Image]) -> torch.Tensor:
        return torch.stack([self(im) for im in images]) if images else torch.empty(0, 3, self.crop, self.crop)

    def __repr__(self) -> str:
        return (f"ImageNetTransform(resize={self.resize}, crop={self.crop}, fit={self.fit!r}, "
                f"prepared={self.prepared!r}, resample={self.resample!r})")
