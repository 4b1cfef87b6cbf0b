"""A recognition recipe's ``data:`` section (:class:`RecognitionDataConfig`) and what it means
for the data layer: the data folder, the InkML renderer and its cache, how a bitmap is prepared
for a model, and the training-image augmentation. The training task and the recognition
processor (:class:`tellkit.tasks.recognition.RecognitionProcessor`) both read the section
through these functions."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tellkit.config import from_dict
from tellkit.data.crohme import ImageAugment
from tellkit.data.ink_augment import InkAugment
from tellkit.data.inkml import InkRenderer, RenderConfig, default_cache_dir
from tellkit.data.latex import check_symbols
from tellkit.data.layouts import INK_LAYOUTS, LAYOUTS
from tellkit.errors import TellkitError
from tellkit.recipes import check_limits


@dataclass
class RecognitionDataConfig:
    """A recognition recipe's ``data:`` section (the fields are described in
    :mod:`tellkit.tasks.recognition`); ``render`` and ``augment`` are read by the functions
    below (the InkML renderer's and the augmentation's settings)."""

    root: str | None = None
    layout: str = "inkml"
    train: str = "train"
    val: str = "2014"
    test: str = "2014"
    render: dict[str, Any] = field(default_factory=dict)
    cache: str | None = "default"
    crop: bool = True
    scale: float = 1.0
    max_side: int = 0
    bitmap_fit: bool = False
    max_pixels: int = 320_000
    max_len: int = 200
    max_batch_pixels: int = 320_000
    limit: dict[str, int] = field(default_factory=dict)
    # more InkML folders (absolute, or under root) whose expressions join the training split, e.g.
    # other writers' expressions; the BTTR papers train on the official training set alone
    extra_train: list[str] = field(default_factory=list)
    # random distortion of training items; empty = none (the reference's way): image space
    # (tellkit.data.crohme.ImageAugment: rotate, shear, scale) and, for InkML, stroke space
    # (tellkit.data.ink_augment.InkAugment: render_scale, ink_rotate, ..., substitute)
    augment: dict[str, Any] = field(default_factory=dict)
    # the symbols the model reads and writes, after <pad> <sos> <eos> (null: CROHME's 110, or
    # those train.init_from's checkpoint stores); training stores the vocabulary it used here
    symbols: list[str] | None = None
    # grow: symbols of the training labels missing from `symbols` are added (new rows in the
    # model's embedding and output layers); fixed: training expressions using one are left out
    # (counted and reported)
    vocab: str = "grow"

    def __post_init__(self):
        if self.vocab not in ("grow", "fixed"):
            raise TellkitError(f"data.vocab: {self.vocab!r} is not one of grow, fixed")
        if self.symbols is not None:
            self.symbols = check_symbols(self.symbols)
        if self.layout not in LAYOUTS:
            raise TellkitError(f"data.layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        for name in ("render", "augment"):
            if not isinstance(getattr(self, name) or {}, Mapping):
                raise TellkitError(f"data.{name} must be a mapping, got {getattr(self, name)!r}")
        self.limit = check_limits(self.limit)
        if isinstance(self.extra_train, str) or not all(isinstance(x, str) and x for x in self.extra_train or []):
            raise TellkitError(f"data.extra_train must be a list of folders, got {self.extra_train!r}")
        if self.extra_train and self.layout not in INK_LAYOUTS:
            raise TellkitError("data.extra_train: extra training folders are read as InkML (data.layout: inkml)")

    @property
    def strokes(self) -> bool:
        """Whether the layout is read as pen strokes and rendered (InkML, MathWriting, CROHME 2019)."""
        return self.layout in INK_LAYOUTS


def parse_augment(mapping: Mapping[str, Any] | None, where: str = "data.augment"):
    """``data.augment`` -> ``(ImageAugment or None, InkAugment or None)``: the image-space keys
    (``rotate``, ``shear``, ``scale``) and the stroke-space keys, each None when all its
    switches are off. Unknown keys and bad values raise a one-line :class:`TellkitError`."""
    d = dict(mapping or {})
    image_keys = {f.name for f in dataclasses.fields(ImageAugment)}
    ink_keys = {f.name for f in dataclasses.fields(InkAugment)}
    unknown = sorted(set(d) - image_keys - ink_keys)
    if unknown:
        known = ", ".join(sorted(image_keys | ink_keys))
        raise TellkitError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known}")
    image = from_dict(ImageAugment, {k: v for k, v in d.items() if k in image_keys}, where)
    ink = from_dict(InkAugment, {k: v for k, v in d.items() if k in ink_keys}, where)
    return (image if image.active else None), (ink if ink.active else None)


def resolve_data_root(root: str | None) -> Path:
    """The data folder, or a ``.zip`` archive (BTTR/CoMER's ``data.zip``, read in place)."""
    if not root:
        raise TellkitError("no CROHME data given: set data.root in the recipe, pass --data DIR, or data.root=DIR")
    p = Path(root).expanduser()
    if p.is_file() and p.suffix.lower() == ".zip":
        return p
    if not p.is_dir():
        raise TellkitError(f"CROHME data not found at '{root}' (data.root or --data)")
    return p


def render_config(data: RecognitionDataConfig) -> RenderConfig:
    return from_dict(RenderConfig, data.render or {}, "data.render")


def cache_dir(data: RecognitionDataConfig) -> Path | None:
    if data.cache in (None, "", "none", False):
        return None
    return default_cache_dir() if data.cache == "default" else Path(data.cache).expanduser()


def make_renderer(data: RecognitionDataConfig, root: Path | None = None) -> InkRenderer:
    return InkRenderer(render_config(data), cache_dir(data), root)


def bitmap_kwargs(data: RecognitionDataConfig, trained_on_renders: bool = False) -> dict[str, Any]:
    """How :func:`tellkit.data.crohme.load_image` prepares a bitmap for this model. Bitmaps
    for a model trained on InkML renders (``trained_on_renders``, or ``bitmap_fit``) are
    brought to the renders' scale (the median ink component as large as a rendered median
    stroke with its pen: stroke size + pen width + 1 pixel, which is what the renderer's own
    output measures), with strokes at least as wide as the renderer's pen, the renderer's
    margin, and at most its pixel cap; otherwise ``crop``, ``scale`` and ``max_side``."""
    kw: dict[str, Any] = {"crop": bool(data.crop), "max_side": int(data.max_side)}
    if not (trained_on_renders or data.bitmap_fit):
        return {**kw, "scale": float(data.scale)}
    rc = render_config(data)
    return {**kw, "fit_pixels": int(rc.max_pixels), "component_size": float(rc.stroke_size + rc.line_width + 1),
            "min_pen": float(rc.line_width), "margin": int(rc.margin)}


def augmenter(data: RecognitionDataConfig) -> ImageAugment | None:
    """The training-image distortion of ``data.augment``, or None."""
    image, ink = parse_augment(data.augment, "data.augment")
    if ink is not None and not data.strokes:
        raise TellkitError("data.augment: the stroke-space keys need data.layout: inkml")
    return image


def ink_augmenter(data: RecognitionDataConfig) -> InkAugment | None:
    """The stroke-space distortion of ``data.augment`` (InkML training data), or None."""
    return parse_augment(data.augment, "data.augment")[1]


def check(data: RecognitionDataConfig) -> RecognitionDataConfig:
    """Fail early on settings only the data layer can check (``render``, ``augment``)."""
    render_config(data)
    augmenter(data)
    return data
