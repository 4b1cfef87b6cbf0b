"""The one input path of the captioners: frozen encoders that turn images and articles into
batch items. The feature cache (``tellkit features``, ``data.features``), training, evaluation,
``tellkit caption``, ``tellkit demo`` and the server all encode through :class:`EncoderBundle`.

    bundle = EncoderBundle(EncodersConfig(...), contexts=("image", "article", "faces"), max_article_tokens=512)
    # a captioning recipe's bundle: tellkit.tasks.captioning.CaptionProcessor.from_recipe
    items = bundle.encode([CaptionInput("id", image_path="photo.jpg", title="...", paragraphs=[...])])
    items[0]["image"]  float[N, C]     items[0]["faces"]  float[F, 512] (F <= cfg.max_faces)
    items[0]["article"] float[n_layers, L, D], items[0]["article_ids"] long[L]

Items follow :class:`tellkit.data.batch.CaptionItem`; :func:`tellkit.data.batch.collate_captions`
pads them into a batch. Precomputed context sets win over the encoders: an input's ``faces``
(float32 [F, 512], NYTimes800k's FaceNet embeddings) is used instead of running the face
detector, and its ``objects`` (float32 [O, 2048], NYTimes800k's YOLOv3 + ResNet-152 vectors) is
the objects context. An image without them has its objects detected when ``encoders.object_weights``
names darknet's ``yolov3.weights`` (:class:`tellkit.encoders.objects.ObjectEncoder`: YOLOv3 boxes,
their crops through ResNet-152, as the reference stored them; ``objects_source: "yolov3"``);
without that file no detector runs, the objects context is empty (``objects_source: "none"``
in the details) and the caption output says so.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tellkit.encoders.context import build_context
from tellkit.encoders.faces import FaceEncoder
from tellkit.encoders.image import build_image_encoder
from tellkit.encoders.objects import WEIGHTS_HELP as OBJECT_WEIGHTS_HELP
from tellkit.encoders.objects import ObjectEncoder
from tellkit.encoders.preprocess import load_image
from tellkit.encoders.sources import SOURCES, how_to_pass
from tellkit.encoders.sources import what as network
from tellkit.encoders.static_vectors import is_static_spec
from tellkit.encoders.text import build_article_encoder
from tellkit.errors import TellkitError
from tellkit.recipes import (
    CONTEXT_MODES,
    CONTEXT_POLICIES,
    DEFAULT_ARTICLE_ENCODER,
    DEFAULT_FACE_ENCODER,
    DEFAULT_IMAGE_ENCODER,
    FACE_DIM,
    IMAGE_FITS,
    MAX_FACES,
    OBJECT_DIM,
    section,
)

__all__ = ["CONTEXT_MODES", "CONTEXT_POLICIES", "DEFAULT_ARTICLE_ENCODER", "DEFAULT_FACE_ENCODER", "FACE_DIM",
           "MAX_FACES", "OBJECT_DIM", "CaptionInput", "EncoderBundle", "EncodersConfig"]

ENCODER_MODES = ("frozen", "reference")  # encoders.mode
DATASET_IMAGES = ("tellkit", "reference")  # encoders.dataset_images


@dataclass
class EncodersConfig:
    """A recipe's ``encoders:`` section (unknown keys are refused)."""

    # mobilenet_v2 | efficientnet_lite0 | efficientnet_lite1 | efficientnet_lite2 | resnet50 | resnet101 | resnet152
    image: str = DEFAULT_IMAGE_ENCODER
    image_weights: str | None = None  # None: the encoder's offline default; a file; "random"
    image_fit: str = "crop"  # crop: short side + centre crop; squash: whole photo to a square
    article: str | None = DEFAULT_ARTICLE_ENCODER  # HF name/folder, or static / static:NAME / glove:PATH
    faces: str | None = DEFAULT_FACE_ENCODER  # facenet_casia (packaged) or another FaceNet with face_weights
    face_weights: str | None = None  # a facenet-pytorch-layout state dict (e.g. VGGFace2)
    face_standardization: str | None = None  # None: the face encoder's default
    objects: str | None = None  # the detector the object vectors come from (yolov3_resnet152: the reference's)
    # darknet's yolov3.weights: objects are detected in images that come without vectors (None: none are)
    object_weights: str | None = None
    object_cfg: str | None = None  # a darknet .cfg of the detector (None: yolov3.cfg's layout, built in)
    # ResNet-152 for the object crops (None: image_weights, when the image encoder is resnet152)
    object_resnet_weights: str | None = None
    caption_tokenizer: str | None = None  # None: the packaged RoBERTa BPE
    max_faces: int = MAX_FACES
    # frozen: image and article encoders in eval mode, features cacheable (data.features);
    # reference: as the Transform and Tell reference trained them (gradients off, but in train
    # mode during training steps: BatchNorm batch statistics and running-stat updates, RoBERTa
    # dropout), so features are computed in each step from the batch and never cached
    mode: str = "frozen"
    # how a data set's images are read: tellkit (EXIF-rotated, the encoder's resize filter) or
    # reference (the pixels as stored, Lanczos resize, as the reference prepared them); a
    # user's own photo is always EXIF-rotated
    dataset_images: str = "tellkit"

    def __post_init__(self) -> None:
        if self.image_fit not in IMAGE_FITS:
            raise TellkitError(f"encoders.image_fit must be one of {', '.join(IMAGE_FITS)}, got {self.image_fit!r}")
        if self.mode not in ENCODER_MODES:
            raise TellkitError(f"encoders.mode must be one of {', '.join(ENCODER_MODES)}, got {self.mode!r}")
        if self.dataset_images not in DATASET_IMAGES:
            raise TellkitError(f"encoders.dataset_images must be one of {', '.join(DATASET_IMAGES)}, "
                               f"got {self.dataset_images!r}")
        if int(self.max_faces) < 0:
            raise TellkitError(f"encoders.max_faces must be >= 0, got {self.max_faces}")

    @classmethod
    def from_recipe(cls, sec: Mapping[str, Any] | EncodersConfig | None) -> EncodersConfig:
        """An ``encoders`` section (a mapping, None, or already an EncodersConfig)."""
        return section({"encoders": sec}, "encoders", cls)

    @property
    def article_is_packaged(self) -> bool:
        return self.article in (None, "minilm", DEFAULT_ARTICLE_ENCODER)


@dataclass
class CaptionInput:
    """What the bundle encodes: one image and its text context (and precomputed context sets).

    ``paragraphs[:image_position]`` come before the image (None: position unknown)."""

    id: str
    image_path: str | None = None
    title: str = ""
    paragraphs: list[str] = field(default_factory=list)
    image_position: int | None = None
    image: Any = None  # an already decoded PIL image (wins over image_path)
    faces: Any = None  # precomputed float32 [F, 512] (array-like), or None: detect
    objects: Any = None  # precomputed float32 [O, 2048] (array-like), or None: detected or empty
    from_dataset: bool = False  # a data set's image (read as encoders.dataset_images says), not a user's photo


def _as_set(values, dim: int, limit: int | None, what: str) -> torch.Tensor:
    if hasattr(values, "__array__") and not isinstance(values, torch.Tensor):  # e.g. vectors read on demand
        values = np.asarray(values, dtype=np.float32)
    x = torch.as_tensor(values, dtype=torch.float32)
    if x.numel() == 0:
        return torch.zeros(0, dim)
    if x.dim() != 2 or x.size(1) != dim:
        raise TellkitError(f"precomputed {what} must be [n, {dim}], got {tuple(x.shape)}")
    return x[:limit] if limit is not None else x


class EncoderBundle:
    """The frozen encoders of an :class:`EncodersConfig` for the given contexts, built on first
    use, and the article-context rule (which paragraphs fill ``max_article_tokens``)."""

    def __init__(self, config: EncodersConfig | Mapping[str, Any] | None = None,
                 contexts: Sequence[str] = ("image", "article", "faces"), *, max_article_tokens: int = 512,
                 context_mode: str = "location_aware", context_policy: str = "reference",
                 device: str | torch.device = "cpu",
                 object_dim: int = OBJECT_DIM, shared_encoders: dict | None = None, memo: dict | None = None,
                 face_max_side: int | None = None):
        self.config = EncodersConfig.from_recipe(config)
        # faces are detected on a copy no longer than this (None: the image as given, as in
        # training and the feature cache); the crops still come from the full image
        self.face_max_side = None if face_max_side is None else int(face_max_side)
        self.object_dim = int(object_dim)  # the size of the precomputed object vectors the model reads
        # ``shared_encoders``: a dict, shared by several bundles, that keeps the built encoders
        # (keyed by what decides them); ``memo``: one that also keeps every image / article
        # encoding (float16), for runs that encode the same inputs again (``tellkit table`` rows)
        self.shared_encoders = shared_encoders
        self.memo = memo
        self.contexts = tuple(contexts)
        self.max_article_tokens = int(max_article_tokens)
        if context_mode not in CONTEXT_MODES:
            raise TellkitError(f"data.context must be one of {', '.join(CONTEXT_MODES)}, got {context_mode!r}")
        self.context_mode = context_mode
        if context_policy not in CONTEXT_POLICIES:
            raise TellkitError(f"data.context_policy must be one of {', '.join(CONTEXT_POLICIES)}, "
                               f"got {context_policy!r}")
        self.context_policy = context_policy  # tellkit.encoders.context: the reference's rules, or "cut"
        self.device = torch.device(device)

    # -- the encoders (built on first use) ----------------------------------------------------
    def _shared(self, key: tuple, build):
        # reference mode: the encoders' BatchNorm statistics belong to one run, never shared
        if self.shared_encoders is None or self.reference_mode:
            return build()
        key = ("encoder", str(self.device), *key)
        if key not in self.shared_encoders:
            self.shared_encoders[key] = build()
        return self.shared_encoders[key]

    @property
    def reference_mode(self) -> bool:
        """``encoders.mode: reference``: the image and article encoders follow train() / eval()."""
        return self.config.mode == "reference"

    def _follow(self, encoder):
        if self.reference_mode and hasattr(encoder, "follows_train_mode"):
            encoder.follows_train_mode = True
        return encoder

    @functools.cached_property
    def image_encoder(self):

        c = self.config

        def build():
            try:
                enc = build_image_encoder(c.image, c.image_weights, c.image_fit)
            except TellkitError as exc:
                if c.image_weights is not None and c.image not in SOURCES:
                    raise
                raise TellkitError(f"{network(c.image, 'the image encoder')} cannot be loaded ({exc}); "
                                   f"{how_to_pass(c.image, 'image_weights')}") from None
            return self._follow(enc.to(self.device))

        return self._shared(("image", c.image, c.image_weights, c.image_fit, c.mode), build)

    @functools.cached_property
    def article_encoder(self):
        """A Hugging Face encoder, or a static word-vector table (``static``, ``glove:PATH``)."""

        spec = None if self.config.article_is_packaged else self.config.article

        def build():
            try:
                enc = build_article_encoder(spec)
            except TellkitError as exc:
                if spec is None or is_static_spec(spec):
                    raise
                raise TellkitError(f"{network(spec, 'the article encoder')} cannot be loaded ({exc}); "
                                   f"{how_to_pass(spec, 'article', 'DIR')}") from None
            return self._follow(enc.to(self.device))

        return self._shared(("article", spec, self.config.mode), build)

    def to(self, device: str | torch.device) -> EncoderBundle:
        """Build the encoders on ``device`` from now on, and move those already built there."""
        device = torch.device(device)
        if device != self.device:
            self.device = device
            for name in ("image_encoder", "article_encoder", "face_encoder", "object_encoder"):
                enc = self.__dict__.get(name)
                if hasattr(enc, "to"):
                    enc.to(device)
        return self

    def train(self, mode: bool = True) -> None:
        """Put the image and article encoders in train (or eval) mode. Only with
        ``encoders.mode: reference`` does this change anything (BatchNorm batch statistics and
        running-stat updates, article-encoder dropout); frozen encoders stay in eval mode."""
        if not self.reference_mode:
            return
        for name in ("image", "article"):
            if name in self.contexts:
                enc = self.image_encoder if name == "image" else self.article_encoder
                if hasattr(enc, "train"):
                    enc.train(mode)

    def _stochastic(self, encoder) -> bool:
        """An encoder in train mode gives other features at every call: nothing is memoised."""
        return bool(getattr(encoder, "training", False))

    @functools.cached_property
    def face_encoder(self):

        c = self.config
        if c.faces not in (DEFAULT_FACE_ENCODER, None) and c.face_weights is None:
            raise TellkitError(f"{network(c.faces, 'the face encoder')} weights are needed (encoders.faces="
                               f"{c.faces!r} without encoders.face_weights; the offline default is "
                               f"{DEFAULT_FACE_ENCODER}): {how_to_pass(c.faces, 'face_weights')}")
        kw = {"standardization": c.face_standardization} if c.face_standardization else {}
        return self._shared(
            ("faces", c.face_weights, c.max_faces, c.face_standardization),
            lambda: FaceEncoder(facenet_weights=c.face_weights, max_faces=c.max_faces, **kw).to(self.device))

    @property
    def detects_objects(self) -> bool:
        """Objects are detected (YOLOv3 + ResNet-152) in images that come without object vectors."""
        return "objects" in self.contexts and bool(self.config.object_weights)

    @functools.cached_property
    def object_encoder(self) -> ObjectEncoder:
        c = self.config
        if not c.object_weights:
            raise TellkitError(f"the objects encoder (YOLOv3) needs its weights: {OBJECT_WEIGHTS_HELP}")
        resnet = c.object_resnet_weights
        if resnet is None and c.image == "resnet152":
            resnet = c.image_weights
        if resnet is None:
            raise TellkitError("the objects encoder needs ResNet-152 weights for its crops: "
                               "encoders.object_resnet_weights=PATH (a torchvision resnet152-*.pth state dict), "
                               "or encoders.image=resnet152 with encoders.image_weights")
        return self._shared(("objects", c.object_weights, c.object_cfg, resnet), lambda: ObjectEncoder.from_files(
            c.object_weights, resnet, cfg=c.object_cfg).to(self.device))

    def check_model(self, model_config) -> None:
        """Refuse a model whose context sizes differ from what these encoders give."""
        cfg = model_config
        self.check_reachable()
        img = self.image_encoder if "image" in self.contexts else None
        if img is not None and img.out_dim != cfg.image_dim:
            raise TellkitError(f"image encoder {img.name} gives {img.out_dim}-d features; "
                               f"the model expects image_dim={cfg.image_dim}")
        if "article" in self.contexts:
            enc = self.article_encoder
            layers = getattr(cfg, "article_layers", 1)
            if enc.dim != cfg.article_dim or (layers > 1 and enc.num_layers != layers):
                raise TellkitError(f"article encoder {enc.name} gives {enc.num_layers} x {enc.dim}; "
                                   f"the model expects {layers} x {cfg.article_dim}")

    def check_reachable(self) -> None:
        """Build every encoder of the contexts now: each one whose weights cannot be reached (no
        file, hub unreachable) is named, with its source and how to pass a local copy, in one line."""
        missing = []
        for context, attr in (("image", "image_encoder"), ("article", "article_encoder"), ("faces", "face_encoder")):
            if context in self.contexts:
                try:
                    getattr(self, attr)
                except TellkitError as exc:
                    missing.append(str(exc))
        if missing:
            raise TellkitError(" | ".join(missing))

    # -- article context ------------------------------------------------------------------------
    @property
    def reads_articles(self) -> bool:
        return "article" in self.contexts and self.context_mode != "none"

    def context_text(self, inp: CaptionInput) -> str:
        """The article text the captioner reads (see ``tellkit.encoders.context``)."""
        if not self.reads_articles or not (inp.title or inp.paragraphs):
            return ""

        enc = self.article_encoder
        budget = min(self.max_article_tokens, enc.max_tokens) - enc.num_special
        where = inp.image_position if self.context_mode == "location_aware" else None
        return build_context(inp.title, inp.paragraphs, where, count_tokens=enc.count_tokens, max_tokens=budget,
                             policy=self.context_policy).text

    # -- the one encoding routine ---------------------------------------------------------------
    @torch.no_grad()
    def encode(self, inputs: Sequence[CaptionInput], *, details: bool = False) -> list[dict[str, Any]]:
        """Inputs -> one :class:`~tellkit.data.batch.CaptionItem` each (CPU tensors, float32),
        holding the contexts of ``self.contexts`` (with faces, also ``face_boxes`` and
        ``face_probs``: None for precomputed embeddings). With ``details``, also what a caption
        result shows: ``pil`` (the decoded image), ``objects_source`` ("precomputed" | "none"),
        ``article_text``, ``article_tokens`` and ``article_offsets``. An unreadable image raises
        :class:`~tellkit.encoders.preprocess.ImageLoadError` (a TellkitError)."""
        inputs = list(inputs)
        items: list[dict[str, Any]] = [{} for _ in inputs]
        if not inputs:
            return items
        need_faces = "faces" in self.contexts and any(inp.faces is None for inp in inputs)
        need_objects = self.detects_objects and any(inp.objects is None for inp in inputs)
        pils = [self._image(inp) if ("image" in self.contexts or need_faces or need_objects or details) else None
                for inp in inputs]
        if "image" in self.contexts:
            for item, f in zip(items, self._image_features(pils, [self._resample(inp) for inp in inputs])):
                item["image"] = f
        if "faces" in self.contexts:
            for item, inp, pil in zip(items, inputs, pils):
                item.update(self._faces(inp, pil))
        if "objects" in self.contexts:
            for item, inp, pil in zip(items, inputs, pils):
                item.update(self._objects(inp, pil, details))
        if "article" in self.contexts:
            texts = [self.context_text(inp) for inp in inputs]
            for item, text, a in zip(items, texts, self._articles(texts)):
                item["article"], item["article_ids"] = a["hidden"], a["ids"]
                if details:
                    item["article_text"] = text
                    item["article_tokens"], item["article_offsets"] = list(a["tokens"]), list(a["offsets"])
        if details:
            for item, pil in zip(items, pils):
                item["pil"] = pil
        return items

    def _resample(self, inp: CaptionInput) -> str | None:
        """A data set's image under ``dataset_images: reference`` is resized with Lanczos (PIL's
        ANTIALIAS, the reference's preparation); others with the encoder's own filter."""
        return "lanczos" if inp.from_dataset and self.config.dataset_images == "reference" else None

    def _encode_images(self, pils, resamples) -> list[torch.Tensor]:
        """One batch through the image encoder (so BatchNorm in train mode sees the whole batch);
        images whose filters differ are only pre-processed differently."""
        enc = self.image_encoder
        if len(set(resamples)) <= 1:
            kw = {"resample": resamples[0]} if resamples and resamples[0] is not None else {}
            return list(enc.encode(pils, **kw)[0].float().cpu())
        device = next(enc.backbone.parameters()).device
        pixels = torch.stack([enc.transform_for(r)(p) for p, r in zip(pils, resamples)])
        with torch.no_grad():
            return list(enc(pixels.to(device))[0].float().cpu())

    def _image_features(self, pils, resamples=None) -> list[torch.Tensor]:
        """float[N, C] per image (remembered in ``memo`` when there is one)."""
        resamples = list(resamples) if resamples is not None else [None] * len(pils)
        if self.memo is None or self._stochastic(self.image_encoder):
            return self._encode_images(pils, resamples)

        c = self.config
        keys = [("image", c.image, c.image_weights, c.image_fit, r, p.size, p.mode,
                 hashlib.sha1(p.tobytes()).hexdigest()) for p, r in zip(pils, resamples)]
        todo = [i for i, k in enumerate(keys) if k not in self.memo]
        if todo:
            feats = self._encode_images([pils[i] for i in todo], [resamples[i] for i in todo])
            for i, f in zip(todo, feats):
                self.memo[keys[i]] = f.half()
        return [self.memo[k].float() for k in keys]

    def _articles(self, texts: list[str]) -> list[dict[str, Any]]:
        """Per text: hidden float[n_layers, L, D], ids long[L], tokens, offsets. An empty text is
        encoded too (its special tokens only)."""
        spec = None if self.config.article_is_packaged else self.config.article
        keys = [("article", spec, self.max_article_tokens, t) for t in texts]
        memo = None if self._stochastic(self.article_encoder) else self.memo
        todo = list(range(len(texts))) if memo is None else [i for i, k in enumerate(keys) if k not in memo]
        done: dict[int, dict[str, Any]] = {}
        if todo:
            enc = self.article_encoder
            sub = [texts[i] for i in todo]
            res = enc.encode(sub, max_tokens=self.max_article_tokens)
            ids = enc.caption_ids(sub, res["offsets"])
            for j, i in enumerate(todo):
                n = int(res["mask"][j].sum())
                done[i] = {"hidden": res["hidden"][j, :, :n].float().cpu(), "ids": ids[j, :n].long().cpu(),
                           "tokens": res["tokens"][j], "offsets": res["offsets"][j]}
                if memo is not None:
                    memo[keys[i]] = {**done[i], "hidden": done[i]["hidden"].half()}
        if memo is None:
            return [done[i] for i in range(len(texts))]
        return [{**memo[k], "hidden": memo[k]["hidden"].float()} for k in keys]

    def _image(self, inp: CaptionInput):
        if inp.image is not None:
            return inp.image
        if not inp.image_path:
            raise TellkitError(f"{inp.id}: no image")
        # the reference read its data sets' images as stored; a user's photo is turned upright
        as_stored = inp.from_dataset and self.config.dataset_images == "reference"
        return load_image(inp.image_path, exif=not as_stored)

    def _objects(self, inp: CaptionInput, pil, details: bool) -> dict[str, Any]:
        """objects float[O, object_dim]: the input's own vectors, else detected (with
        ``encoders.object_weights``), else none; with ``details`` also where they came from and,
        for detected ones, their boxes float[O, 4], scores and COCO class indices."""
        if inp.objects is not None or not self.detects_objects:
            given = inp.objects if inp.objects is not None else []
            out = {"objects": _as_set(given, self.object_dim, None, "objects")}
            if details:
                out["objects_source"] = "precomputed" if inp.objects is not None else "none"
            return out
        feats, det = self.object_encoder.encode(pil)
        if feats.shape[1] != self.object_dim:
            raise TellkitError(f"the objects encoder gives {feats.shape[1]}-d vectors; the model expects "
                               f"object_dim={self.object_dim}")
        out = {"objects": feats.float().cpu()}
        if details:
            out.update(objects_source="yolov3", object_boxes=det.boxes, object_scores=det.scores,
                       object_classes=det.classes)
        return out

    def _faces(self, inp: CaptionInput, pil) -> dict[str, Any]:
        """faces float[F, 512] with F <= max_faces, and the detector's boxes float[F, 4] and
        probabilities float[F] (None for precomputed embeddings: their boxes are not known)."""
        limit = self.config.max_faces
        if inp.faces is not None:  # e.g. NYTimes800k's FaceNet embeddings of its largest faces
            return {"faces": _as_set(inp.faces, FACE_DIM, limit, "faces"), "face_boxes": None, "face_probs": None}
        det = (self.face_encoder.detect_and_embed(pil, max_side=self.face_max_side) if self.face_max_side
               else self.face_encoder.detect_and_embed(pil))
        return {"faces": torch.as_tensor(det["embeddings"], dtype=torch.float32)[:limit].cpu(),
                "face_boxes": torch.as_tensor(det["boxes"], dtype=torch.float32).reshape(-1, 4)[:limit].cpu(),
                "face_probs": torch.as_tensor(det["probs"], dtype=torch.float32).reshape(-1)[:limit].cpu()}
