"""The captioning processor: photo (+ article) -> batch; generated ids -> captions."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tellkit.data.batch import CaptionBatch, CaptionItem, collate_captions
from tellkit.decoding import confidence as confidences
from tellkit.encoders.bundle import CaptionInput, EncoderBundle, EncodersConfig
from tellkit.encoders.preprocess import load_image
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.errors import TellkitError
from tellkit.recipes import (
    OBJECT_DIM,
    section,
)
from tellkit.tasks.captioning.inputs import article_input
from tellkit.tasks.captioning.recipe import CaptionDataConfig, CaptionEvalConfig, CaptionGeneration, model_contexts
from tellkit.tasks.processor import Processor, as_pil, finite_or_none, input_path, is_array, is_pil

NO_OBJECT_DETECTOR = "no object detector ships offline: the objects context of a new image is empty"


class CaptionProcessor(Processor):
    """Photos (+ articles) -> captioning batches through one :class:`EncoderBundle` (the frozen
    encoders the model was trained with); generated ids -> ``{"text": caption, "score", ...}``.

    An input is an image (a path, a PIL image or an array), ``{"image": ..., "article": text}``,
    an ``(image, article)`` pair, or a :class:`CaptionInput` (a data set's sample). With
    ``details`` a result also holds ``tokens`` (each generated piece with its attention over
    ``image`` grid cells, ``article`` tokens, ``faces`` and ``objects``), ``image_size``,
    ``grid`` (rows, cols and the box of the original image the grid covers), ``faces``
    (detected boxes), ``article_text`` (the context the model read), ``article_tokens`` (text
    and character span of every article token) and, for models that read objects, ``objects``
    (how many, and where they came from: no object detector ships, so for a new image the set
    is empty and the result says so)."""

    task = "caption"
    generation_class = CaptionGeneration
    eval_class = CaptionEvalConfig

    def __init__(self, bundle: EncoderBundle, tokenizer: CaptionTokenizer | None = None,
                 contexts: Sequence[str] | None = None, calibration: confidences.Calibration | None = None):
        self.bundle = bundle
        self.calibration = calibration  # None: confidence null, unsure only for runaway/empty captions
        self.contexts = tuple(contexts or bundle.contexts)
        missing = [c for c in self.contexts if c not in bundle.contexts]
        if missing:
            raise TellkitError(f"the encoder bundle does not give the model's context(s) {', '.join(missing)}")
        self.tokenizer = tokenizer or CaptionTokenizer.load(bundle.config.caption_tokenizer)

    @staticmethod
    def recipe_bundle(recipe: Mapping[str, Any], contexts: Sequence[str], *, context_mode: str | None = None,
                      object_dim: int | None = None, **runtime: Any) -> EncoderBundle:
        """The bundle a captioning recipe (or a checkpoint's stored sections) describes: its
        ``encoders`` section, its ``data`` section's article context (``context``,
        ``context_policy``, ``max_article_tokens``) and its model's ``object_dim``, for the
        model's ``contexts``. ``context_mode`` / ``object_dim`` replace the recipe's;
        ``runtime``: ``device``, ``shared_encoders``, ``memo``, ``face_max_side``."""
        data = section(recipe, "data", CaptionDataConfig)
        if object_dim is None:
            object_dim = int(section(recipe, "model").get("object_dim", OBJECT_DIM))
        return EncoderBundle(section(recipe, "encoders", EncodersConfig), contexts,
                             max_article_tokens=data.max_article_tokens, context_mode=context_mode or data.context,
                             context_policy=data.context_policy, object_dim=object_dim, **runtime)

    @classmethod
    def from_checkpoint(cls, meta, path, *, device=None, shared_encoders: dict | None = None,
                        face_max_side: int | None = None) -> CaptionProcessor:
        """A checkpoint's processor: its encoders, article context and the model's contexts (a
        model that reads no article gets no article context)."""
        contexts = model_contexts({"name": meta["family"], **(meta.get("config") or {})})
        recipe = {**meta, "model": {"name": meta["family"], **(meta.get("config") or {})}}
        bundle = cls.recipe_bundle(recipe, contexts, context_mode=None if "article" in contexts else "none",
                                   device=device or "cpu", shared_encoders=shared_encoders,
                                   face_max_side=face_max_side)
        return cls(bundle, contexts=contexts, calibration=confidences.from_meta(meta))

    def check(self, model, generation) -> None:
        """The model reads these contexts, at the sizes these encoders give."""
        missing = [c for c in model.config.contexts if c not in self.bundle.contexts]
        if missing:
            raise TellkitError(f"the encoder bundle does not give the model's context(s) {', '.join(missing)}")
        self.bundle.check_model(model.config)

    @property
    def reads_articles(self) -> bool:
        return self.bundle.reads_articles

    # --- input ---------------------------------------------------------------------------------
    def prepare(self, item: Any) -> CaptionInput:
        if isinstance(item, CaptionInput):
            return item
        article = ""
        if isinstance(item, Mapping):
            unknown = sorted(set(item) - {"image", "article"})
            if unknown or "image" not in item:
                raise TellkitError("caption: an input mapping has 'image' and optionally 'article'"
                                   + (f" (unknown: {', '.join(map(str, unknown))})" if unknown else ""))
            item, article = item["image"], item.get("article") or ""
        elif isinstance(item, tuple) and len(item) == 2:
            item, article = item
        if not isinstance(article, str):
            raise TellkitError(f"caption: an article is text, got {type(article).__name__}")
        text = article if self.reads_articles else ""
        path = input_path(item)
        if path is not None:  # the safe decoder: header checked first, EXIF orientation applied
            return article_input(text, image=load_image(path), id=str(path))
        if is_array(item):
            item = as_pil(item, "caption")
        if not is_pil(item):
            raise TellkitError(f"caption: expected an image path, a PIL image or an array, got {type(item).__name__}")
        return article_input(text, image=item.convert("RGB") if item.mode != "RGB" else item)

    def encode(self, inputs: Sequence[CaptionInput], *, details: bool = False, precision=None) -> list[dict[str, Any]]:
        """The context tensors of each input (float32), through the bundle, in ``precision``."""
        with torch.no_grad(), (precision.autocast() if precision is not None else contextlib.nullcontext()):
            items = self.bundle.encode(list(inputs), details=details)
        for it in items:  # features computed in a reduced precision are stored as float32
            for k, v in it.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float32:
                    it[k] = v.float()
        return items

    def collate_items(self, items: Sequence[CaptionItem]) -> CaptionBatch:
        return collate_captions(items, self.contexts, self.tokenizer.pad_id)

    def collate(self, prepared, precision=None) -> dict[str, Any]:
        encoded = self.encode(prepared, details=True, precision=precision)
        batch = dict(self.collate_items(encoded))
        batch["encoded"] = encoded
        return batch

    # --- output --------------------------------------------------------------------------------
    def texts(self, outputs: Mapping[str, Any]) -> list[str]:
        return [self.tokenizer.decode(toks).strip() for toks in outputs["tokens"]]

    def sureness(self, outputs: Mapping[str, Any], batch: Mapping[str, Any], b: int,
                 max_len: int | None = None) -> dict[str, Any]:
        """``{"confidence", "unsure"}`` of caption ``b`` (:mod:`tellkit.decoding.confidence`); the
        input check reads the mean of the photo's image-encoder grid vectors."""
        encoded = batch.get("encoded") or []
        grid = encoded[b].get("image") if b < len(encoded) else None
        features = grid.float().mean(0) if isinstance(grid, torch.Tensor) and grid.ndim == 2 and len(grid) else None
        return confidences.assess(self.calibration, finite_or_none(outputs["scores"][b]), list(outputs["tokens"][b]),
                                  max_len, features)

    def decode(self, outputs, batch, details: bool = True, max_len: int | None = None,
               **options) -> list[dict[str, Any]]:
        """``max_len``: the search's length limit (a caption that reached it ran away)."""
        texts = self.texts(outputs)
        if not details:
            return [{"text": t, "score": finite_or_none(s), **self.sureness(outputs, batch, b, max_len)}
                    for b, (t, s) in enumerate(zip(texts, outputs["scores"]))]
        tf = self.bundle.image_encoder.preprocess
        results = []
        for b, (enc, toks) in enumerate(zip(batch["encoded"], outputs["tokens"])):
            im = enc["pil"]
            attn = outputs["attention"][b]
            pieces = [{"id": int(t), "text": self.tokenizer.decode([t]),
                       "attention": {k: [round(float(x), 5) for x in v] for k, v in attn[i].items()}}
                      for i, t in enumerate(toks)]
            n_cells = enc["image"].shape[0] if "image" in enc else 0
            side = int(round(math.sqrt(n_cells)))
            rows, cols = (side, side) if side * side == n_cells else (1, n_cells)
            res = {
                "text": texts[b],
                "score": finite_or_none(outputs["scores"][b]),
                **self.sureness(outputs, batch, b, max_len),
                "tokens": pieces,
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


def _face_boxes(enc: dict[str, Any]) -> list[dict[str, Any]]:
    if enc.get("face_boxes") is None:
        return []
    return [{"box": [round(float(v), 1) for v in box], "score": round(float(s), 4)}
            for box, s in zip(enc["face_boxes"].tolist(), enc["face_probs"].tolist())]
