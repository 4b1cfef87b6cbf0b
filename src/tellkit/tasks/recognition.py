"""Handwritten math recognition (BTTR on CROHME) for the generic trainer and evaluator.

Recipe sections read here (``configs/bttr/*.yaml``)::

    data:
      root: ../shared/data/crohme   # relative to the working directory or the project root
      layout: tsv                   # tsv (shared PNG + raw LaTeX TSV) | caption (WAP/BTTR caption.txt)
      train: gt_split/train         # split names, see tellkit.data.crohme.load_split
      val: gt_split/validation
      test: "2014"
      crop: true                    # crop to the ink's bounding box
      scale: 1.0                    # resize factor after cropping
      max_side: 0                   # cap on the longer side after scaling (0 = none)
      max_pixels: 320000            # training images above this are dropped (reference)
      max_len: 200                  # training labels above this are dropped (reference)
      max_batch_pixels: 1600000     # cap on padded pixels per batch (batch_size from train:)
      limit: {train: 0, val: 0, test: 0}   # optional seeded subsets (0 = all)
    eval: {beam_size: 10, max_len: 200, alpha: 1.0, bidirectional: true, rescore: true,
           batch_size: 16}                 # images per search batch (val/test; no pixel cap)

The model is validated (and selected, and its lr reduced on plateau) on ExpRate.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tellkit.config import CONFIG_ROOT
from tellkit.errors import TellkitError
from tellkit.tasks import register_task
from tellkit.tasks.base import Task

PROJECT_ROOT = CONFIG_ROOT.parent

DATA_DEFAULTS: dict[str, Any] = {
    "root": "../shared/data/crohme", "layout": "tsv", "train": "gt_split/train", "val": "gt_split/validation",
    "test": "2014", "crop": True, "scale": 1.0, "max_side": 0, "max_pixels": 320000, "max_len": 200,
    "max_batch_pixels": 1_600_000, "limit": {},
}
EVAL_DEFAULTS: dict[str, Any] = {"beam_size": 10, "max_len": 200, "alpha": 1.0, "bidirectional": True, "rescore": True,
                                 "batch_size": 16}


def resolve_data_root(root: str) -> Path:
    p = Path(root).expanduser()
    for c in ([p] if p.is_absolute() else [Path.cwd() / p, PROJECT_ROOT / p]):
        if c.is_dir():
            return c
    raise TellkitError(f"CROHME data not found at '{root}' (relative paths are tried from the working "
                       f"directory and from {PROJECT_ROOT}); set data.root")


@register_task("recognition")
class RecognitionTask(Task):
    monitor = "exprate"
    monitor_mode = "max"
    ddp_find_unused_parameters = False

    def __init__(self, recipe):
        super().__init__(recipe)
        data = dict(self.recipe.get("data") or {})
        unknown = sorted(set(data) - set(DATA_DEFAULTS))
        if unknown:
            raise TellkitError(f"data: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(DATA_DEFAULTS))}")
        self.data = {**DATA_DEFAULTS, **data}
        ev = dict(self.recipe.get("eval") or {})
        unknown = sorted(set(ev) - set(EVAL_DEFAULTS))
        if unknown:
            raise TellkitError(f"eval: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(EVAL_DEFAULTS))}")
        self.eval = {**EVAL_DEFAULTS, **ev}
        train = self.recipe.get("train") or {}
        self.batch_size = int(train.get("batch_size", 8))
        from tellkit.data.latex import Vocab

        self.vocab = Vocab()

    # --- data -------------------------------------------------------------------------------
    def build_dataset(self, split: str):
        from tellkit.data.crohme import CrohmeDataset, load_split

        if split not in ("train", "val", "test"):
            raise TellkitError(f"unknown split '{split}' (train|val|test)")
        d = self.data
        name = d[split]
        if not name:
            raise TellkitError(f"data.{split} is not set")
        exprs = load_split(resolve_data_root(d["root"]), str(name), d["layout"])
        limit = int((d.get("limit") or {}).get(split, 0) or 0)
        if limit and limit < len(exprs):
            exprs = random.Random(1234).sample(exprs, limit)
        is_train = split == "train"
        return CrohmeDataset(exprs, self.vocab, crop=d["crop"], scale=float(d["scale"]), max_side=int(d["max_side"]),
                             max_pixels=int(d["max_pixels"]) if is_train else 0,
                             max_len=int(d["max_len"]) if is_train else 0, drop_unknown=is_train)

    def collate(self, samples):
        from tellkit.data.crohme import collate

        return collate(samples, self.vocab.pad)

    def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
        from tellkit.data.crohme import size_batches

        if split == "train":
            return size_batches(dataset.sizes(), self.batch_size, int(self.data["max_batch_pixels"]),
                                shuffle=shuffle, seed=seed * 1_000_003 + epoch)
        # searching: similar sizes together, larger batches (no gradients to hold)
        return size_batches(dataset.sizes(), int(self.eval["batch_size"]), 0, shuffle=shuffle, seed=seed)

    def sample_size(self, dataset, index):
        h, w = dataset.sizes()[index]
        return h * w

    # --- evaluation -------------------------------------------------------------------------
    def predict(self, model, batch):
        e = self.eval
        out = model.generate(batch["image"], batch["image_mask"], beam_size=int(e["beam_size"]),
                             max_len=int(e["max_len"]), alpha=float(e["alpha"]),
                             bidirectional=bool(e["bidirectional"]), rescore=bool(e["rescore"]))
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


# --- recognising images with a trained checkpoint (tellkit recognize, bench) ------------------
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "bttr_default"


class Recognizer:
    """A BTTR checkpoint plus the image preparation it was trained with (read from the
    checkpoint's ``data`` section: crop, scale, max_side) and its search settings."""

    def __init__(self, model, data: dict, eval_: dict, checkpoint: Path | None = None):
        from tellkit.data.latex import Vocab

        self.model = model.eval()
        self.data = {**DATA_DEFAULTS, **(data or {})}
        ev = {**EVAL_DEFAULTS, **(eval_ or {})}
        self.beam_size, self.max_len, self.alpha = int(ev["beam_size"]), int(ev["max_len"]), float(ev["alpha"])
        self.checkpoint = checkpoint
        self.vocab = Vocab()

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, device: str = "cpu") -> "Recognizer":
        from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
        from tellkit.models.bttr import BTTR

        if checkpoint is None and not DEFAULT_CHECKPOINT.is_dir():
            raise TellkitError(f"no default BTTR checkpoint at {DEFAULT_CHECKPOINT}; pass --model CHECKPOINT")
        path = resolve_checkpoint(checkpoint or DEFAULT_CHECKPOINT, follow_links=False)
        meta = read_checkpoint_config(path)
        model = load_model(path, map_location=device, expect=BTTR).float()
        return cls(model, meta.get("data") or {}, meta.get("eval") or {}, path)

    def prepare(self, image):
        """A path or a PIL image -> float [1, H, W] as in training."""
        from tellkit.data.crohme import load_image

        d = self.data
        kw = dict(crop=bool(d["crop"]), scale=float(d["scale"]), max_side=int(d["max_side"]), require_ink=True)
        if isinstance(image, (str, Path)):
            return load_image(image, **kw)
        return load_image(image=image, **kw)

    def search(self, tensors, **kw):
        import torch

        from tellkit.data.crohme import collate

        dev = next(self.model.parameters()).device
        b = collate([{"image": t, "labels": [], "id": str(i), "tokens": []} for i, t in enumerate(tensors)])
        with torch.no_grad():
            return self.model.generate(b["image"].to(dev), b["image_mask"].to(dev), alpha=self.alpha, **kw)

    def recognize(self, images, batch_size: int = 8, beam_size: int | None = None,
                  max_len: int | None = None) -> list[dict[str, Any]]:
        """-> per image {"latex": space-separated tokens, "tokens": list, "score": float}."""
        out = []
        tensors = [self.prepare(im) for im in images]
        for i in range(0, len(tensors), batch_size):
            res = self.search(tensors[i : i + batch_size], beam_size=beam_size or self.beam_size,
                              max_len=max_len or self.max_len)
            for toks, score in zip(res["tokens"], res["scores"]):
                words = self.vocab.decode(toks)
                out.append({"latex": " ".join(words), "tokens": words, "score": score})
        return out


def export_checkpoint(checkpoint: str | Path, out: str | Path, half: bool = True, note: dict | None = None) -> Path:
    """Write a BTTR training checkpoint as a compact inference checkpoint (how the packaged
    default model is made): :func:`tellkit.training.export.export_checkpoint` (float16 weights,
    a 6.4M-parameter BTTR is 12.8 MB instead of 25.6 MB, recipe sections kept), after checking
    that the checkpoint holds a BTTR model; ``note``: provenance."""
    from tellkit.checkpoint import read_checkpoint_config
    from tellkit.errors import TellkitError
    from tellkit.training.export import export_checkpoint as export_any

    family = read_checkpoint_config(checkpoint)["family"]
    if family != "bttr":
        raise TellkitError(f"{checkpoint}: holds a '{family}' model, not BTTR")
    return export_any(checkpoint, out, half=half, note=note)
