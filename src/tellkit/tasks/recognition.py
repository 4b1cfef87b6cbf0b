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

import os
import random
import sys

from tellkit.data.crohme import CrohmeDataset, collate, load_split, size_batches
from tellkit.data.latex import Vocab
from tellkit.data.recognition import augmenter, bitmap_kwargs, check, ink_augmenter, make_renderer, resolve_data_root
from tellkit.errors import TellkitError
from tellkit.metrics.exprate import edit_distance, exprate
from tellkit.recipes import RecognitionData, RecognitionEval, section
from tellkit.tasks import register_task
from tellkit.training.task import Task


@register_task("recognition")
class RecognitionTask(Task):
    monitor = "exprate"
    monitor_mode = "max"
    # early on ExpRate is 0 for several epochs: ties go to <=1, <=2 errors, then validation loss
    monitor_tiebreak = (("exprate_le1", "max"), ("exprate_le2", "max"), ("loss", "min"))
    ddp_find_unused_parameters = False

    def __init__(self, recipe):
        super().__init__(recipe)
        self.data = check(section(self.recipe, "data", RecognitionData))
        self.eval = section(self.recipe, "eval", RecognitionEval)
        self.batch_size = int(section(self.recipe, "train").get("batch_size", 8))
        self.vocab = Vocab()
        self.skipped: dict[str, dict[str, int]] = {}  # split -> reason -> files skipped

    # --- data -------------------------------------------------------------------------------
    def build_dataset(self, split: str):
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
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"{split}: skipped {sum(skipped.values())} InkML file(s): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())), file=sys.stderr)
        limit = int(d.limit.get(split, 0) or 0)
        if limit and limit < len(exprs):
            exprs = random.Random(1234).sample(exprs, limit)
        is_train = split == "train"
        render = make_renderer(d, root) if d.layout == "inkml" else None
        return CrohmeDataset(exprs, self.vocab, bitmap=bitmap_kwargs(d),
                             max_pixels=int(d.max_pixels) if is_train else 0,
                             max_len=int(d.max_len) if is_train else 0, drop_unknown=is_train, render=render,
                             augment=augmenter(d) if is_train else None,
                             ink_augment=ink_augmenter(d) if is_train and render is not None else None)

    def collate(self, samples):
        return collate(samples, self.vocab.pad)

    def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
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
        out = model.generate(batch["image"], batch["image_mask"], **self.eval.kwargs())
        preds = []
        for i, (toks, score) in enumerate(zip(out["tokens"], out["scores"])):
            hyp = self.vocab.decode(toks)
            ref = list(batch["tokens"][i])
            preds.append({"id": batch["ids"][i], "prediction": " ".join(hyp), "reference": " ".join(ref),
                          "score": score, "distance": edit_distance(hyp, ref), "correct": hyp == ref})
        return preds

    def score(self, predictions):
        return exprate([p["prediction"].split() for p in predictions], [p["reference"].split() for p in predictions])
