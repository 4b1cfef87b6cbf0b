"""Handwritten math -> LaTeX with BTTR: the inference pipeline behind ``tellkit recognize``,
``tellkit demo`` and the server's ``/api/recognize``.

:class:`Recognizer` prepares each input the way the checkpoint's training data was prepared
(its recipe's ``data`` section is stored in the checkpoint): InkML files and raw pen strokes
(the web page's math canvas) go through the same renderer as the InkML training data
(:mod:`tellkit.data.inkml`); bitmaps are read with the bitmap loader (ink found in either
polarity, cropped to the ink, scaled as in training; for a model trained on InkML renders,
scaled so that their handwriting is as large as in those renders). It then runs the batched joint search.

Also names the project's own sample expression (``assets/samples/bttr_x2_plus_1.{inkml,png}``,
hand-made pen strokes; the PNG is their rendering).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
from tellkit.data.crohme import collate, load_image, render_square
from tellkit.data.inkml import read_inkml
from tellkit.data.latex import Vocab
from tellkit.data.recognition import bitmap_kwargs, make_renderer
from tellkit.errors import TellkitError
from tellkit.models.bttr import BTTR
from tellkit.pipelines.base import checkpoint_info, finite_or_none
from tellkit.recipes import ASSETS, PACKAGED_DEFAULTS, RecognitionData, RecognitionEval, known_keys, section
from tellkit.registry import create_model

SAMPLE_PATH = ASSETS / "samples" / "bttr_x2_plus_1.png"
SAMPLE_INKML = ASSETS / "samples" / "bttr_x2_plus_1.inkml"
SAMPLE_LATEX = "x ^ { 2 } + 1"
# a bitmap larger than this is refused before it is decoded (decompression bombs)
MAX_INPUT_PIXELS = 40_000_000


class Strokes(list):
    """Pen strokes to recognise: a list of strokes, each a list of (x, y) points (y down)."""


class Recognizer:
    """A BTTR checkpoint plus the input preparation it was trained with and its search settings."""

    def __init__(self, model, data: dict | None = None, eval_: dict | None = None, checkpoint: Path | None = None):
        self.model = model.eval()
        stored = {"data": known_keys(data, RecognitionData), "eval": known_keys(eval_, RecognitionEval)}
        self.data = section(stored, "data", RecognitionData, "checkpoint data")
        ev = section(stored, "eval", RecognitionEval, "checkpoint eval")  # generation settings capped there
        self.beam_size, self.max_len, self.alpha = int(ev.beam_size), int(ev.max_len), float(ev.alpha)
        self.generation = ev.generation
        self.checkpoint = checkpoint
        self.vocab = Vocab()
        # InkML and strokes: the training renderer (no disk cache for one-off inputs)
        self.renderer = make_renderer(dataclasses.replace(self.data, cache=None))

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, device: str = "cpu",
             stroke_size: float | None = None) -> Recognizer:
        """``stroke_size``: read at this median stroke size in pixels instead of the stored
        ``data.render.stroke_size`` (models trained on InkML renders only)."""
        default = PACKAGED_DEFAULTS["math"]
        if checkpoint is None and not default.is_dir():
            raise TellkitError(f"no default BTTR checkpoint at {default}; pass --model CHECKPOINT")
        path = resolve_checkpoint(checkpoint or default, follow_links=False)
        meta = read_checkpoint_config(path)
        data = dict(meta.get("data") or {})
        if stroke_size is not None:
            if data.get("layout", RecognitionData.layout) != "inkml":
                raise TellkitError(f"--stroke-size: {path} was trained on bitmaps, not on InkML renders; "
                                   "it reads images at their own size")
            data["render"] = {**(data.get("render") or {}), "stroke_size": stroke_size}
        model = load_model(path, map_location=device, expect=BTTR).float()
        return cls(model, data, meta.get("eval") or {}, path)

    def prepare(self, item):
        """A path (bitmap or ``.inkml``), a PIL image, or :class:`Strokes` -> float [1, H, W]."""
        d = self.data
        kw = {**bitmap_kwargs(d, trained_on_renders=d.layout == "inkml"), "require_ink": True}
        if isinstance(item, (str, Path)) and Path(item).suffix.lower() == ".inkml":
            item = Strokes(read_inkml(item).strokes)
        if isinstance(item, Strokes):
            if d.layout == "inkml":  # the renderer of the model's training data
                return self.renderer.strokes_tensor(item)
            # a model trained on bitmaps: draw the strokes like those bitmaps (256 x 256 squares)

            return load_image(image=render_square([[tuple(p[:2]) for p in s] for s in item]), **kw)
        if isinstance(item, (str, Path)):
            p = Path(item)
            if p.is_dir():
                raise TellkitError(f"{p}: is a folder; pass image or InkML files")
            return load_image(p, max_pixels=MAX_INPUT_PIXELS, **kw)
        return load_image(image=item, max_pixels=MAX_INPUT_PIXELS, **kw)

    def search(self, tensors, **kw):
        import torch  # heavy

        dev = next(self.model.parameters()).device
        b = collate([{"image": t, "labels": [], "id": str(i), "tokens": []} for i, t in enumerate(tensors)])
        with torch.no_grad():
            return self.model.generate(b["image"].to(dev), b["image_mask"].to(dev), alpha=self.alpha, **kw)

    def recognize(self, items, batch_size: int = 8, beam_size: int | None = None,
                  max_len: int | None = None) -> list[dict[str, Any]]:
        """-> per input {"latex": space-separated tokens, "tokens": list, "score": float}."""
        out = []
        gen = self.generation.updated(beam_size=beam_size or self.beam_size, max_len=max_len or self.max_len)
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise TellkitError(f"batch size must be at least 1, got {batch_size}")
        tensors = [self.prepare(it) for it in items]
        for i in range(0, len(tensors), batch_size):
            res = self.search(tensors[i : i + batch_size], beam_size=gen.beam_size, max_len=gen.max_len)
            for toks, score in zip(res["tokens"], res["scores"]):
                words = self.vocab.decode(toks)
                out.append({"latex": " ".join(words), "tokens": words, "score": score})
        return out


class BTTRMathRecognizer:
    """Images or strokes -> ``[{"latex", "tokens", "score"}, ...]`` through :class:`Recognizer`.
    ``info`` says which model it serves, from which checkpoint, and whether it was trained."""

    def __init__(self, recognizer, info: dict[str, Any], beam_size: int | None = None, max_len: int | None = None):
        self.rec = recognizer
        self.beam_size, self.max_len = beam_size, max_len
        self.info = {"name": "bttr", "parameters": sum(p.numel() for p in recognizer.model.parameters()), **info}

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, device: str = "cpu", **kw) -> BTTRMathRecognizer:
        rec = Recognizer.load(checkpoint, device=device)
        meta = read_checkpoint_config(rec.checkpoint) if rec.checkpoint else {}
        return cls(rec, checkpoint_info("bttr", rec.checkpoint, meta), **kw)

    @classmethod
    def untrained(cls, seed: int = 0, device: str = "cpu") -> BTTRMathRecognizer:
        import torch  # heavy

        torch.manual_seed(seed)
        model = create_model("bttr/tiny").eval().to(device)
        rec = Recognizer(model, {}, {"beam_size": 2, "max_len": 12})
        return cls(rec, {"family": "bttr", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): LaTeX is noise"})

    def recognize(self, items: Sequence[Any]) -> list[dict[str, Any]]:
        """``items``: PIL images, paths, or :class:`Strokes`."""
        out = self.rec.recognize(list(items), batch_size=max(1, len(items)), beam_size=self.beam_size,
                                 max_len=self.max_len)
        return [{**r, "score": finite_or_none(r["score"])} for r in out]
