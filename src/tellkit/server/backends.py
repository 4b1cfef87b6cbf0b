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
from pathlib import Path
from typing import Any, Protocol, Sequence

from tellkit.errors import TellkitError

DEFAULT_ENCODERS = {"image": "mobilenet_v2", "article": "all-MiniLM-L6-v2", "faces": "facenet_casia"}
DEFAULT_CAPTION_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "tat_default"


class Captioner(Protocol):
    info: dict[str, Any]

    def caption(self, items: Sequence[tuple[Any, str]]) -> list[dict[str, Any]]: ...


class MathRecognizer(Protocol):
    info: dict[str, Any]

    def recognize(self, images: Sequence[Any]) -> list[dict[str, Any]]: ...


def _checkpoint_info(family: str, path: Path | None, meta: dict[str, Any], trained: bool | None = None) -> dict[str, Any]:
    """What /health and every response say about a model. A checkpoint counts as trained when
    the training loop wrote it (its metadata has a ``train`` section) unless told otherwise."""
    if trained is None:
        trained = bool(meta.get("train")) or bool(meta.get("trained"))
    info = {"family": family, "checkpoint": str(path) if path else None, "trained": trained}
    for key in ("task", "step", "tellkit_version"):
        if key in meta:
            info[key] = meta[key]
    return info


# --- captioning: Transform and Tell --------------------------------------------------------------
def _crop_box(width: int, height: int, resize: int, crop: int) -> list[float]:
    """The part of the original image that ImageNetTransform (resize short side, centre crop)
    keeps, in original pixel coordinates [x0, y0, x1, y1]: the image grid covers this box."""
    rw, rh = (resize, int(resize * height / width)) if width <= height else (int(resize * width / height), resize)
    left, top = (rw - crop) / 2.0, (rh - crop) / 2.0
    sx, sy = width / rw, height / rh
    return [round(left * sx, 1), round(top * sy, 1), round((left + crop) * sx, 1), round((top + crop) * sy, 1)]


class TransformAndTellCaptioner:
    """Image + article -> caption with per-token attention, using a Transform and Tell model and
    the frozen encoders its checkpoint was trained on."""

    def __init__(self, model, image_encoder, article_encoder=None, face_encoder=None, tokenizer=None,
                 info: dict[str, Any] | None = None, max_len: int | None = None, beam_size: int = 1,
                 max_article_tokens: int = 512):
        self.model = model.eval()
        self.contexts = tuple(model.config.contexts)
        self.image_encoder = image_encoder
        self.article_encoder = article_encoder
        self.face_encoder = face_encoder
        if "article" in self.contexts and article_encoder is None:
            raise TellkitError("this captioning model attends to the article: an article encoder is needed")
        if "faces" in self.contexts and face_encoder is None:
            raise TellkitError("this captioning model attends to faces, but no face encoder is available "
                               "(tellkit.encoders.faces.FaceEncoder)")
        if "objects" in self.contexts:
            raise TellkitError("the server cannot run models with the 'objects' context (no object detector ships)")
        cfg = model.config
        if "image" in self.contexts and image_encoder.out_dim != cfg.image_dim:
            raise TellkitError(f"image encoder {image_encoder.name} gives {image_encoder.out_dim}-d features; "
                               f"the model expects image_dim={cfg.image_dim}")
        if article_encoder is not None and "article" in self.contexts:
            if article_encoder.dim != cfg.article_dim or (cfg.article_layers > 1 and article_encoder.num_layers != cfg.article_layers):
                raise TellkitError(f"article encoder {article_encoder.name} gives {article_encoder.num_layers} x "
                                   f"{article_encoder.dim}; the model expects {cfg.article_layers} x {cfg.article_dim}")
        if tokenizer is None:
            from tellkit.encoders.tokenizer import CaptionTokenizer

            tokenizer = article_encoder.caption_tokenizer if article_encoder is not None else CaptionTokenizer.load()
        self.tokenizer = tokenizer
        self.max_len, self.beam_size, self.max_article_tokens = max_len, int(beam_size), int(max_article_tokens)
        self.info = {"name": "transform_and_tell", "contexts": list(self.contexts),
                     "image_encoder": getattr(image_encoder, "name", None),
                     "article_encoder": getattr(article_encoder, "name", None),
                     "parameters": sum(p.numel() for p in model.parameters()),
                     **(info or {})}

    @classmethod
    def load(cls, checkpoint: str | Path, device: str = "cpu", **kw) -> "TransformAndTellCaptioner":
        from tellkit.checkpoint import load_model, read_checkpoint_config
        from tellkit.models.transform_and_tell import TransformAndTell

        path = Path(checkpoint)
        if (path / "checkpoints").is_dir():  # a run folder: its best (else last) checkpoint
            path = next((path / "checkpoints" / n for n in ("best", "last") if (path / "checkpoints" / n).exists()), path)
        meta = read_checkpoint_config(path)
        model = load_model(path, map_location=device, expect=TransformAndTell).float()
        names = {**DEFAULT_ENCODERS, **(meta.get("encoders") or (meta.get("data") or {}).get("encoders") or {})}
        enc = build_encoders(model.config.contexts, names)
        return cls(model, info=_checkpoint_info("transform_and_tell", path, meta), **enc, **kw)

    @classmethod
    def untrained(cls, seed: int = 0) -> "TransformAndTellCaptioner":
        """A tiny randomly initialised model over the real offline encoders: the page and the API
        work end to end, but the captions are noise (``info.trained`` is false)."""
        import torch

        from tellkit.registry import create_model

        contexts = ["image", "article"] + (["faces"] if face_encoder_available() else [])
        torch.manual_seed(seed)
        model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, face_dim=512,
                             contexts=contexts, max_len=12).eval()
        enc = build_encoders(contexts, DEFAULT_ENCODERS)
        return cls(model, info={"family": "transform_and_tell", "checkpoint": None, "trained": False,
                                "note": "tiny random model (tellkit serve --untrained): captions are noise"}, **enc)

    # -- inference ----------------------------------------------------------------------------
    def caption(self, items: Sequence[tuple[Any, str]]) -> list[dict[str, Any]]:
        import torch

        images = [im for im, _ in items]
        texts = [(a or "").strip() for _, a in items]
        batch: dict[str, Any] = {}
        feats, mask = self.image_encoder.encode(images)
        batch["image"], batch["image_mask"] = feats, mask
        n_cells = feats.size(1)
        side = int(round(math.sqrt(n_cells)))
        rows, cols = (side, side) if side * side == n_cells else (1, n_cells)
        tf = self.image_encoder.preprocess
        art = None
        if "article" in self.contexts:
            art = self.article_encoder.encode(texts, max_tokens=self.max_article_tokens)
            batch["article"], batch["article_mask"] = art["hidden"], art["mask"]
            if self.model.config.copy:
                batch["article_ids"] = self.article_encoder.caption_ids(texts, art["offsets"])
        faces: list[list[dict[str, Any]]] = [[] for _ in images]
        if "faces" in self.contexts:
            emb, fmask, faces = self.face_encoder_batch(images)
            batch["faces"], batch["faces_mask"] = emb, fmask
        with torch.no_grad():
            out = self.model.generate(batch, max_len=self.max_len, beam_size=self.beam_size, return_attention=True)
        results = []
        for b, (im, toks) in enumerate(zip(images, out["tokens"])):
            attn = out["attention"][b]
            pieces = [{"id": int(t), "text": self.tokenizer.decode([t]),
                       "attention": {k: [round(float(x), 5) for x in v] for k, v in attn[i].items()}}
                      for i, t in enumerate(toks)]
            res = {
                "caption": self.tokenizer.decode(toks).strip(),
                "tokens": pieces,
                "score": float(out["scores"][b]),
                "image_size": [im.width, im.height],
                "grid": {"rows": rows, "cols": cols, "box": _crop_box(im.width, im.height, tf.resize, tf.crop)},
                "faces": faces[b],
                "article_text": texts[b],
                "article_tokens": [],
            }
            if art is not None:
                n = len(art["tokens"][b])
                res["article_tokens"] = [{"text": art["tokens"][b][i], "start": art["offsets"][b][i][0],
                                          "end": art["offsets"][b][i][1]} for i in range(n)]
            results.append(res)
        return results

    def face_encoder_batch(self, images):
        """-> (embeddings float[B, F, 512], mask bool[B, F], per image a list of face boxes)."""
        import torch

        per = [self.face_encoder.encode_image(im) for im in images]
        F = max((len(p["embeddings"]) for p in per), default=0)
        dim = self.model.config.face_dim
        emb = torch.zeros(len(images), F, dim)
        mask = torch.zeros(len(images), F, dtype=torch.bool)
        boxes = []
        for b, p in enumerate(per):
            k = len(p["embeddings"])
            if k:
                emb[b, :k] = torch.as_tensor(p["embeddings"], dtype=torch.float32)
                mask[b, :k] = True
            boxes.append([{"box": [round(float(v), 1) for v in box], "score": round(float(s), 4)}
                          for box, s in zip(p["boxes"], p["scores"])])
        return emb, mask, boxes


def face_encoder_available() -> bool:
    try:
        from tellkit.encoders.faces import FaceEncoder  # noqa: F401
    except ImportError:
        return False
    return True


class _FaceAdapter:
    """``encode_image(PIL) -> {"boxes", "scores", "embeddings"}`` over the project's FaceEncoder
    (``detect_and_embed``: MTCNN boxes, largest faces first, FaceNet 512-d embeddings)."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.name = type(encoder).__name__

    def encode_image(self, image) -> dict[str, Any]:
        out = self.encoder.detect_and_embed(image)
        boxes = [[float(v) for v in b] for b in out["boxes"]]
        return {"boxes": boxes, "scores": [float(p) for p in out["probs"]], "embeddings": out["embeddings"]}


def build_encoders(contexts: Sequence[str], names: dict[str, str]) -> dict[str, Any]:
    """The frozen encoders a captioning model needs (only those of its contexts)."""
    from tellkit.encoders.image import build_image_encoder
    from tellkit.encoders.text import ArticleEncoder

    out: dict[str, Any] = {"image_encoder": build_image_encoder(names["image"])}
    if "article" in contexts:
        art = names["article"]
        out["article_encoder"] = ArticleEncoder(None if art in ("all-MiniLM-L6-v2", "minilm", None) else art)
    if "faces" in contexts:
        if not face_encoder_available():
            raise TellkitError("the captioning model attends to faces but tellkit.encoders.faces.FaceEncoder "
                               "is not available in this install")
        from tellkit.encoders.faces import FaceEncoder

        out["face_encoder"] = _FaceAdapter(FaceEncoder())
    return out


# --- handwritten math: BTTR ---------------------------------------------------------------------
class BTTRMathRecognizer:
    """PIL images -> LaTeX through ``tellkit.tasks.recognition.Recognizer``."""

    def __init__(self, recognizer, info: dict[str, Any], beam_size: int | None = None, max_len: int | None = None):
        self.rec = recognizer
        self.beam_size, self.max_len = beam_size, max_len
        self.info = {"name": "bttr", "parameters": sum(p.numel() for p in recognizer.model.parameters()), **info}

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, device: str = "cpu", **kw) -> "BTTRMathRecognizer":
        from tellkit.checkpoint import read_checkpoint_config
        from tellkit.tasks.recognition import Recognizer

        rec = Recognizer.load(checkpoint, device=device)
        meta = read_checkpoint_config(rec.checkpoint) if rec.checkpoint else {}
        return cls(rec, _checkpoint_info("bttr", rec.checkpoint, meta), **kw)

    @classmethod
    def untrained(cls, seed: int = 0) -> "BTTRMathRecognizer":
        import torch

        from tellkit.registry import create_model
        from tellkit.tasks.recognition import Recognizer

        torch.manual_seed(seed)
        model = create_model("bttr/tiny").eval()
        rec = Recognizer(model, {}, {"beam_size": 2, "max_len": 12})
        return cls(rec, {"family": "bttr", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): LaTeX is noise"})

    def recognize(self, images: Sequence[Any]) -> list[dict[str, Any]]:
        return self.rec.recognize(list(images), batch_size=max(1, len(images)), beam_size=self.beam_size,
                                  max_len=self.max_len)
