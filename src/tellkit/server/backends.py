"""The two models the server runs, behind two small interfaces the app and its tests rely on.

- A captioner: ``caption([(PIL image, article text), ...]) -> [result, ...]`` where a result is
  a dict with ``caption`` (str), ``tokens`` (the generated pieces, each with its attention over
  ``image`` grid cells, ``article`` tokens and ``faces``), ``grid`` (rows, cols and the box of
  the original image the grid covers), ``article_tokens`` (text and character span of every
  article token the model attended to) and ``faces`` (detected boxes).
- A recognizer: ``recognize([PIL image, ...]) -> [{"latex", "tokens", "score"}, ...]``.

Each backend carries ``info``: which model it serves, from which checkpoint, and whether it
was trained (``trained: false`` for the tiny random models used by ``--untrained``).

Implementations here are thin adapters over the project's own pieces: Transform and Tell
(``tellkit.models.transform_and_tell``) fed by the frozen encoders in ``tellkit.encoders``, and
BTTR through ``tellkit.tasks.recognition.Recognizer`` (the code ``tellkit recognize`` uses).
Checkpoints are only ever opened from paths given at start-up (``tellkit serve --checkpoint``),
never from a request.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

from tellkit.errors import TellkitError
from tellkit.pipelines.base import checkpoint_info, finite_or_none
from tellkit.pipelines.recognition import BTTRMathRecognizer  # noqa: F401 - served from here too

DEFAULT_ENCODERS = {"image": "mobilenet_v2", "article": "all-MiniLM-L6-v2", "faces": "facenet_casia"}


_finite = finite_or_none
_checkpoint_info = checkpoint_info


# --- captioning: Transform and Tell --------------------------------------------------------------
def _crop_box(width: int, height: int, resize: int, crop: int) -> list[float]:
    """The part of the original image that ImageNetTransform (resize short side, centre crop)
    keeps, in original pixel coordinates [x0, y0, x1, y1]: the image grid covers this box."""
    rw, rh = (resize, int(resize * height / width)) if width <= height else (int(resize * width / height), resize)
    left, top = (rw - crop) / 2.0, (rh - crop) / 2.0
    sx, sy = width / rw, height / rh
    return [round(left * sx, 1), round(top * sy, 1), round((left + crop) * sx, 1), round((top + crop) * sy, 1)]


def article_sample(text: str):
    """A pasted article as a caption sample for the context builder: paragraphs are the blocks
    between blank lines (or the lines, when there are none); no title, no image position, so the
    model reads the article from its start up to the encoder's token budget."""
    from tellkit.data.sample import CaptionSample

    text = (text or "").strip()
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    if len(blocks) <= 1:
        blocks = [b for b in text.splitlines() if b.strip()]
    return CaptionSample(id="request", caption="", paragraphs=blocks)


# the captioning families a checkpoint may hold (same batches and ``generate`` API)
CAPTION_FAMILIES = ("transform_and_tell", "show_tell", "show_attend_tell", "lstm_captioner")


class ImageCaptioner:
    """Image + article -> caption with per-token attention, using a captioning model (Transform
    and Tell, or one of its baselines: Show and Tell, Show-Attend-and-Tell, the LSTM captioner)
    and the frozen encoders its checkpoint was trained with. The encoders and the article context
    (which paragraphs fit the token budget) come from the captioning task's ``Featurizer``
    (``tellkit.tasks.captioning``), so inputs are encoded exactly as in training."""

    def __init__(self, model, featurizer, tokenizer=None, info: dict[str, Any] | None = None,
                 max_len: int | None = None, beam_size: int = 1, length_penalty: float = 1.0,
                 context_mode: str = "location_aware"):
        self.model = model.eval()
        self.featurizer = featurizer
        self.contexts = tuple(model.config.contexts)
        cfg = model.config
        if "objects" in self.contexts:
            raise TellkitError("the server cannot run models with the 'objects' context (no object detector ships)")
        if "image" in self.contexts and self.image_encoder.out_dim != cfg.image_dim:
            raise TellkitError(f"image encoder {self.image_encoder.name} gives {self.image_encoder.out_dim}-d features; "
                               f"the model expects image_dim={cfg.image_dim}")
        if "article" in self.contexts:
            enc = self.article_encoder
            layers = getattr(cfg, "article_layers", 1)
            if enc.dim != cfg.article_dim or (layers > 1 and enc.num_layers != layers):
                raise TellkitError(f"article encoder {enc.name} gives {enc.num_layers} x {enc.dim}; "
                                   f"the model expects {layers} x {cfg.article_dim}")
        if "faces" in self.contexts:
            self.featurizer.face_encoder  # noqa: B018 - load now: a missing face model fails at start-up
        if tokenizer is None:
            from tellkit.encoders.tokenizer import CaptionTokenizer

            tokenizer = CaptionTokenizer.load()
        self.tokenizer = tokenizer
        self.max_len, self.beam_size, self.length_penalty = max_len, int(beam_size), float(length_penalty)
        self.context_mode = "none" if "article" not in self.contexts else context_mode
        self.info = {"name": getattr(model, "family", type(model).__name__), "contexts": list(self.contexts),
                     "image_encoder": getattr(self.image_encoder, "name", None),
                     "article_encoder": getattr(self.article_encoder, "name", None) if "article" in self.contexts else None,
                     "parameters": sum(p.numel() for p in model.parameters()),
                     **(info or {})}

    @property
    def image_encoder(self):
        return self.featurizer.image_encoder

    @property
    def article_encoder(self):
        return self.featurizer.article_encoder

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", max_len: int | None = None, beam_size: int = 1,
             **kw) -> "ImageCaptioner":
        """A checkpoint (or run folder) written by ``tellkit train``: the recipe sections in its
        config.json name the encoders, the article context and the generation settings."""
        from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
        from tellkit.encoders.tokenizer import CaptionTokenizer

        path = resolve_checkpoint(checkpoint, follow_links=False)
        meta = read_checkpoint_config(path)
        if meta.get("family") not in CAPTION_FAMILIES:
            raise TellkitError(f"{path}: holds a '{meta.get('family')}' model, not a captioner "
                               f"({', '.join(CAPTION_FAMILIES)})")
        model = load_model(path, map_location=device).float()
        encoders = meta.get("encoders") or DEFAULT_ENCODERS
        data, ev = meta.get("data") or {}, meta.get("eval") or {}
        feat = _featurizer(encoders, model.config.contexts, int(data.get("max_article_tokens", 512)), device)
        return cls(model, feat, tokenizer=CaptionTokenizer.load(encoders.get("caption_tokenizer")),
                   info=_checkpoint_info(meta["family"], path, meta),
                   max_len=max_len or ev.get("max_len"), beam_size=beam_size,
                   length_penalty=float(ev.get("length_penalty", 1.0)),
                   context_mode=data.get("context", "location_aware"), **kw)

    @classmethod
    def untrained(cls, seed: int = 0, device: str = "cpu") -> "ImageCaptioner":
        """A tiny randomly initialised model over the real offline encoders: the page and the API
        work end to end, but the captions are noise (``info.trained`` is false)."""
        import torch

        from tellkit.registry import create_model

        contexts = ["image", "article", "faces"]
        torch.manual_seed(seed)
        model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, face_dim=512,
                             contexts=contexts, max_len=12).eval().to(device)
        return cls(model, _featurizer(DEFAULT_ENCODERS, contexts, 512, device),
                   info={"family": "transform_and_tell", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): captions are noise"})

    # -- inference ----------------------------------------------------------------------------
    def caption(self, items: Sequence[tuple[Any, str]]) -> list[dict[str, Any]]:
        import torch

        images = [im for im, _ in items]
        f = self.featurizer
        texts = [f.context_text(article_sample(a), self.context_mode) if self.context_mode != "none" else ""
                 for _, a in items]
        batch: dict[str, Any] = {}
        feats, mask = self.image_encoder.encode(images)
        batch["image"], batch["image_mask"] = feats, mask
        n_cells = feats.size(1)
        side = int(round(math.sqrt(n_cells)))
        rows, cols = (side, side) if side * side == n_cells else (1, n_cells)
        tf = self.image_encoder.preprocess
        art = None
        if "article" in self.contexts:
            art = self.article_encoder.encode(texts, max_tokens=f.max_article_tokens)
            batch["article"], batch["article_mask"] = art["hidden"], art["mask"]
            if getattr(self.model.config, "copy", False):
                batch["article_ids"] = self.article_encoder.caption_ids(texts, art["offsets"])
        faces: list[list[dict[str, Any]]] = [[] for _ in images]
        if "faces" in self.contexts:
            batch["faces"], batch["faces_mask"], faces = self._faces(images)
        dev = next(self.model.parameters()).device
        batch = {k: v.to(dev) for k, v in batch.items()}
        with torch.no_grad():
            out = self.model.generate(batch, max_len=self.max_len, beam_size=self.beam_size,
                                      length_penalty=self.length_penalty, return_attention=True)
        results = []
        for b, (im, toks) in enumerate(zip(images, out["tokens"])):
            attn = out["attention"][b]
            pieces = [{"id": int(t), "text": self.tokenizer.decode([t]),
                       "attention": {k: [round(float(x), 5) for x in v] for k, v in attn[i].items()}}
                      for i, t in enumerate(toks)]
            res = {
                "caption": self.tokenizer.decode(toks).strip(),
                "tokens": pieces,
                "score": _finite(out["scores"][b]),
                "image_size": [im.width, im.height],
                "grid": {"rows": rows, "cols": cols, "box": _crop_box(im.width, im.height, tf.resize, tf.crop)},
                "faces": faces[b],
                "article_text": texts[b],  # the context the model read (whitespace-normalised, cut to the budget)
                "article_tokens": [],
            }
            if art is not None:
                res["article_tokens"] = [{"text": tok, "start": s, "end": e}
                                         for tok, (s, e) in zip(art["tokens"][b], art["offsets"][b])]
            results.append(res)
        return results

    def _faces(self, images):
        """-> (embeddings float[B, F, D], mask bool[B, F], per image its face boxes), F <= 4."""
        import torch

        per = [self.featurizer.faces(im) for im in images]
        F = max((len(p["embeddings"]) for p in per), default=0)
        emb = torch.zeros(len(images), F, self.model.config.face_dim)
        mask = torch.zeros(len(images), F, dtype=torch.bool)
        boxes = []
        for b, p in enumerate(per):
            k = len(p["embeddings"])
            if k:
                emb[b, :k] = torch.as_tensor(p["embeddings"], dtype=torch.float32)
                mask[b, :k] = True
            boxes.append([{"box": [round(float(v), 1) for v in box], "score": round(float(s), 4)}
                          for box, s in zip(p["boxes"], p["probs"])])
        return emb, mask, boxes


def _featurizer(encoders, contexts, max_article_tokens: int, device):
    from tellkit.tasks.captioning import Featurizer

    return Featurizer(encoders, contexts, max_article_tokens=max_article_tokens, device=device)
