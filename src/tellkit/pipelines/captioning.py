"""Photo (+ article) -> caption with per-token attention: the pipeline behind ``tellkit caption``,
``tellkit demo``, the server's ``/api/caption`` and ``tellkit.pipeline("caption")``.

    cap = CaptioningPipeline.load()                          # the packaged default; or load("runs/tat")
    cap("photo.jpg")["text"]
    res = cap({"image": pil_image, "article": "article text"})
    res["tokens"][i]["attention"]["image"], res["faces"], res["article_tokens"]

Any captioning checkpoint works (Transform and Tell, Show and Tell, Show-Attend-and-Tell, the LSTM
captioner). Inputs go through the checkpoint's
:class:`~tellkit.tasks.captioning.CaptionProcessor`, the one ``tellkit evaluate`` uses: the
encoders its recipe names (``encoders:``), its article context (``data.context``,
``data.max_article_tokens``); decoding follows its ``eval:`` section (a
:class:`~tellkit.tasks.captioning.CaptionGeneration`). A result holds ``text``, ``score``,
``confidence`` and ``unsure`` (:mod:`tellkit.decoding.confidence`) and, unless the call says
``details=False``, what the processor documents (``tokens`` with attention, ``image_size``,
``grid``, ``faces``, ``article_text``, ``article_tokens``, ``objects``). Faces of
a photo longer than :data:`FACE_DETECT_MAX_SIDE` (1600 px) are searched on a shrunk copy, so the
detector's memory stays bounded; the boxes are given in the photo's own pixels and the crops are
cut from it (models without faces, such as the packaged default, are not affected).

Served (``/api/caption``), a result's text is ``caption``; an input costs copies of its (already
shrunk) photo and, for a model that reads faces, face detection's image pyramid
(:func:`caption_cost`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tellkit.pipelines.base import Cost, Pipeline
from tellkit.recipes import DEFAULT_ARTICLE_ENCODER
from tellkit.registry import create_model
from tellkit.tasks.captioning import NO_OBJECT_DETECTOR, CaptionGeneration, CaptionProcessor, article_input
from tellkit.utils.precision import resolve_device

__all__ = ["CAPTION_FAMILIES", "FACE_DETECT_MAX_SIDE", "NO_OBJECT_DETECTOR", "CaptioningPipeline", "article_input",
           "caption_cost"]

# the captioning families a checkpoint may hold (same batches and ``generate`` API)
CAPTION_FAMILIES = ("transform_and_tell", "show_tell", "show_attend_tell", "lstm_captioner")
# faces of a larger photo are detected on a copy this long (the server's upload side limit);
# the image encoder and the face crops still read the image as given
FACE_DETECT_MAX_SIDE = 1600

# encoders built once per process and shared by every pipeline that names the same ones
_SHARED: dict = {}

CAPTION_FIXED_BYTES = 8 << 20  # a caption's encoders and search besides its image copies
CAPTION_BYTES_PER_PIXEL = 6     # measured: 66 MiB for a batch of four 1600 x 1600 photos (packaged captioner)
FACE_BYTES_PER_PIXEL = 24       # MTCNN's image pyramid in float32, for models that read faces


def caption_cost(image: Any, faces: bool = False) -> Cost:
    """Bytes and work of one caption: copies of the image, face detection's pyramid when the
    model reads faces, plus the models' share."""
    w, h = getattr(image, "size", (FACE_DETECT_MAX_SIDE, FACE_DETECT_MAX_SIDE))
    per_pixel = CAPTION_BYTES_PER_PIXEL + (FACE_BYTES_PER_PIXEL if faces else 0)
    return Cost(int(per_pixel * w * h + CAPTION_FIXED_BYTES), 1.0 + w * h / 1e6)


class CaptioningPipeline(Pipeline):
    """A captioning model, its processor (encoders, article context, tokenizer) and its
    generation settings; see the module docstring."""

    task = "caption"
    families = CAPTION_FAMILIES
    processor_class = CaptionProcessor
    api_text = "caption"
    # ``encoders={"article": DIR, "face_weights": FILE}``: keys of the checkpoint's encoders
    # section replaced (local copies of weights a converted or paper-size model names)
    processor_options = ("encoders",)

    def __init__(self, model, processor: CaptionProcessor, generation: CaptionGeneration | None = None, **kw: Any):
        processor.check(model, generation)
        super().__init__(model, processor, generation or CaptionGeneration(), **kw)
        bundle = processor.bundle
        self.contexts = processor.contexts
        self.info.update({"contexts": list(self.contexts), "image_encoder": getattr(bundle.image_encoder, "name", None),
                          "article_encoder": getattr(bundle.article_encoder, "name", None)
                          if "article" in self.contexts else None})
        if "objects" in self.contexts:
            self.info["objects"] = NO_OBJECT_DETECTOR

    @classmethod
    def load(cls, model=None, device=None, dtype=None, **options: Any) -> CaptioningPipeline:
        return super().load(model, device, dtype, **options)  # type: ignore[return-value]

    @classmethod
    def build_processor(cls, meta, path, device, encoders: Mapping[str, Any] | None = None,
                        **options: Any) -> CaptionProcessor:
        """Inference bundles share their built encoders and bound face detection; ``encoders``
        replaces keys of the checkpoint's encoders section."""
        if encoders:
            meta = {**meta, "encoders": {**(meta.get("encoders") or {}), **encoders}}
        processor = CaptionProcessor.from_checkpoint(meta, path, device=device, shared_encoders=_SHARED,
                                                     face_max_side=FACE_DETECT_MAX_SIDE, **options)
        processor.bundle.check_reachable()  # a missing encoder is named before the model loads
        return processor

    @property
    def reads_articles(self) -> bool:
        return self.processor.reads_articles

    def cost(self, item, prepared=None) -> Cost:
        """An ``(image, article)`` item, or an image: :func:`caption_cost`."""
        return caption_cost(item[0] if isinstance(item, tuple) else item, faces="faces" in self.contexts)

    @classmethod
    def untrained(cls, seed: int = 0, device: str | None = None) -> CaptioningPipeline:
        """A tiny randomly initialised Transform and Tell over the real offline encoders: the
        page and the API work end to end, but the captions are noise (``info.trained`` is false)."""
        import torch  # heavy

        device = resolve_device(device)  # None: the GPU when there is one, else the CPU
        contexts = ("image", "article", "faces")
        torch.manual_seed(seed)
        model = create_model("tat/tiny", image_dim=1280, article_dim=384, article_layers=7, face_dim=512,
                             contexts=list(contexts), max_len=12).eval().to(device)
        recipe = {"encoders": {"article": DEFAULT_ARTICLE_ENCODER}}
        bundle = CaptionProcessor.recipe_bundle(recipe, contexts, device=device, shared_encoders=_SHARED,
                                                face_max_side=FACE_DETECT_MAX_SIDE)
        return cls(model, CaptionProcessor(bundle), device=device,
                   info={"family": "transform_and_tell", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): captions are noise"})

    def generate_options(self, details: bool = True, **options: Any) -> dict[str, Any]:
        return {"return_attention": bool(details)}

    def postprocess(self, outputs, batch, **options: Any) -> list[dict]:
        """Results with ``confidence`` and ``unsure`` (:mod:`tellkit.decoding.confidence`); a
        caption that reached the length limit is unsure."""
        return self.processor.decode(outputs, batch, max_len=self.generation.max_len, **options)
