"""Handwritten math recognition (BTTR on CROHME) for the generic trainer and evaluator.

Recipe sections read here (``configs/bttr/*.yaml``), typed as
:class:`~tellkit.data.recognition.RecognitionDataConfig` and :class:`RecognitionEvalConfig` (an
unknown key is an error)::

    data:
      root: /data/crohme_inkml      # required: the recipe, `--data`, or `data.root=...`
      layout: inkml                 # inkml (official InkML) | tsv (PNG + raw LaTeX TSV) |
                                    # caption (WAP/BTTR caption.txt + bitmaps, a data.zip read
                                    # in place, or TAMER's images.pkl) | mathwriting | hme100k |
                                    # crohme2019 (tellkit.data.layouts)
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
      limit: {train: N, val: N, test: N}   # optional seeded subsets (omitted or null = all)
      extra_train: [DIR, ...]       # more InkML folders joining the training split (absolute or under root)
      vocab: grow                   # grow: new symbols of the training labels get new model rows |
                                    # fixed: training expressions with them are left out (counted)
      symbols: [...]                # the vocabulary (null: train.init_from's, else CROHME's 110);
                                    # training writes the one it used into every checkpoint
    eval: {beam_size: 10, max_len: 200, alpha: 1.0, bidirectional: true, rescore: true,
           stop_runaways: true,            # end a search whose best hypothesis ran away
           batch_size: 16}                 # images per search batch (val/test; no pixel cap)

The model is validated (and selected, and its lr reduced on plateau) on ExpRate.

:class:`RecognitionProcessor` is the task's one input path: InkML files and pen strokes go
through the renderer of the training data, bitmaps through the bitmap loader (for a model
trained on InkML renders, brought to the renders' scale); searches are run by size-sorted
batches with the whole stored search setting (:class:`RecognitionGeneration`), for evaluation,
``tellkit recognize``, the server and ``tellkit.pipeline("recognize")`` alike.
"""
from __future__ import annotations

import dataclasses
import os
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tellkit.checkpoint import read_checkpoint_config, resolve_checkpoint
from tellkit.data.crohme import CrohmeDataset, collate, load_image, render_square, size_batches
from tellkit.data.inkml import read_inkml
from tellkit.data.latex import SYMBOLS, Vocab, check_symbols, grow
from tellkit.data.layouts import load_split
from tellkit.data.recognition import (
    RecognitionDataConfig,
    augmenter,
    bitmap_kwargs,
    check,
    ink_augmenter,
    make_renderer,
    resolve_data_root,
)
from tellkit.decoding import confidence as confidences
from tellkit.decoding.runaway import RunawayStop, latex_policy
from tellkit.errors import TellkitError
from tellkit.metrics.exprate import breakdown, edit_distance, exprate
from tellkit.recipes import GenerationSettings, known_keys, section
from tellkit.registry import create_model
from tellkit.tasks import register_task
from tellkit.tasks.processor import Processor, as_pil, finite_or_none, input_path, is_array, is_pil
from tellkit.training.task import Task

# a bitmap larger than this is refused before it is decoded (decompression bombs)
MAX_INPUT_PIXELS = 40_000_000


@dataclass
class RecognitionGeneration(GenerationSettings):
    """How a BTTR model searches: the joint bidirectional beam search (``model.generate``), and
    when it stops: ``stop_runaways`` ends a search once its best live hypothesis has run away
    (one token or a few repeated over and over, LaTeX groups nested deeper than any training
    expression, a score under the floor: :func:`~tellkit.decoding.runaway.latex_policy`), as for
    a photo given to the formula reader; false: every search runs to its end or ``max_len`` (the
    reference search). One setting for evaluation, the commands, the server and the pipelines."""

    beam_size: int = 10
    max_len: int = 200
    alpha: float = 1.0  # length normalisation exponent
    bidirectional: bool = True
    rescore: bool = True
    stop_runaways: bool = True

    def __post_init__(self) -> None:
        if self.max_len is None:
            raise TellkitError("generation: max_len must be a whole number, got None")
        if not isinstance(self.stop_runaways, bool):
            raise TellkitError(f"generation: stop_runaways must be true or false, got {self.stop_runaways!r}")
        self._check_search()


@dataclass
class RecognitionEvalConfig(RecognitionGeneration):
    """A recognition recipe's ``eval:`` section: the search settings and the search batch size."""

    batch_size: int = 16  # images per search batch (val/test; no pixel cap)


class Strokes(list):
    """Pen strokes to recognise as one input: a list of strokes, each a list of (x, y) points (y down)."""


class RecognitionProcessor(Processor):
    """Handwritten-math inputs -> BTTR batches (``image`` [B, 1, H, W], ``image_mask``); the joint
    search's output -> ``{"text": LaTeX tokens joined by spaces, "tokens", "score", "confidence",
    "unsure"}`` (:mod:`tellkit.decoding.confidence`, with the checkpoint's stored calibration)."""

    task = "recognize"
    generation_class = RecognitionGeneration
    eval_class = RecognitionEvalConfig

    def __init__(self, data: RecognitionDataConfig | None = None, vocab: Vocab | None = None,
                 calibration: confidences.Calibration | None = None):
        self.data = check(data or RecognitionDataConfig())
        self.vocab = vocab or Vocab(self.data.symbols or SYMBOLS)
        self.calibration = calibration  # None: confidence null, unsure only for runaway/empty answers
        # InkML and strokes: the training data's renderer (no disk cache for one-off inputs)
        self.renderer = make_renderer(dataclasses.replace(self.data, cache=None))
        # bitmaps: as the training bitmaps were prepared, or brought to the renders' scale
        self.bitmap = {**bitmap_kwargs(self.data, trained_on_renders=self.data.strokes),
                       "require_ink": True}

    @classmethod
    def from_checkpoint(cls, meta, path, *, device=None, stroke_size: float | None = None) -> RecognitionProcessor:
        """``stroke_size``: read at this median stroke size in pixels instead of the stored
        ``data.render.stroke_size`` (models trained on InkML renders only)."""
        data = section({"data": known_keys(meta.get("data"), RecognitionDataConfig)}, "data", RecognitionDataConfig,
                       "checkpoint data")
        if stroke_size is not None:
            if not data.strokes:
                raise TellkitError(f"stroke_size: {path} was trained on bitmaps, not on InkML renders; "
                                   "it reads images at their own size")
            data = dataclasses.replace(data, render={**data.render, "stroke_size": stroke_size})
        vocab = Vocab(data.symbols or SYMBOLS)
        rows = (meta.get("config") or {}).get("vocab_size")
        if isinstance(rows, int) and rows != len(vocab):
            raise TellkitError(f"{path}: the model has {rows} output rows but its vocabulary (data.symbols) "
                               f"{len(vocab)} entries")
        return cls(data, vocab, calibration=confidences.from_meta(meta))

    @classmethod
    def stored_eval(cls, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        """The keys of the stored ``eval`` section this version knows."""
        return known_keys(meta.get("eval"), RecognitionEvalConfig)

    def batch_size(self, meta: Mapping[str, Any]) -> int:
        """Images per search batch: the stored ``eval.batch_size`` (as ``tellkit evaluate``)."""
        return int(section({"eval": self.stored_eval(meta)}, "eval", RecognitionEvalConfig, "checkpoint eval")
                   .batch_size)

    # --- input ---------------------------------------------------------------------------------
    def is_input(self, x: Any) -> bool:
        return isinstance(x, Strokes)

    def prepare(self, item: Any):
        """An ``.inkml`` file, :class:`Strokes`, a bitmap file, a PIL image or an array ->
        float [1, H, W] (ink 1, background 0)."""
        path = input_path(item)
        if path is not None and path.suffix.lower() == ".inkml":
            item = Strokes(read_inkml(path).strokes)
        if isinstance(item, Strokes):
            if self.data.strokes:  # the renderer of the model's training data
                return self.renderer.strokes_tensor(item)
            # a model trained on bitmaps: draw the strokes like those bitmaps (256 x 256 squares)
            return load_image(image=render_square([[tuple(p[:2]) for p in s] for s in item]), **self.bitmap)
        if path is not None:
            if path.is_dir():
                raise TellkitError(f"{path}: is a folder; pass image or InkML files")
            return load_image(path, max_pixels=MAX_INPUT_PIXELS, **self.bitmap)
        if is_array(item):
            item = as_pil(item, "recognize")
        if not is_pil(item):
            raise TellkitError(f"recognize: expected an image or InkML file path, a PIL image, an array or Strokes, "
                               f"got {type(item).__name__}")
        return load_image(image=item, max_pixels=MAX_INPUT_PIXELS, **self.bitmap)

    def batches(self, prepared: Sequence[Any], batch_size: int) -> list[list[int]]:
        """Images of similar size together (as evaluation batches them: less padding)."""
        return size_batches([tuple(t.shape[-2:]) for t in prepared], batch_size, 0)

    def collate(self, prepared, precision=None) -> dict[str, Any]:
        return collate([{"image": t, "labels": [], "id": str(i), "tokens": []} for i, t in enumerate(prepared)],
                       self.vocab.pad)

    # --- the model and its output ------------------------------------------------------------------
    def call_generate(self, model, batch, kwargs):
        """The joint search, given the runaway policy of this vocabulary when the generation
        config stops runaways (the search itself knows no vocabulary)."""
        stop = self.runaway_policy() if kwargs.pop("stop_runaways", False) else None
        return model.generate(batch["image"], batch["image_mask"], **kwargs, stop=stop)

    def runaway_policy(self) -> RunawayStop:
        """Repeats, cycles, LaTeX groups nested deeper than any training expression and the score
        floor (:func:`~tellkit.decoding.runaway.latex_policy`), judged on the best live hypothesis."""
        return latex_policy(self.vocab.stoi, best_only=True)

    def decode(self, outputs, batch, max_len: int | None = None, **options) -> list[dict[str, Any]]:
        """``max_len``: the search's length limit (an answer that reached it ran away)."""
        results = []
        for toks, score in zip(outputs["tokens"], outputs["scores"]):
            words = self.vocab.decode(toks)
            sc = finite_or_none(score)
            results.append({"text": " ".join(words), "tokens": words, "score": sc,
                            **confidences.assess(self.calibration, sc, words, max_len)})
        return results


@register_task("recognize")
class RecognitionTask(Task):
    monitor = "exprate"
    monitor_mode = "max"
    # early on ExpRate is 0 for several epochs: ties go to <=1, <=2 errors, then validation loss
    monitor_tiebreak = (("exprate_le1", "max"), ("exprate_le2", "max"), ("loss", "min"))
    ddp_find_unused_parameters = False

    def __init__(self, recipe):
        super().__init__(recipe)
        self.data = check(section(self.recipe, "data", RecognitionDataConfig))
        self.eval = section(self.recipe, "eval", RecognitionEvalConfig)
        self.generation = self.eval.generation
        self.batch_size = int(section(self.recipe, "train").get("batch_size", 8))
        # a checkpoint's recipe carries its calibration: evaluation says "unsure" as inference does
        self.processor = RecognitionProcessor(self.data, calibration=confidences.from_meta(self.recipe))
        self.vocab = self.processor.vocab
        self.skipped: dict[str, dict[str, int]] = {}  # split -> reason -> files skipped
        self._loaded: dict[str, list] = {}  # split -> its expressions (read once)

    # --- the model and its vocabulary -----------------------------------------------------------
    def build_model(self):
        """The recipe's model with one output row per entry of the training vocabulary: the
        :meth:`base_symbols`, grown by the training labels' new symbols (``data.vocab: grow``);
        :meth:`checkpoint_meta` stores it with every checkpoint (``data.symbols``)."""
        base, source = self.base_symbols()
        symbols, new = (grow(base, (e.tokens for e in self.expressions("train"))) if self.data.vocab == "grow"
                        else (base, []))
        self.set_vocab(Vocab(symbols))
        if new and int(os.environ.get("RANK", "0")) == 0:
            shown = " ".join(new[:20]) + (" ..." if len(new) > 20 else "")
            print(f"vocabulary: the {len(base)} symbols of {source} + {len(new)} new from the training labels "
                  f"({shown}): {len(new)} rows added to the embedding and output layers", file=sys.stderr)
        model = {**(self.recipe.get("model") or {}), "vocab_size": len(self.vocab)}
        return create_model({**self.recipe, "model": model})

    def base_symbols(self) -> tuple[list[str], str]:
        """The vocabulary training starts from, and where it comes from: ``data.symbols``, else
        the one ``train.init_from``'s checkpoint stores, else CROHME's 110 symbols."""
        if self.data.symbols is not None:
            return list(self.data.symbols), "data.symbols"
        init = (self.recipe.get("train") or {}).get("init_from")
        if init:
            meta = read_checkpoint_config(resolve_checkpoint(init))
            stored = known_keys(meta.get("data"), RecognitionDataConfig).get("symbols")
            if stored is not None:
                return check_symbols(stored, f"{init}: data.symbols"), str(init)
            return list(SYMBOLS), str(init)
        return list(SYMBOLS), "CROHME"

    def set_vocab(self, vocab: Vocab) -> None:
        self.vocab = self.processor.vocab = vocab

    def checkpoint_meta(self, meta):
        """The recipe's sections with the vocabulary the model was built with (``data.symbols``)."""
        return {**meta, "data": {**(meta.get("data") or {}), "symbols": self.vocab.symbols}}

    # --- data -------------------------------------------------------------------------------
    def build_dataset(self, split: str):
        if split not in ("train", "val", "test"):
            raise TellkitError(f"unknown split '{split}' (train|val|test)")
        d = self.data
        exprs = self.expressions(split)
        root = resolve_data_root(d.root)
        is_train = split == "train"
        render = make_renderer(d, root) if d.strokes else None
        ds = CrohmeDataset(exprs, self.vocab, bitmap=bitmap_kwargs(d),
                           max_pixels=int(d.max_pixels) if is_train else 0,
                           max_len=int(d.max_len) if is_train else 0, drop_unknown=is_train, render=render,
                           augment=augmenter(d) if is_train else None,
                           ink_augment=ink_augmenter(d) if is_train and render is not None else None)
        if ds.dropped_unknown and int(os.environ.get("RANK", "0")) == 0:
            print(f"{split}: left out {ds.dropped_unknown} expression(s) with symbols outside the vocabulary "
                  f"(data.vocab: fixed): " + ", ".join(f"{t} {n}" for t, n in ds.unknown.most_common(10)),
                  file=sys.stderr)
        return ds

    def expressions(self, split: str) -> list:
        """The expressions of ``split`` (read once; ``data.limit`` applied)."""
        if split in self._loaded:
            return self._loaded[split]
        d = self.data
        name = getattr(d, split)
        if not name:
            raise TellkitError(f"data.{split} is not set")
        root = resolve_data_root(d.root)
        skipped: dict[str, int] = {}
        exprs = load_split(root, str(name), d.layout, skipped, role=split)
        if split == "train":
            for folder in d.extra_train:
                f = Path(folder).expanduser()
                f = f if f.is_absolute() else Path(root) / f
                exprs += load_split(f.parent, f.name, "inkml", skipped)
        if skipped:
            self.skipped[split] = skipped
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"{split}: skipped {sum(skipped.values())} InkML file(s): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())), file=sys.stderr)
        limit = d.limit.get(split)
        if limit and limit < len(exprs):
            exprs = random.Random(1234).sample(exprs, limit)
        self._loaded[split] = exprs
        return exprs

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
        out = self.processor.generate(model, batch, self.generation, self.precision)
        preds = []
        for i, res in enumerate(self.processor.decode(out, batch, max_len=self.generation.max_len)):
            hyp, ref = res["tokens"], list(batch["tokens"][i])
            unknown = [t for t in ref if t not in self.vocab.stoi]
            preds.append({"id": batch["ids"][i], "prediction": res["text"], "reference": " ".join(ref),
                          "score": res["score"], "confidence": res["confidence"], "unsure": res["unsure"],
                          "distance": edit_distance(hyp, ref), "correct": hyp == ref,
                          **({"unknown": unknown} if unknown else {})})
        return preds

    def score(self, predictions):
        """ExpRate and its error margins, with the figures of the long expressions (``n_long``,
        ``exprate_long``: 30 tokens or more) and the predicted / true length ratio; the whole table by
        length and structure goes to ``eval_info["breakdown"]`` (``tellkit evaluate``'s metrics file)."""
        hyps, refs = [p["prediction"].split() for p in predictions], [p["reference"].split() for p in predictions]
        metrics = exprate(hyps, refs)
        table = breakdown(hyps, refs)
        self.eval_info = {"breakdown": table}
        whole = sum(len(r) for r in refs)
        if whole:
            metrics["length_ratio"] = sum(len(h) for h in hyps) / whole
        metrics["n_long"] = table["long"]["n"]
        if table["long"]["n"]:
            metrics["exprate_long"] = table["long"]["exprate"]
        self._count_unknown(predictions, metrics)
        return metrics

    def _count_unknown(self, predictions, metrics) -> None:
        """True labels with symbols the model cannot write (it can never read them exactly):
        ``unknown_symbols`` (occurrences) and ``unknown_expressions`` in the metrics, each symbol's
        count in ``eval_info``, and a line on stderr."""
        counts: dict[str, int] = {}
        for p in predictions:
            for t in p.get("unknown", ()):
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            return
        metrics["unknown_symbols"] = sum(counts.values())
        metrics["unknown_expressions"] = sum(1 for p in predictions if p.get("unknown"))
        self.eval_info = {**getattr(self, "eval_info", {}), "unknown_symbols": dict(sorted(counts.items()))}
        if int(os.environ.get("RANK", "0")) == 0:
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:10]
            print(f"{metrics['unknown_expressions']} true label(s) use {len(counts)} symbol(s) outside the model's "
                  "vocabulary: " + ", ".join(f"{t} {n}" for t, n in top), file=sys.stderr)
