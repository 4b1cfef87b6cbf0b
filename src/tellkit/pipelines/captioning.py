"""Image (+ article) -> caption with per-token attention: the captioning pipeline that
``tellkit caption``, ``tellkit demo`` and the server (``/api/caption``) run.

    cap = CaptioningPipeline.load("runs/tat")                    # or .untrained() for a tiny random model
    [res] = cap.caption([(pil_image, "article text")])
    res["caption"], res["tokens"][i]["attention"]["image"], res["faces"], res["article_tokens"]

Any captioning checkpoint works (Transform and Tell, Show and Tell, Show-Attend-and-Tell, the LSTM
captioner). The checkpoint's recipe sections name its encoders (``encoders:``), its article
context (``data.context``, ``data.max_article_tokens``) and its generation settings (``eval:``,
a :class:`~tellkit.recipes.CaptionGeneration`); inputs go through the same
:class:`~tellkit.encoders.bundle.EncoderBundle` as in training. A result holds ``caption``,
``tokens`` (each generated piece with its attention over ``image`` grid cells, ``article`` tokens,
``faces`` and ``objects``), ``score``, ``image_size``, ``grid`` (rows, cols and the box of the
original image the grid covers), ``faces`` (detected boxes), ``article_text`` (the context the
model read), ``article_tokens`` (text and character span of every article token) and, for models
that read objects, ``objects`` (how many, and where they came from: no object detector ships, so
for a new image the set is empty and the result says so). ``info`` says which model it runs,
from which checkpoint, and whether it was trained. Faces of a photo longer than
:data:`FACE_DETECT_MAX_SIDE` (1600 px) are searched on a shrunk copy, so the detector's memory
stays bounded; the boxes are given in the photo's own pixels and the crops are cut from it (models
without faces, such as the packaged default, are not affected).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
from tellkit.data.batch import collate_captions
from tellkit.data.sample import CaptionSample
from tellkit.encoders.bundle import CaptionInput, EncoderBundle
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.errors import TellkitError
from tellkit.pipelines.base import checkpoint_info, finite_or_none
from tellkit.recipes import DEFAULT_ARTICLE_ENCODER, CaptionEvalConfig, CaptionGeneration, section
from tellkit.registry import create_model

# the captioning families a checkpoint may hold (same batches and ``generate`` API)
CAPTION_FAMILIES = ("transform_and_tell", "show_tell", "show_attend_tell", "lstm_captioner")
NO_OBJECT_DETECTOR = "no object detector ships offline: the objects context of a new image is empty"
# faces of a larger photo are detected on a copy this long (the server's upload side limit);
# the image encoder and the face crops still read the image as given
FACE_DETECT_MAX_SIDE = 1600

# encoders built once per process and shared by every pipeline that names the same ones
_SHARED: dict = {}


def article_input(text: str, image=None) -> CaptionInput:
    """A pasted article as the bundle's input: paragraphs are the blocks between blank lines (or
    the lines, when there are none); no title, no image position, so the model reads the
    article from its start up to the encoder's token budget."""
    text = (text or "").strip()
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    if len(blocks) <= 1:
        blocks = [b for b in text.splitlines() if b.strip()]
    return CaptionInput("request", paragraphs=blocks, image=image)


def article_sample(text: str):
    """:func:`article_input` as a :class:`~tellkit.data.sample.CaptionSample` (id ``request``)."""
    return CaptionSample(id="request", caption="", paragraphs=article_input(text).paragraphs)


def _bundle(recipe, model_config, device) -> EncoderBundle:
    """The bundle of a checkpoint: its encoders, and its ``data`` section's article context (none
    for a model that reads no article)."""
    contexts = tuple(model_config.contexts)
    object_dim = getattr(model_config, "object_dim", None)
    return EncoderBundle.for_recipe(recipe, contexts, context_mode=None if "article" in contexts else "none",
                                    object_dim=object_dim, device=device, shared_encoders=_SHARED,
                                    face_max_side=FACE_DETECT_MAX_SIDE)


class CaptioningPipeline:
    """A captioning model, the encoder bundle it was trained with, its tokenizer and its
    generation settings; see the module docstring."""

    def __init__(self, model, bundle: EncoderBundle, tokenizer=None, info: dict[str, Any] | None = None,
                 generation: CaptionGeneration | None = None):
        self.model = model.eval()
        self.bundle = bundle
        self.contexts = tuple(model.config.contexts)
        missing = [c for c in self.contexts if c not in bundle.contexts]
        if missing:
            raise TellkitError(f"the encoder bundle does not give the model's context(s) {', '.join(missing)}")
        bundle.check_model(model.config)
        if tokenizer is None:
            tokenizer = CaptionTokenizer.load(bundle.config.caption_tokenizer)
        self.tokenizer = tokenizer
        self.generation = generation or CaptionGeneration()
        self.info = {"name": getattr(model, "family", type(model).__name__), "contexts": list(self.contexts),
                     "image_encoder": getattr(self.bundle.image_encoder, "name", None),
                     "article_encoder": getattr(self.bundle.article_encoder, "name", None)
                     if "article" in self.contexts else None,
                     "parameters": sum(p.numel() for p in model.parameters()),
                     **(info or {})}
        if "objects" in self.contexts:
            self.info["objects"] = NO_OBJECT_DETECTOR

    @property
    def reads_articles(self) -> bool:
        return self.bundle.reads_articles

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", *, max_len: int | None = None,
             beam_size: int | None = None, length_penalty: float | None = None) -> CaptioningPipeline:
        """A checkpoint (or run folder) written by ``tellkit train``; generation settings given
        here override the checkpoint's ``eval:`` ones (None keeps them)."""
        path = resolve_checkpoint(checkpoint, follow_links=False)
        meta = read_checkpoint_config(path)
        if meta.get("family") not in CAPTION_FAMILIES:
            raise TellkitError(f"{path}: holds a '{meta.get('family')}' model, not a captioner "
                               f"({', '.join(CAPTION_FAMILIES)})")
        ev = section(meta, "eval", CaptionEvalConfig)
        model = load_model(path, map_location=device).float()
        gen = ev.generation.updated(max_len=max_len, beam_size=beam_size, length_penalty=length_penalty)
        return cls(model, _bundle(meta, model.config, device),
                   info=checkpoint_info(meta["family"], path, meta), generation=gen)

    @classmethod
    def untrained(cls, seed: int = 0, device: str = "cpu") -> CaptioningPipeline:
        """A tiny randomly initialised Transform and Tell over the real offline encoders: the
        page and the API work end to end, but the captions are noise (``info.trained`` is false)."""
        import torch  # heavy

        contexts = ("image", "article", "faces")
        torch.manual_seed(seed)
        model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, face_dim=512,
                             contexts=list(contexts), max_len=12).eval().to(device)
        recipe = {"encoders": {"article": DEFAULT_ARTICLE_ENCODER}}
        return cls(model, _bundle(recipe, model.config, device),
                   info={"family": "transform_and_tell", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): captions are noise"})

    # -- inference ----------------------------------------------------------------------------
    def caption(self, items: Sequence[tuple[Any, str]]) -> list[dict[str, Any]]:
        """``[(PIL image, article text), ...]`` -> one result each (see the module docstring)."""
        import torch  # heavy

        inputs = [article_input(a if self.reads_articles else "", image=im) for im, a in items]
        encoded = self.bundle.encode(inputs, details=True)
        batch = collate_captions(encoded, self.contexts)
        dev = next(self.model.parameters()).device
        batch = {k: v.to(dev) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            out = self.model.generate(batch, return_attention=True, **self.generation.kwargs())
        tf = self.bundle.image_encoder.preprocess
        results = []
        for b, (enc, toks) in enumerate(zip(encoded, out["tokens"])):
            im = enc["pil"]
            attn = out["attention"][b]
            pieces = [{"id": int(t), "text": self.tokenizer.decode([t]),
                       "attention": {k: [round(float(x), 5) for x in v] for k, v in attn[i].items()}}
                      for i, t in enumerate(toks)]
            n_cells = enc["image"].shape[0] if "image" in enc else 0
            side = int(round(math.sqrt(n_cells)))
            rows, cols = (side, side) if side * side == n_cells else (1, n_cells)
            res = {
                "caption": self.tokenizer.decode(toks).strip(),
                "tokens": pieces,
                "score": finite_or_none(out["scores"][b]),
                "image_size": [im.width, im.height],
                "grid": {"rows": rows, "cols": cols, "box": tf.kept_box(im.width, im.height)},
                "faces": _face_boxes(enc),
                "article_text": enc.get("article_text", ""),  # the context the model read (cut to the budget)
                "article_tokens": [{"text": tok, "start": s, "end": e} for tok, (s, e)
                                   in zip(enc.get("article_tokens", []), enc.get("article_offsets", []))],
            }
            if "objects" in self.contexts:
                source = enc.get("objects_source", "none")
                res["objects"] = {"count": int(enc["objects"].shape[0]), "source": source,
                                  **({"note": NO_OBJECT_DETECTOR} if source == "none" else {})}
            results.append(res)
        return results

    __call__ = caption


def _face_boxes(enc: dict[str, Any]) -> list[dict[str, Any]]:
    if enc.get("face_boxes") is None:
        return []
    return [{"box": [round(float(v), 1) for v in box], "score": round(float(s), 4)}
            for box, s in zip(enc["face_boxes"].tolist(), enc["face_probs"].tolist())]


ImageCaptioner = CaptioningPipeline  # the name the server and older code use
