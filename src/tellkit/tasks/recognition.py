"""Handwritten math recognition (BTTR on CROHME) for the generic trainer and evaluator.

Recipe sections read here (``configs/bttr/*.yaml``), typed as :class:`RecognitionData` and
:class:`RecognitionEval` (an unknown key is an error)::

    data:
      root: /data/crohme_inkml      # required: the recipe, `--data`, or `data.root=...`
      layout: inkml                 # inkml (official InkML) | tsv (PNG + raw LaTeX TSV) |
                                    # caption (WAP/BTTR caption.txt + bitmaps)
      train: train                  # split names, see tellkit.data.crohme.load_split
      val: "2014"
      test: "2014"
      render: {stroke_size: 32, line_width: 3}   # InkML only: tellkit.data.inkml.RenderConfig
      cache: ~/.cache/tellkit/renders            # InkML only: rendered images (null: none)
      crop: true                    # bitmaps only: crop to the ink's bounding box
      scale: 1.0                    # bitmaps only: resize factor after cropping
      max_side: 0                   # bitmaps only: cap on the longer side (0 = none)
      bitmap_fit: false             # bitmaps only: bring them to the renders' scale, pen and
                                    # margin instead (for a model trained on InkML; always so
                                    # in `tellkit recognize` for such a model)
      max_pixels: 320000            # training images above this are dropped (reference)
      max_len: 200                  # training labels above this are dropped (reference)
      max_batch_pixels: 320000      # cap on padded pixels per batch (batch_size from train:)
      limit: {train: 0, val: 0, test: 0}   # optional seeded subsets (0 = all)
    eval: {beam_size: 10, max_len: 200, alpha: 1.0, bidirectional: true, rescore: true,
           batch_size: 16}                 # images per search batch (val/test; no pixel cap)

The model is validated (and selected, and its lr reduced on plateau) on ExpRate.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError
from tellkit.tasks import register_task
from tellkit.tasks.base import Task

LAYOUTS = ("inkml", "tsv", "caption")


@dataclass
class RecognitionData:
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
    # random distortion of training items; empty = none (the reference's way): image space
    # (tellkit.data.crohme.ImageAugment: rotate, shear, scale) and, for InkML, stroke space
    # (tellkit.data.ink_augment.InkAugment: render_scale, ink_rotate, ..., substitute)
    augment: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise TellkitError(f"data.layout: {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        self.augmenter()  # a bad data.augment fails when the recipe is read
        bad = sorted(set(self.limit) - {"train", "val", "test"})
        if bad:
            raise TellkitError(f"data.limit: unknown split(s) {', '.join(bad)} (train|val|test)")

    def render_config(self):
        from tellkit.config import from_dict
        from tellkit.data.inkml import RenderConfig

        return from_dict(RenderConfig, self.render or {}, "data.render")

    def bitmap_kwargs(self, trained_on_renders: bool = False) -> dict[str, Any]:
        """How :func:`tellkit.data.crohme.load_image` prepares a bitmap for this model. Bitmaps
        for a model trained on InkML renders (``trained_on_renders``, or ``bitmap_fit``) are
        brought to the renders' scale (the median ink component as large as a rendered median
        stroke with its pen: stroke size + pen width + 1 pixel, which is what the renderer's own
        output measures), with strokes at least as wide as the renderer's pen, the renderer's
        margin, and at most its pixel cap; otherwise ``crop``, ``scale`` and ``max_side``."""
        kw: dict[str, Any] = {"crop": bool(self.crop), "max_side": int(self.max_side)}
        if not (trained_on_renders or self.bitmap_fit):
            return {**kw, "scale": float(self.scale)}
        rc = self.render_config()
        return {**kw, "fit_pixels": int(rc.max_pixels), "component_size": float(rc.stroke_size + rc.line_width + 1),
                "min_pen": float(rc.line_width), "margin": int(rc.margin)}

    def augmenter(self):
        """The training-image distortion of ``augment``, or None."""
        from tellkit.data.ink_augment import parse_augment

        image, ink = parse_augment(self.augment, "data.augment")
        if ink is not None and self.layout != "inkml":
            raise TellkitError("data.augment: the stroke-space keys need data.layout: inkml")
        return image

    def ink_augmenter(self):
        """The stroke-space distortion of ``augment`` (InkML training data), or None."""
        from tellkit.data.ink_augment import parse_augment

        return parse_augment(self.augment, "data.augment")[1]

    def cache_dir(self) -> Path | None:
        from tellkit.data.inkml import default_cache_dir

        if self.cache in (None, "", "none", False):
            return None
        return default_cache_dir() if self.cache == "default" else Path(self.cache).expanduser()


@dataclass
class RecognitionEval:
    """How a BTTR model searches (the family's generation settings)."""

    beam_size: int = 10
    max_len: int = 200
    alpha: float = 1.0
    bidirectional: bool = True
    rescore: bool = True
    batch_size: int = 16


def data_section(d: dict | None, where: str = "data") -> RecognitionData:
    from tellkit.config import from_dict

    return from_dict(RecognitionData, dict(d or {}), where)


def eval_section(d: dict | None, where: str = "eval") -> RecognitionEval:
    from tellkit.config import from_dict

    return from_dict(RecognitionEval, dict(d or {}), where)


def resolve_data_root(root: str | None) -> Path:
    if not root:
        raise TellkitError("no CROHME data given: set data.root in the recipe, pass --data DIR, or data.root=DIR")
    p = Path(root).expanduser()
    if not p.is_dir():
        raise TellkitError(f"CROHME data not found at '{root}' (data.root or --data)")
    return p


def make_renderer(data: RecognitionData, root: Path | None = None):
    from tellkit.data.inkml import InkRenderer

    return InkRenderer(data.render_config(), data.cache_dir(), root)


@register_task("recognition")
class RecognitionTask(Task):
    monitor = "exprate"
    monitor_mode = "max"
    # early on ExpRate is 0 for several epochs: ties go to <=1, <=2 errors, then validation loss
    monitor_tiebreak = (("exprate_le1", "max"), ("exprate_le2", "max"), ("loss", "min"))
    ddp_find_unused_parameters = False

    def __init__(self, recipe):
        super().__init__(recipe)
        self.data = data_section(self.recipe.get("data"))
        self.eval = eval_section(self.recipe.get("eval"))
        train = self.recipe.get("train") or {}
        self.batch_size = int(train.get("batch_size", 8))
        from tellkit.data.latex import Vocab

        self.vocab = Vocab()
        self.skipped: dict[str, dict[str, int]] = {}  # split -> reason -> files skipped

    # --- data -------------------------------------------------------------------------------
    def build_dataset(self, split: str):
        from tellkit.data.crohme import CrohmeDataset, load_split

        if split not in ("train", "val", "test"):
            raise TellkitError(f"unknown split '{split}' (train|val|test)")
        d = self.data
        name = getattr(d, split)
        if not name:
            raise TellkitError(f"data.{split} is not set")
        root = resolve_data_root(d.root)
        skipped: dict[str, int] = {}
        exprs = load_split(root, str(name), d.layout, skipped)
        if skipped:
            self.skipped[split] = skipped
            import os
            import sys

            if int(os.environ.get("RANK", "0")) == 0:
                print(f"{split}: skipped {sum(skipped.values())} InkML file(s): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())), file=sys.stderr)
        limit = int(d.limit.get(split, 0) or 0)
        if limit and limit < len(exprs):
            exprs = random.Random(1234).sample(exprs, limit)
        is_train = split == "train"
        render = make_renderer(d, root) if d.layout == "inkml" else None
        return CrohmeDataset(exprs, self.vocab, bitmap=d.bitmap_kwargs(),
                             max_pixels=int(d.max_pixels) if is_train else 0,
                             max_len=int(d.max_len) if is_train else 0, drop_unknown=is_train, render=render,
                             augment=d.augmenter() if is_train else None,
                             ink_augment=d.ink_augmenter() if is_train and render is not None else None)

    def collate(self, samples):
        from tellkit.data.crohme import collate

        return collate(samples, self.vocab.pad)

    def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
        from tellkit.data.crohme import size_batches

        if split == "train":
            return size_batches(dataset.sizes(), self.batch_size, int(self.data.max_batch_pixels),
                                shuffle=shuffle, seed=seed * 1_000_003 + epoch)
        # searching: similar sizes together, larger batches (no gradients to hold)
        return size_batches(dataset.sizes(), int(self.eval.batch_size), 0, shuffle=shuffle, seed=seed)

    def sample_size(self, dataset, index):
        h, w = dataset.sizes()[index]
        return h * w

    # --- evaluation -------------------------------------------------------------------------
    def predict(self, model, batch):
        e = self.eval
        out = model.generate(batch["image"], batch["image_mask"], beam_size=int(e.beam_size),
                             max_len=int(e.max_len), alpha=float(e.alpha),
                             bidirectional=bool(e.bidirectional), rescore=bool(e.rescore))
        from tellkit.metrics.exprate import edit_distance

        preds = []
        for i, (toks, score) in enumerate(zip(out["tokens"], out["scores"])):
            hyp = self.vocab.decode(toks)
            ref = list(batch["tokens"][i])
            preds.append({"id": batch["ids"][i], "prediction": " ".join(hyp), "reference": " ".join(ref),
                          "score": score, "distance": edit_distance(hyp, ref), "correct": hyp == ref})
        return preds

    def score(self, predictions):
        from tellkit.metrics.exprate import exprate

        return exprate([p["prediction"].split() for p in predictions], [p["reference"].split() for p in predictions])


def export_checkpoint(checkpoint: str | Path, out: str | Path, half: bool = True, note: dict | None = None) -> Path:
    """Write a BTTR training checkpoint as a compact inference checkpoint (how the packaged
    default model is made): :func:`tellkit.training.export.export_checkpoint` (float16 weights,
    a 6.4M-parameter BTTR is 12.8 MB instead of 25.6 MB, recipe sections kept), after checking
    that the checkpoint holds a BTTR model; ``note``: provenance."""
    from tellkit.checkpoint import read_checkpoint_config
    from tellkit.training.export import export_checkpoint as export_any

    family = read_checkpoint_config(checkpoint)["family"]
    if family not in ("bttr", "comer"):  # CoMER is BTTR with coverage
        raise TellkitError(f"{checkpoint}: holds a '{family}' model, not BTTR")
    return export_any(checkpoint, out, half=half, note=note)


def __getattr__(name: str):
    # inference moved to tellkit.pipelines.recognition; these names stay importable from here
    if name in ("Recognizer", "DEFAULT_CHECKPOINT"):
        from tellkit.pipelines import recognition

        return getattr(recognition, name)
    raise AttributeError(name)
