"""CROHME handwritten-expression data: two on-disk layouts, image loading, size-bucketed batches.

Layouts
* ``tsv`` (the rendered CROHME sets, a ``crohme/`` folder of the data root):
  ``<image root>/<key>.png`` and a TSV ``<key>\\t<raw LaTeX>`` (CSV quoting: a few labels are
  quoted and span lines). Raw LaTeX is normalised with :func:`tellkit.data.latex.normalize`.
* ``caption`` (the BTTR / WAP release): a folder with ``caption.txt`` (``<id>\\t<tokens>``,
  already tokenized) and the images ``<id>.{bmp,png,jpg}`` in the folder or in ``img/``.
* ``inkml`` (the official CROHME release): ``train/<source>/*.inkml`` and
  ``test/<YEAR>/*.inkml``; pen strokes are rendered by :mod:`tellkit.data.inkml` and the truth
  annotation is normalised like the TSV labels. Files without truth, malformed XML or without
  traces are skipped and counted (the ``skipped`` argument of :func:`load_split`).

Images become float tensors ``[1, H, W]`` with ink = 1 and background = 0 (so zero padding is
background). Optionally the ink's bounding box is cropped (the shared renders put every
expression, scaled to fit, in a 256x256 square; the bitmaps used by the papers are tight
crops) and the image rescaled. Heights and widths are padded to a multiple of 16 (the
encoder's stride) so that a batched image gives the same features as the image alone.
Batches are built as in the reference: sort by image size, fill up to ``batch_size`` images
while the padded pixels stay under ``max_batch_pixels``.
"""
from __future__ import annotations

import csv
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tellkit.data.ink_augment import InkAugmenter, build_bank, load_inks
from tellkit.data.inkml import InkExpression, RenderConfig, image_to_tensor, pad_to_stride, rendered_shape, scan_folder
from tellkit.data.latex import Vocab, normalize
from tellkit.errors import TellkitError
from tellkit.utils.images import ImageError, check_image_path, open_image

IMAGE_SUFFIXES = (".png", ".bmp", ".jpg", ".jpeg")


@dataclass
class Expression:
    id: str
    image: Path  # or an object whose load() gives a PIL image (tellkit.data.released)
    tokens: list[str]
    raw: str = ""
    # an InkML expression's strokes and segmentation as read (so nothing reads the file again)
    ink: InkExpression | None = field(default=None, repr=False, compare=False)


# --- label files -----------------------------------------------------------------------------
def read_tsv_labels(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``key<TAB>raw LaTeX`` rows (CSV-quoted fields may span lines)."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"label file not found: {p}")
    csv.field_size_limit(1 << 24)
    with open(p, encoding="utf-8", newline="") as f:
        rows = []
        for n, row in enumerate(csv.reader(f, delimiter="\t"), 1):
            if not row:
                continue
            if len(row) != 2:
                raise TellkitError(f"{p}: row {n} has {len(row)} fields, expected key<TAB>latex")
            rows.append((row[0].strip(), row[1].strip()))
    return rows


def read_caption_txt(path: str | os.PathLike) -> list[tuple[str, list[str]]]:
    """WAP/BTTR ``caption.txt``: ``id<TAB>space separated tokens`` (some releases use spaces only)."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"caption file not found: {p}")
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        parts = line.split("\t", 1) if "\t" in line else line.split(None, 1)
        out.append((parts[0].strip(), parts[1].split() if len(parts) > 1 else []))
    return out


def load_tsv_split(tsv: str | os.PathLike, image_root: str | os.PathLike) -> list[Expression]:
    root = Path(image_root)
    exprs = []
    for key, raw in read_tsv_labels(tsv):
        exprs.append(Expression(key, root / f"{key}.png", normalize(raw), raw))
    return exprs


def load_caption_dir(folder: str | os.PathLike) -> list[Expression]:
    d = Path(folder)
    caps = read_caption_txt(d / "caption.txt")
    exprs = []
    for key, toks in caps:
        img = _find_image(d, key)
        exprs.append(Expression(key, img, normalize(" ".join(toks)), " ".join(toks)))
    return exprs


def _find_image(d: Path, key: str) -> Path:
    for sub in (d, d / "img", d / "images"):
        for suf in IMAGE_SUFFIXES:
            if (sub / f"{key}{suf}").is_file():
                return sub / f"{key}{suf}"
    raise TellkitError(f"{d}: no image for '{key}' (looked for {key}.png/.bmp/.jpg here and in img/)")


class SkipFile(Exception):
    """Raised by the truth reader given to :func:`load_inkml_folders`: the file is left out and
    counted under ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def inkml_split_folder(root: Path, split: str, what: str) -> Path:
    """``root/<split>``, else ``root/test/<split>`` (a test year); ``what`` names the data in the error."""
    folder = next((c for c in (root / split, root / "test" / split) if c.is_dir()), None)
    if folder is None:
        raise TellkitError(f"{root}: no {what} split '{split}' (looked for {root / split} and {root / 'test' / split})")
    return folder


def load_inkml_folders(folders: Sequence[Path], truth_of: Callable[[InkExpression], str], *, require_truth: bool,
                       unparsable: str, nothing: str, skipped: dict[str, int] | None = None) -> list[Expression]:
    """An expression for every usable InkML file under ``folders`` (the folders in the order given,
    the files of each sorted by path). ``truth_of`` gives a file's raw LaTeX, or raises
    :class:`SkipFile`; the LaTeX is normalised (a refusal is counted as ``unparsable``) and kept as
    the file's ``truth``. ``require_truth``: a file without a truth annotation is skipped while
    reading. Skipped files are added to ``skipped`` (reason -> count); when none is usable the
    error says ``nothing`` and the counts."""
    counts: Counter = Counter()
    exprs = []
    for folder in folders:
        res = scan_folder(folder, require_truth=require_truth)
        counts.update(res.skipped)
        for e in res.expressions:
            try:
                truth = truth_of(e)
            except SkipFile as skip:
                counts[skip.reason] += 1
                continue
            try:
                toks = normalize(truth)
            except TellkitError:
                counts[unparsable] += 1
                continue
            e.truth = truth
            exprs.append(Expression(e.id, e.path, toks, truth, e))
    if skipped is not None:
        for k, v in counts.items():
            skipped[k] = skipped.get(k, 0) + v
    if not exprs:
        raise TellkitError(nothing + (f" (skipped: {dict(counts)})" if counts else ""))
    return exprs


def load_inkml_split(root: str | os.PathLike, split: str, skipped: dict[str, int] | None = None) -> list[Expression]:
    """``train`` (every ``train/**.inkml``), a year under ``test/`` (``2014``), or any folder
    under ``root`` holding InkML files. Unusable files are skipped; ``skipped`` (if given)
    receives reason -> count."""
    folder = inkml_split_folder(Path(root), split, "InkML")
    exprs = load_inkml_folders([folder], lambda e: e.truth or "", require_truth=True, unparsable="unparsable truth",
                               nothing=f"{folder}: no usable InkML files", skipped=skipped)
    # one id per expression: files of one name in two sub-folders (two test years) are told apart
    # by their path under the split's folder
    seen = Counter(x.id for x in exprs)
    for x in exprs:
        if seen[x.id] > 1:
            x.id = Path(x.image).relative_to(folder).with_suffix("").as_posix()
    return exprs


def load_split(root: str | os.PathLike, split: str, layout: str = "tsv",
               skipped: dict[str, int] | None = None) -> list[Expression]:
    """A named split of the shared layout (``train``, ``2014``, ``gt_split/train``,
    ``gt_split/validation``, or any ``<file>.tsv`` under ``root``), a caption folder, or an
    InkML split (``layout="inkml"``)."""
    r = Path(root)
    if layout == "inkml":
        return load_inkml_split(r, split, skipped)
    if layout == "caption":
        return load_caption_dir(r / split if (r / split).is_dir() else r)
    if layout != "tsv":
        raise TellkitError(f"unknown CROHME layout '{layout}' (tsv|caption|inkml)")
    if split == "train":
        return load_tsv_split(r / "groundtruth_train.tsv", r / "train")
    if split.startswith("gt_split/"):
        return load_tsv_split(r / f"{split}.tsv", r / "train")
    if (r / f"groundtruth_{split}.tsv").is_file():
        return load_tsv_split(r / f"groundtruth_{split}.tsv", r / "test" / split)
    raise TellkitError(f"{r}: unknown CROHME split '{split}'")


# --- images -----------------------------------------------------------------------------------
def ink_component_sizes(ink: np.ndarray, threshold: float = 0.5, min_pixels: int = 4) -> np.ndarray:
    """The longer bounding-box side (pixels) of each 8-connected ink component of ``ink``
    ([H, W], ink high), ignoring specks of fewer than ``min_pixels`` pixels. Components are
    found from the runs of ink on each row: a run joins every run of the row above that it
    touches (diagonals included), and the runs so joined are merged by label propagation with
    pointer jumping, all in whole-array operations."""
    b = np.asarray(ink) > threshold
    h, w = b.shape
    if not b.any():
        return np.zeros(0, dtype=np.int64)
    edge = np.zeros((h, w + 2), dtype=np.int8)
    edge[:, 1:-1] = b
    d = np.diff(edge, axis=1)
    ys, starts = np.nonzero(d == 1)  # row-major: rows ascending, runs left to right
    _, ends = np.nonzero(d == -1)  # one past the run's last pixel
    n = len(starts)
    # runs of the row above that touch run r: their end >= r's start and their start <= r's end
    # (8-connectivity); in row-major order they form the range [lo, hi) of run indices
    span = w + 2
    key_end = ys * span + ends
    key_start = ys * span + starts
    lo = np.searchsorted(key_end, (ys - 1) * span + starts, side="left")
    hi = np.searchsorted(key_start, (ys - 1) * span + ends, side="right")
    lo = np.maximum(lo, np.searchsorted(ys, ys - 1, side="left"))
    hi = np.minimum(hi, np.searchsorted(ys, ys - 1, side="right"))
    count = np.maximum(hi - lo, 0)
    a = np.repeat(np.arange(n), count)
    first = np.repeat(lo - np.cumsum(count) + count, count)
    bnb = first + np.arange(len(a))  # the touching runs above
    labels = np.arange(n)
    while True:
        m = np.minimum(labels[a], labels[bnb])
        new = labels.copy()
        np.minimum.at(new, a, m)
        np.minimum.at(new, bnb, m)
        new = new[new]  # pointer jumping
        if np.array_equal(new, labels):
            break
        labels = new
    _, comp = np.unique(labels, return_inverse=True)
    k = comp.max() + 1
    y0 = np.full(k, h, dtype=np.int64)
    y1 = np.zeros(k, dtype=np.int64)
    x0 = np.full(k, w, dtype=np.int64)
    x1 = np.zeros(k, dtype=np.int64)
    np.minimum.at(y0, comp, ys)
    np.maximum.at(y1, comp, ys)
    np.minimum.at(x0, comp, starts)
    np.maximum.at(x1, comp, ends - 1)
    pixels = np.bincount(comp, weights=ends - starts, minlength=k)
    size = np.maximum(y1 - y0, x1 - x0) + 1
    return size[pixels >= min_pixels].astype(np.int64)


def pen_width(ink: np.ndarray, threshold: float = 0.5) -> float:
    """Estimated pen width in pixels: 2 x ink area / ink perimeter (a stroke of width w and
    length L has area wL and perimeter about 2L); 0 when there is no ink."""
    b = np.asarray(ink) > threshold
    area = int(b.sum())
    if area == 0:
        return 0.0
    p = np.pad(b, 1)
    edges = int((p[1:] != p[:-1]).sum() + (p[:, 1:] != p[:, :-1]).sum())
    return 2.0 * area / edges


def _dilate(a: np.ndarray, k: int) -> np.ndarray:
    """Grey-level dilation by a (k+1) x (k+1) square: strokes become k pixels wider. A running
    maximum per axis, so a large scan needs two extra copies of the image, not k + 1."""
    lo, hi = k // 2, k - k // 2
    for axis in (0, 1):
        p = np.pad(a, [(lo, hi) if i == axis else (0, 0) for i in (0, 1)])
        n = a.shape[axis]
        out = p[:n] if axis == 0 else p[:, :n]
        out = out.copy()
        for i in range(1, k + 1):
            np.maximum(out, p[i : i + n] if axis == 0 else p[:, i : i + n], out=out)
        a = out
    return a


def load_image(path: str | os.PathLike | None = None, *, image=None, crop: bool = True,
               scale: float = 1.0, max_side: int = 0, require_ink: bool = False, max_pixels: int = 0,
               fit_pixels: int = 0, component_size: float = 0.0, min_pen: float = 0.0,
               margin: int = 0) -> torch.Tensor:
    """Read an image (dark ink on a light background, or the reverse) -> float [1, H, W] with
    ink 1 and background 0, padded to a multiple of 16. ``image``: a PIL image instead of a path.
    ``max_pixels``: refuse larger files from their header, before decoding (decompression
    bombs; files go through :func:`tellkit.utils.images.open_image`, whose own default cap applies
    when this is 0); ``component_size``: instead of ``scale``, scale so that the median ink
    component (:func:`ink_component_sizes`) is this many pixels, i.e. bring handwriting of any
    resolution to the size of a model's training renders; ``fit_pixels``: after cropping and
    scaling, shrink to at most this many pixels; ``min_pen``: strokes thinner than this many
    pixels after scaling (a fine pen, or a large scan shrunk) are first thickened to it;
    ``margin``: background pixels added on every side at the end (as renders have)."""
    from PIL import Image  # heavy

    if image is None:

        p = Path(path)
        check_image_path(p)  # missing, a folder, a device or FIFO: one line saying which
        try:
            image = open_image(p, max_pixels=max_pixels or None, mode="L")
        except ImageError as exc:
            if exc.reason == "too many pixels":
                raise
            raise TellkitError(f"{p}: not a readable image ({exc})") from None
    else:
        if max_pixels and image.size[0] * image.size[1] > max_pixels:
            raise TellkitError(f"image of {image.size[0]}x{image.size[1]} pixels is more than the "
                               f"{max_pixels:,} accepted")
        image = image.convert("L")
    a = 1.0 - np.asarray(image, dtype=np.float32) / 255.0
    if a.size == 0:
        raise TellkitError(f"{path or 'image'}: empty image")
    if a.mean() > 0.5:  # light ink on a dark background: ink is the minority, so flip
        a = 1.0 - a
    if require_ink and not (a > 0.1).any():
        raise TellkitError(f"{path or 'image'}: no ink found (a blank image)")
    if crop:
        ys, xs = np.nonzero(a > 0.1)
        if len(ys):
            m = 2
            a = a[max(ys.min() - m, 0): ys.max() + m + 1, max(xs.min() - m, 0): xs.max() + m + 1]
    h, w = a.shape
    f = scale
    if component_size > 0:
        sizes = ink_component_sizes(a)
        if len(sizes):
            f = component_size / float(np.median(sizes))
    if max_side and max(h, w) * f > max_side:
        f = max_side / max(h, w)
    if fit_pixels and h * w * f * f > fit_pixels:
        f = (fit_pixels / (h * w)) ** 0.5
    if min_pen > 0:  # widen thin strokes at the source resolution, before resizing smooths them
        k = round(min_pen / f - pen_width(a))
        if k >= 1:
            a = _dilate(a, k)
    if f != 1.0:
        nh, nw = max(1, round(h * f)), max(1, round(w * f))
        a = np.asarray(Image.fromarray((a * 255).astype(np.uint8)).resize((nw, nh), Image.BILINEAR),
                       dtype=np.float32) / 255.0
    if margin > 0:
        a = np.pad(a, margin)
    t = torch.from_numpy(np.ascontiguousarray(a))[None]
    return pad_to_stride(t)


def render_square(strokes: Sequence[Sequence[tuple[float, float]]], size: int = 256, margin: int = 5,
                  width: int = 2):
    """Draw pen strokes (lists of (x, y) points, y down) like the shared CROHME renders: black
    ink on a white ``size`` x ``size`` square, the expression scaled to fit and centred."""
    from PIL import Image, ImageDraw  # heavy

    pts = [p for s in strokes for p in s]
    if not pts:
        raise TellkitError("no strokes to draw")
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    f = (size - 2 * margin - 1) / max(x1 - x0, y1 - y0, 1e-6)
    ox = margin + ((size - 2 * margin - 1) - (x1 - x0) * f) / 2
    oy = margin + ((size - 2 * margin - 1) - (y1 - y0) * f) / 2
    im = Image.new("L", (size, size), 255)
    d = ImageDraw.Draw(im)
    for s in strokes:
        xy = [(ox + (x - x0) * f, oy + (y - y0) * f) for x, y in s]
        if len(xy) == 1:
            xy = xy * 2
        d.line(xy, fill=0, width=width, joint="curve")
    return im


# --- dataset and batches ------------------------------------------------------------------------
@dataclass
class ImageAugment:
    """Random affine distortion of a training image, keeping its size (so size-sorted batches
    and their pixel caps hold): a rotation of up to ``rotate`` degrees either way, a horizontal
    shear (slant) of up to ``shear`` either way and a scale drawn from ``scale``, all about the
    image centre, ink resampled bilinearly and white (0) outside. Not in the BTTR reference (it
    trains without augmentation); off unless a recipe sets ``data.augment``. Draws from torch's
    global generator, which the training loop seeds and checkpoints."""

    rotate: float = 0.0
    shear: float = 0.0
    scale: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self):
        lo, hi = (float(v) for v in self.scale)
        if not (0 < lo <= hi <= 2):
            raise TellkitError(f"data.augment.scale: expected [low, high] with 0 < low <= high <= 2, got {self.scale}")
        if not (0 <= self.rotate <= 45 and 0 <= self.shear <= 1):
            raise TellkitError(f"data.augment: rotate must be in [0, 45] degrees and shear in [0, 1], "
                               f"got {self.rotate}, {self.shear}")
        self.scale = (lo, hi)

    @property
    def active(self) -> bool:
        return bool(self.rotate or self.shear or self.scale != (1.0, 1.0))

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return img
        u = torch.rand(3).tolist()
        angle = math.radians((2 * u[0] - 1) * self.rotate)
        shear = (2 * u[1] - 1) * self.shear
        lo, hi = self.scale
        zoom = lo + (hi - lo) * u[2]
        h, w = img.shape[-2:]
        # output pixel (x, y) about the centre, in pixels, reads input pixel A^-1 (x, y)
        cos, sin = math.cos(angle), math.sin(angle)
        fwd = torch.tensor([[cos, -sin], [sin, cos]], dtype=torch.float64) @ torch.tensor(
            [[1.0, shear], [0.0, 1.0]], dtype=torch.float64) * zoom
        inv = torch.linalg.inv(fwd)
        # affine_grid works in [-1, 1] coordinates on each axis: rescale by the half-sizes
        half = torch.tensor([(w - 1) / 2, (h - 1) / 2], dtype=torch.float64)
        theta = (inv * half[None, :] / half[:, None]).float()
        grid = F.affine_grid(torch.cat([theta, torch.zeros(2, 1)], 1)[None], [1, 1, h, w], align_corners=True)
        out = F.grid_sample(img[None].float(), grid, mode="bilinear", padding_mode="zeros", align_corners=True)
        return out[0].to(img.dtype)


class CrohmeDataset(torch.utils.data.Dataset):
    """Items: ``{"id", "image": [1,H,W], "labels": list[int] (no sos/eos), "tokens"}``."""

    def __init__(self, exprs: Sequence[Expression], vocab: Vocab | None = None, *, max_pixels: int = 0,
                 max_len: int = 0, drop_unknown: bool = False,
                 render: Callable[[Expression], torch.Tensor] | None = None, bitmap: dict | None = None,
                 augment: Callable[[torch.Tensor], torch.Tensor] | None = None, ink_augment=None):
        """``render``: strokes -> image for InkML expressions; ``bitmap``: keyword arguments of
        :func:`load_image` for bitmap expressions (crop, scale, ...; its defaults when None);
        ``augment``: a size-keeping random distortion of each item (:class:`ImageAugment`);
        ``ink_augment``: a :class:`tellkit.data.ink_augment.InkAugment` for InkML expressions
        (``render`` an :class:`tellkit.data.inkml.InkRenderer`): every item is then distorted
        in stroke space and rendered afresh (never cached) with the renderer's settings. The
        files are read once here (strokes and symbol segmentation, the bank that symbol
        substitution draws from); :meth:`sizes` stays the undistorted, cached renders."""
        self.vocab = vocab or Vocab()
        kept = []
        # symbols outside the vocabulary -> how often they occur (``drop_unknown``: in the
        # expressions left out for them, whose number is ``dropped_unknown``)
        self.unknown: Counter[str] = Counter()
        self.dropped_unknown = 0
        for e in exprs:
            if max_len and len(e.tokens) > max_len:
                continue
            unknown = [t for t in e.tokens if t not in self.vocab.stoi]
            self.unknown.update(unknown)
            if drop_unknown and unknown:
                self.dropped_unknown += 1
                continue
            kept.append(e)
        self.exprs = kept
        self.bitmap = dict(bitmap or {})
        self.render = render
        self.augment = augment
        self._sizes: list[tuple[int, int]] | None = None
        self.max_pixels = max_pixels
        if max_pixels:  # the reference drops images over 320,000 pixels
            sizes = self.sizes()
            keep = [i for i, (h, w) in enumerate(sizes) if h * w <= max_pixels]
            self.exprs = [self.exprs[i] for i in keep]
            self._sizes = [sizes[i] for i in keep]
        self.ink_augment = None
        if ink_augment is not None:
            if not isinstance(getattr(render, "config", None), RenderConfig):
                raise TellkitError("data.augment: the stroke-space keys need InkML data (data.layout: inkml)")
            self.inks = [e.ink for e in self.exprs] if all(e.ink for e in self.exprs) else \
                load_inks(e.image for e in self.exprs)
            self.ink_augment = InkAugmenter(ink_augment, build_bank(self.inks) if ink_augment.substitute else None,
                                            vocab=self.vocab.stoi if drop_unknown else None)

    def __len__(self) -> int:
        return len(self.exprs)

    def image(self, i: int) -> torch.Tensor:
        if self.render is not None:
            return self.render(self.exprs[i])
        source = self.exprs[i].image
        if not isinstance(source, Path):  # an image inside an archive or a pickle (tellkit.data.released)
            return load_image(image=source.load(), **self.bitmap)
        return load_image(source, **self.bitmap)

    def __getitem__(self, i: int) -> dict:
        e = self.exprs[i]
        img, tokens = (self.image(i), e.tokens) if self.ink_augment is None else self.augmented(i)
        ids = [self.vocab.stoi.get(t, -1) for t in tokens]
        if self.augment is not None:
            img = self.augment(img)
        return {"id": e.id, "image": img, "labels": ids, "tokens": tokens}

    def augmented(self, i: int, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, list[str]]:
        """Item ``i`` distorted in stroke space and rendered afresh, and its label (a
        sub-expression's when one was drawn). ``rng``: by default one per call, seeded from
        torch's generator (so the training loop's seed reproduces an epoch, and every epoch and
        data-loading worker draws differently) and the index."""
        if rng is None:
            rng = np.random.default_rng([int(torch.randint(0, 2**62, (1,))), i])
        ink = self.ink_augment(self.inks[i], rng, source=i)
        tokens = self.exprs[i].tokens if ink.tokens is None else ink.tokens
        return image_to_tensor(ink.render(self.render.config)), tokens

    def sizes(self) -> list[tuple[int, int]]:
        """(H, W) of every prepared image (computed once): for InkML expressions read with their
        strokes, from the renderer's layout (nothing drawn); otherwise by preparing each image."""
        if self._sizes is None:
            config = getattr(self.render, "config", None)
            if isinstance(config, RenderConfig) and all(e.ink is not None for e in self.exprs):
                self._sizes = [rendered_shape(e.ink.strokes, config) for e in self.exprs]
            else:
                self._sizes = [tuple(self.image(i).shape[-2:]) for i in range(len(self.exprs))]
        return self._sizes


def collate(samples: list[dict], pad_id: int = 0) -> dict:
    """Pad images (background 0) and labels. ``image_mask`` True = real pixel.
    Unknown label tokens (-1, test truth outside the vocabulary) are kept only in ``tokens``."""
    b = len(samples)
    hs = [s["image"].shape[-2] for s in samples]
    ws = [s["image"].shape[-1] for s in samples]
    H, W = max(hs), max(ws)
    img = torch.zeros(b, 1, H, W)
    mask = torch.zeros(b, H, W, dtype=torch.bool)
    for i, s in enumerate(samples):
        img[i, :, : hs[i], : ws[i]] = s["image"]
        mask[i, : hs[i], : ws[i]] = True
    labels = [[t for t in s["labels"] if t >= 0] for s in samples]
    T = max([len(seq) for seq in labels] + [1])
    lab = torch.full((b, T), pad_id, dtype=torch.long)
    for i, seq in enumerate(labels):
        lab[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return {
        "image": img, "image_mask": mask, "labels": lab,
        "label_lengths": torch.tensor([len(seq) for seq in labels], dtype=torch.long),
        "ids": [s["id"] for s in samples], "tokens": [s["tokens"] for s in samples],
    }


def size_batches(sizes: Sequence[tuple[int, int]], batch_size: int, max_batch_pixels: int,
                 shuffle: bool = False, seed: int = 0, sort: str = "shape") -> list[list[int]]:
    """Sort images and fill batches while ``n * maxH * maxW <= max_batch_pixels``.

    ``sort="area"`` orders by pixel count, as the reference does; images of equal area but
    different shapes (tall and narrow, flat and wide) then share a batch and are padded to the
    larger of both sides. ``sort="shape"`` (the default) orders by height, then width, so a batch
    holds images of one height and similar widths: far less padding for the same batches."""
    if sort == "area":
        key = lambda i: (sizes[i][0] * sizes[i][1], sizes[i])  # noqa: E731
    elif sort == "shape":
        key = lambda i: (sizes[i][0], sizes[i][1])  # noqa: E731
    else:
        raise TellkitError(f"unknown batch sort {sort!r} (shape|area)")
    order = sorted(range(len(sizes)), key=key)
    batches: list[list[int]] = []
    cur: list[int] = []
    mh = mw = 0
    for i in order:
        h, w = sizes[i]
        nh, nw = max(mh, h), max(mw, w)
        if cur and (len(cur) >= batch_size or (max_batch_pixels and (len(cur) + 1) * nh * nw > max_batch_pixels)):
            batches.append(cur)
            cur, nh, nw = [], h, w
        cur.append(i)
        mh, mw = nh, nw
    if cur:
        batches.append(cur)
    if shuffle:
        random.Random(seed).shuffle(batches)
    return batches
