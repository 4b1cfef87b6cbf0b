"""Captioning: binds Transform and Tell (Tran et al. 2020) and its baselines to caption data,
the frozen encoders and caption metrics, for the generic trainer and ``tellkit evaluate``.
:class:`CaptionProcessor` is the task's one input path (photo and article in, batch out; generated
ids out as captions), for evaluation and for every inference pipeline
(:mod:`tellkit.pipelines.captioning`: ``tellkit caption``, the server, ``tellkit.pipeline``).

Recipe sections read here, each a dataclass that refuses unknown keys (see ``configs/tat/*.yaml``):

    encoders: EncodersConfig       (tellkit.encoders.bundle: image, article, faces, weights, ...)
    data:     CaptionDataConfig    {format: goodnews | nytimes800k | coco | flickr8k, root: PATH,
               context: location_aware | first_tokens | other_captions | none,
               context_policy: reference | cut, max_article_tokens: 512, max_caption_tokens: 510,
               features: DIR (cache; optional), limit, options, files}
    eval:     CaptionEvalConfig    {beam_size: 1, max_len: 100, ... (CaptionGeneration),
               metrics: [bleu, meteor, rouge, cider], ner: true, ner_model: auto, monitor: loss, batch_size}

Entity metrics name the spaCy pipeline that ran in ``task.eval_info`` (``tellkit evaluate`` writes
it into ``metrics_<split>.json`` beside the numbers); rare proper nouns are judged against the
PROPN tokens of the training captions (:func:`tellkit.metrics.ner.train_proper_nouns`).

The data location comes from the recipe (``data.root``) or ``--data``; there is no default.
Encoders are frozen and every input goes through one :class:`~tellkit.encoders.bundle.EncoderBundle`.
Without ``data.features`` every sample is encoded when it is loaded (slow; fine for small
sets); with it, each split's image grids, faces and article states are extracted once per image
into ``DIR/<split>-<context>/`` by ``tellkit.encoders.features`` (the ``tellkit features``
format, resumable) and read from there. Precomputed face embeddings and object vectors that a
data set ships (NYTimes800k: ``sample.extra["faces"]``, ``sample.extra["objects"]``) are used
instead of the detectors; a recorded empty face set stays empty (masked), and faces are detected
only for images with no record (GoodNews' release, a user's own photo).

Evaluation unit: news captions are scored one reference per image; for caption sets with several
captions per image and no context (COCO, Flickr8k), one caption is generated per image and scored
against all its references; with ``context: other_captions`` each caption is generated from the
other captions and scored against its own caption only (the others are its input).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from tellkit.checkpoint import IMAGE_ENCODER_FILE, carried_encoder_files, read_checkpoint_config
from tellkit.data import load_captions
from tellkit.data.batch import CaptionBatch, CaptionItem, collate_captions
from tellkit.data.bucketing import bucket_batches
from tellkit.data.sample import CaptionSample
from tellkit.decoding import confidence as confidences
from tellkit.encoders.bundle import CaptionInput, EncoderBundle, EncodersConfig
from tellkit.encoders.features import FeatureConfig, FeatureStore, extract_features
from tellkit.encoders.preprocess import load_image
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.encoders.weights import load_strict, read_weights_file
from tellkit.errors import TellkitError
from tellkit.metrics.caption import METRICS, score_captions_detailed
from tellkit.metrics.linguistic import linguistic_scores
from tellkit.metrics.ner import DEFAULT_MODEL, entity_scores, resolve_model, train_proper_nouns
from tellkit.recipes import (
    CAPTION_FORMATS,
    CONTEXT_MODES,
    CONTEXT_POLICIES,
    OBJECT_DIM,
    GenerationSettings,
    SelfCriticalConfig,
    check_limits,
    section,
)
from tellkit.registry import build_config, get_entry
from tellkit.tasks import register_task
from tellkit.tasks.processor import Processor, as_pil, finite_or_none, input_path, is_array, is_pil
from tellkit.training.evaluation import to_device
from tellkit.training.self_critical import SelfCritical
from tellkit.training.task import Task
from tellkit.utils.files import atomic_write_bytes

# the numbers each caption metric of ``eval.metrics`` gives
METRIC_NAMES = {"bleu": ("bleu1", "bleu2", "bleu3", "bleu4"), "meteor": ("meteor",), "rouge": ("rouge_l",),
                "cider": ("cider",)}
NO_OBJECT_DETECTOR = "no object detector ships offline: the objects context of a new image is empty"


# --- recipe sections --------------------------------------------------------------------------
@dataclass
class CaptionGeneration(GenerationSettings):
    """How a captioner decodes (the ``generate`` keyword arguments of every captioning family)."""

    max_len: int | None = None  # most generated tokens, EOS included; None: the model's own default
    beam_size: int = 1  # 1 = greedy (the Transform and Tell reference decodes greedily)
    length_penalty: float = 1.0  # a finished beam scores sum(log p) / length ** length_penalty
    min_len: int = 1  # EOS is forbidden before this many tokens
    no_repeat_ngram_size: int = 0  # >0: never repeat an n-gram of this size

    def __post_init__(self) -> None:
        self._check_search(min_len_low=1)


@dataclass
class CaptionDataConfig:
    """A captioning recipe's ``data:`` section."""

    format: str | None = None  # goodnews | nytimes800k | coco | flickr8k
    root: str | None = None  # folder / archive / mongodb:// URI / JSON file; or --data
    context: str = "location_aware"  # which article text the model reads (tellkit.encoders.context)
    context_policy: str = "reference"  # reference (the paper's code) | cut (cut to the budget, one block per line)
    max_article_tokens: int = 512  # the article encoder's budget, special tokens included
    # caption BPE tokens kept for training / the teacher-forced loss, between <s> and </s> (the
    # reference's caption indexer keeps 510); the decoder's sinusoidal positions have no fixed size
    max_caption_tokens: int = 510
    features: str | None = None  # feature-cache folder (optional)
    limit: dict[str, int] | None = None  # e.g. {val: 250, test: 500}: the first N samples of a split
    options: dict[str, Any] = field(default_factory=dict)  # keyword options of the data loader
    files: dict[str, str] | None = None  # COCO: one annotation file per split (instead of root)

    def __post_init__(self) -> None:
        if self.format is not None and self.format not in CAPTION_FORMATS:
            raise TellkitError(f"data.format must be one of {', '.join(CAPTION_FORMATS)}, got {self.format!r}")
        if self.context not in CONTEXT_MODES:
            raise TellkitError(f"data.context must be one of {', '.join(CONTEXT_MODES)}, got {self.context!r}")
        if self.context_policy not in CONTEXT_POLICIES:
            raise TellkitError(f"data.context_policy must be one of {', '.join(CONTEXT_POLICIES)}, "
                               f"got {self.context_policy!r}")
        if int(self.max_article_tokens) < 3:
            raise TellkitError(f"data.max_article_tokens must be at least 3, got {self.max_article_tokens}")
        if isinstance(self.max_caption_tokens, bool) or int(self.max_caption_tokens) < 1:
            raise TellkitError(f"data.max_caption_tokens must be at least 1, got {self.max_caption_tokens}")
        for name in ("files", "options"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Mapping):
                raise TellkitError(f"data.{name} must be a mapping, got {v!r}")
        self.limit = check_limits(self.limit) or None
        self.options = dict(self.options or {})


@dataclass
class CaptionEvalConfig(CaptionGeneration):
    """A captioning recipe's ``eval:`` section: the generation settings and how predictions are scored."""

    metrics: list[str] | None = None  # None: every caption metric (bleu, meteor, rouge, cider)
    ner: bool = True  # named-entity precision / recall (spaCy)
    ner_model: str | None = None  # None: tellkit.metrics.ner.DEFAULT_MODEL
    rare_proper_nouns: bool = True  # also score proper nouns unseen in training captions
    # compare lower-cased text (the Flickr8k / COCO papers' convention); False: case kept, as the
    # Transform and Tell reference scored news captions, where case marks names
    lowercase: bool = False
    monitor: str = "loss"  # the validation metric that selects the best checkpoint
    batch_size: int | None = None  # None: train.batch_size


def model_contexts(model_cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The contexts a captioner reads: its recipe section's ``contexts``, else its family's
    default (Show and Tell: image only; Transform and Tell: image, article, faces)."""
    if "contexts" in model_cfg:
        return tuple(model_cfg["contexts"])
    if model_cfg.get("name"):
        fld = {f.name: f for f in dataclasses.fields(get_entry(model_cfg["name"]).config_cls)}.get("contexts")
        if fld is not None and fld.default is not dataclasses.MISSING:
            return tuple(fld.default)
    return ("image", "article", "faces")


# --- samples -> encoder inputs ---------------------------------------------------------------------
def sample_input(s: CaptionSample, context_mode: str = "location_aware") -> CaptionInput:
    """A data sample as the bundle's input (one per image: the id is the image's), with the
    precomputed face / object sets it ships, and its article shaped for ``context_mode``."""
    where = s.image_position if context_mode == "location_aware" else None
    none = context_mode == "none"
    # a recorded face set, even an empty one, is what the data set found; None (no record): detect
    return CaptionInput(s.image_id or s.id, s.image_path, "" if none else s.title, [] if none else list(s.paragraphs),
                        where, faces=s.extra.get("faces"), objects=s.extra.get("objects"), from_dataset=True)


def dataset_inputs(fmt: str, root: str, split: str | None = None, limit: int | None = None,
                   image_root: str | None = None, objects: bool = False,
                   dropped: list[dict] | None = None) -> list[CaptionInput]:
    """One input per distinct image of a captioning data set (``tellkit features --format``),
    with its article context (title, paragraphs, image position) and precomputed sets.
    ``image_root``: the images' folder (NYTimes800k default: ``images_processed`` beside the archive);
    ``objects``: also read the object vectors the data set ships (NYTimes800k); ``dropped``
    receives the photos the loader leaves out, with the reason (GoodNews: empty captions)."""
    options: dict = {"dropped": dropped} if dropped is not None and fmt == "goodnews" else {}
    if objects:
        if fmt != "nytimes800k":
            raise TellkitError(f"the {fmt} data ships no object vectors (--objects is for nytimes800k)")
        options["objects"] = True
    if fmt == "nytimes800k":
        beside = Path(root).parent / "images_processed"
        options["image_root"] = image_root or (beside if beside.is_dir() else None)
    elif image_root is not None:
        key = {"goodnews": "images_dir", "coco": "image_root"}.get(fmt)
        if key is None:
            raise TellkitError(f"--image-root is not used by the {fmt} loader")
        options[key] = str(Path(image_root).resolve())
    seen: dict[str, CaptionInput] = {}
    for s in load_captions(fmt, root, split, **options):
        key = s.image_id or s.id
        if key not in seen and s.image_path:
            seen[key] = sample_input(s)
        if limit is not None and len(seen) >= limit:
            break
    if not seen:
        raise TellkitError(f"{root}: no images in the {fmt} data" + (f" ({split} split)" if split else "")
                           + ("" if options.get("image_root", True) else "; pass --image-root"))
    return list(seen.values())


# --- the processor: photo (+ article) -> batch; generated ids -> captions ------------------------
def article_input(text: str, image=None, image_path: str | None = None, id: str = "input") -> CaptionInput:
    """A pasted article as the bundle's input: paragraphs are the blocks between blank lines (or
    the lines, when there are none); no title, no image position, so the model reads the
    article from its start up to the encoder's token budget."""
    text = (text or "").strip()
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    if len(blocks) <= 1:
        blocks = [b for b in text.splitlines() if b.strip()]
    return CaptionInput(id, image_path=image_path, paragraphs=blocks, image=image)


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


# --- cached features: `tellkit features` shards (tellkit.encoders.features), one per split ----
def feature_config(task: CaptioningTask) -> FeatureConfig:
    return FeatureConfig(encoders=task.encoders, faces="faces" in task.contexts, article="article" in task.contexts,
                         objects="objects" in task.contexts, max_article_tokens=task.data.max_article_tokens,
                         context_policy=task.data.context_policy)


def cached_features(task: CaptioningTask, samples: list[CaptionSample], split: str, progress: bool = True):
    """The split's features under ``data.features/<split>``, extracted first when missing
    (resumable; a folder made with another configuration is refused)."""
    mode = task.data.context
    if mode == "other_captions" and "article" in task.contexts:
        raise TellkitError("data.features stores one article per image; 'other_captions' contexts differ per caption "
                           "(use context: none, or no feature cache)")
    # the article context is not part of the extractor's configuration: keep one folder per mode
    directory = Path(task.data.features) / (f"{split}-{mode}" if "article" in task.contexts else split)
    items: dict[str, CaptionInput] = {}
    for s in samples:
        items.setdefault(s.image_id or s.id, sample_input(s, mode))
    ddp = dist.is_available() and dist.is_initialized()
    if not ddp or dist.get_rank() == 0:  # reuses finished shards; refuses another configuration
        model_config = build_config({"name": task.model_cfg.get("name"), **task.model_cfg})[1]
        # the encoders must give what the model reads: checked before the first shard is encoded
        extract_features(list(items.values()), directory, feature_config(task), progress=progress,
                         check=lambda bundle: bundle.check_model(model_config))
    if ddp:
        dist.barrier()
    return FeatureStore(directory)


# --- dataset and batches ----------------------------------------------------------------------
class CaptionDataset(Dataset):
    """Items (:class:`~tellkit.data.batch.CaptionItem`): id, caption ids, references, and the
    context tensors the model uses."""

    def __init__(self, samples: list[CaptionSample], task: CaptioningTask, split: str, per_image: bool):
        self.task, self.split = task, split
        refs: dict[str, list[str]] = {}
        for s in samples:
            refs.setdefault(s.image_id or s.id, []).append(s.caption)
        if per_image:  # one item per image, scored against all its captions
            seen: dict[str, CaptionSample] = {}
            for s in samples:
                seen.setdefault(s.image_id or s.id, s)
            self.samples = list(seen.values())
            self.refs = [refs[s.image_id or s.id] for s in self.samples]
        else:
            self.samples = samples
            self.refs = [[s.caption] for s in samples]
        tok = task.tokenizer
        keep = int(task.data.max_caption_tokens)  # not the generation length: training sees long captions whole
        self.caption_ids = [[tok.bos_id, *tok.encode(s.caption)[:keep], tok.eos_id] for s in self.samples]
        self.store = cached_features(task, samples, split, progress=task.progress) if task.data.features else None
        if self.store is not None:  # images the extractor could not read are left out (it reports them)
            keep = [i for i, s in enumerate(self.samples) if (s.image_id or s.id) in self.store]
            self.samples = [self.samples[i] for i in keep]
            self.refs = [self.refs[i] for i in keep]
            self.caption_ids = [self.caption_ids[i] for i in keep]
        self._lengths: list[int] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        """Caption + article tokens of each item (the cost used for length buckets)."""
        if self._lengths is None:
            self._lengths = [len(c) + (self._article_length(i) if "article" in self.task.contexts else 0)
                             for i, c in enumerate(self.caption_ids)]
        return self._lengths

    def _article_length(self, i: int) -> int:
        if not self.task.encodes_in_step:
            return self[i]["article"].shape[1]
        bundle = self.task.bundle  # features come later, in the step: count the context's tokens
        enc = bundle.article_encoder
        text = bundle.context_text(sample_input(self.samples[i], self.task.data.context))
        return min(enc.count_tokens(text) + enc.num_special, bundle.max_article_tokens, enc.max_tokens)

    def __getitem__(self, i: int) -> CaptionItem:
        s = self.samples[i]
        item: dict[str, Any] = {"id": s.id, "image_id": s.image_id, "references": self.refs[i],
                                "caption": torch.tensor(self.caption_ids[i], dtype=torch.long)}
        if self.task.encodes_in_step:  # encoders.mode: reference: the step encodes the whole batch
            item["input"] = sample_input(s, self.task.data.context)
            return item  # type: ignore[return-value]
        feats = self.task.encode_sample(s) if self.store is None else self.store[s.image_id or s.id]
        for name in ("image", "faces", "objects", "article", "article_ids"):
            if name.split("_")[0] in self.task.contexts:
                item[name] = feats[name]
        return item  # type: ignore[return-value]


# --- the task ---------------------------------------------------------------------------------
@register_task("caption")
class CaptioningTask(Task):
    """``bundle``: the encoders to use (e.g. one shared by several runs, see ``tellkit table``);
    default: the recipe's ``encoders:`` built on first use."""

    task_sections = ("scst",)
    caches_features = True

    @classmethod
    def shared_options(cls, recipe: Mapping[str, Any], memo: dict) -> dict[str, Any]:
        """A bundle that shares the built encoders and remembers image / article encodings
        across the runs of one process, in ``memo``."""
        contexts = model_contexts(section(recipe, "model"))
        return {"bundle": CaptionProcessor.recipe_bundle(recipe, contexts, shared_encoders=memo, memo=memo)}

    def __init__(self, recipe: Mapping[str, Any], bundle: EncoderBundle | None = None):
        super().__init__(recipe)
        self.model_cfg = section(self.recipe, "model")
        self.data = section(self.recipe, "data", CaptionDataConfig)
        self.eval = section(self.recipe, "eval", CaptionEvalConfig)
        self.encoders = section(self.recipe, "encoders", EncodersConfig)
        # self-critical training (an ``scst:`` section), set up with the training data
        self.scst = section(self.recipe, "scst", SelfCriticalConfig) if self.recipe.get("scst") is not None else None
        self.self_critical: SelfCritical | None = None
        self.contexts = model_contexts(self.model_cfg)
        if self.encoders.mode == "reference" and self.data.features:
            raise TellkitError("data.features cannot be used with encoders.mode: reference (its features depend on "
                               "each batch); remove data.features or set encoders.mode: frozen")
        self.monitor = self.eval.monitor
        self.monitor_mode = "min" if self.monitor == "loss" else "max"
        self.generation = self.eval.generation
        self._bundle = bundle
        self._processor: CaptionProcessor | None = None
        # what the scores were computed with, beside the numbers (``metrics_<split>.json``)
        self.eval_info: dict[str, Any] = {}

    def check_training(self) -> None:
        # a monitor among the caption metrics must be one that validation computes: refused before
        # the run starts, not after its first epoch
        ev = self.eval
        family = next((f for f, names in METRIC_NAMES.items() if ev.monitor in names), None)
        if family is not None and ev.metrics is not None and family not in ev.metrics:
            raise TellkitError(f"eval.monitor '{ev.monitor}' is computed by the '{family}' metric, "
                               f"which eval.metrics ({', '.join(map(str, ev.metrics)) or 'none'}) leaves out")

    @functools.cached_property
    def tokenizer(self) -> CaptionTokenizer:
        return CaptionTokenizer.load(self.encoders.caption_tokenizer)

    @property
    def processor(self) -> CaptionProcessor:
        """The task's input path: the recipe's encoders (or the ``bundle`` given), built on first use."""
        if self._processor is None:
            bundle = self._bundle or CaptionProcessor.recipe_bundle(self.recipe, self.contexts)
            self._processor = CaptionProcessor(bundle, self.tokenizer, self.contexts)
        return self._processor

    @property
    def bundle(self) -> EncoderBundle:
        return self.processor.bundle

    # -- data ------------------------------------------------------------------------------
    def load_samples(self, split: str) -> list[CaptionSample]:
        d = self.data
        if d.format is None:
            raise TellkitError("the recipe's data section has no 'format' (goodnews, nytimes800k, coco or flickr8k)")
        options = dict(d.options)
        if "objects" in self.contexts and d.format == "nytimes800k":  # the object vectors it ships
            options.setdefault("objects", True)
        if d.format in ("coco", "flickr8k"):
            options.setdefault("context", d.context if d.context in ("none", "other_captions") else "none")
        if d.format == "coco" and d.files:  # one official file per split
            if split not in d.files:
                raise TellkitError(f"data.files has no '{split}' file")
            return load_captions(d.format, d.files[split], split, **options)
        if not d.root:
            raise TellkitError("the recipe's data section has no 'root' (the data location: data.root=PATH "
                               "after the recipe of `tellkit train`, --data PATH for `tellkit evaluate` / `table`)")
        return load_captions(d.format, d.root, split, **options)

    def build_dataset(self, split: str) -> Dataset:
        samples = self.load_samples(split)
        limit = (self.data.limit or {}).get(split)
        if limit:
            samples = samples[: int(limit)]
        several_refs = self.data.format in ("coco", "flickr8k") and self.data.context == "none"
        # self-critical training draws captions per image and scores them against all its references
        per_image = several_refs and (split != "train" or self.scst is not None)
        dataset = CaptionDataset(samples, self, split, per_image)
        if split == "train" and self.scst is not None:
            self.setup_self_critical(dataset.refs)
        return dataset

    def setup_self_critical(self, train_references: list[list[str]]) -> None:
        """The reward of self-critical training: CIDEr-D with the document frequencies of the
        training references (one list per image)."""
        seed = int(section(self.recipe, "train").get("seed", 1))
        self.self_critical = SelfCritical.for_references(self.scst, train_references, self.tokenizer, seed=seed,
                                                         max_caption_tokens=int(self.data.max_caption_tokens))

    def encode_sample(self, s: CaptionSample) -> CaptionItem:
        """Context tensors of one sample with the frozen encoders (no cache)."""
        return self.processor.encode([sample_input(s, self.data.context)],  # type: ignore[return-value]
                                     precision=self.precision)[0]

    def check_inputs(self) -> None:
        """Before an evaluation loads its model: every encoder it will run can be built (one
        whose weights cannot be reached is named in one line, with how to pass a local copy).
        Nothing is checked when a feature cache stands in for the encoders."""
        if self.encodes_in_step or not self.data.features:
            self.bundle.check_reachable()

    @property
    def encodes_in_step(self) -> bool:
        """``encoders.mode: reference``: the encoders run on each batch in the training (or
        evaluation) step, in the model's mode, instead of once per item in the dataset."""
        return self.encoders.mode == "reference"

    # -- the image encoder's state in reference mode --------------------------------------
    @property
    def _trains_image_encoder_state(self) -> bool:
        """In reference mode the image encoder's BatchNorm running statistics move with every
        training batch, as the reference's ``model.train()`` moved its ResNet's: part of the
        trained state, so every checkpoint keeps them (the reference's ``best.th`` holds them)."""
        return self.encodes_in_step and "image" in self.contexts

    def checkpoint_files(self) -> dict[str, dict[str, torch.Tensor]]:
        if not self._trains_image_encoder_state:
            return {}
        return {IMAGE_ENCODER_FILE: self.bundle.image_encoder.backbone.state_dict()}

    def checkpoint_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        if not self._trains_image_encoder_state:
            return meta
        return {**meta, "encoders": {**(meta.get("encoders") or {}), "image_weights": IMAGE_ENCODER_FILE}}

    def restore_checkpoint_files(self, directory: Path) -> bool:
        if not self._trains_image_encoder_state:
            return False
        path = carried_encoder_files(read_checkpoint_config(directory), directory).get("image_weights")
        if path is None:
            return False
        what = f"image encoder {self.encoders.image} ({path.name})"
        load_strict(self.bundle.image_encoder.backbone, read_weights_file(path, what), what, source=str(path))
        return True

    def collate(self, samples: list[CaptionItem]) -> CaptionBatch:
        if self.encodes_in_step:  # the items, encoded by on_device
            return {"items": list(samples)}  # type: ignore[return-value]
        return self.processor.collate_items(samples)

    def on_device(self, batch, model):
        """With ``encoders.mode: reference``: the batch's images and articles through the
        encoders, on the model's device, in train mode when the model is training (BatchNorm
        batch statistics and running-stat updates, article dropout; no gradients), as the
        reference's ``model.train()`` ran them."""
        if not (isinstance(batch, Mapping) and "items" in batch):
            return batch
        device = next(model.parameters()).device
        bundle = self.bundle
        bundle.to(device)
        bundle.train(model.training)
        feats = bundle.encode([it["input"] for it in batch["items"]])
        names = [n for n in ("image", "faces", "objects", "article", "article_ids") if n.split("_")[0] in self.contexts]
        items = [{**{k: v for k, v in it.items() if k != "input"}, **{n: f[n] for n in names}}
                 for it, f in zip(batch["items"], feats)]
        return to_device(collate_captions(items, self.contexts, self.tokenizer.pad_id), device)

    def training_batch(self, batch, model):
        """With an ``scst:`` section: the captions the model draws for the batch's images,
        weighted by their reward advantage (:mod:`tellkit.training.self_critical`)."""
        if self.scst is None:
            return batch
        if self.self_critical is None:
            raise TellkitError("self-critical training is set up with the training data (build_dataset('train'))")
        return self.self_critical.batch(model, batch)

    def training_stats(self):
        return self.self_critical.take_stats() if self.self_critical is not None else {}

    def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
        max_tokens = section(self.recipe, "train").get("max_tokens")
        if not max_tokens:
            return None
        bs = int(section(self.recipe, "train").get("batch_size", 16))
        return bucket_batches(dataset.lengths(), bs, int(max_tokens), shuffle=shuffle, seed=seed, epoch=epoch)

    # -- evaluation ---------------------------------------------------------------------------
    def predict(self, model, batch):
        out = self.processor.generate(model, batch, self.generation, self.precision)
        # the search's score and length go with each prediction (what `tellkit calibrate` fits on)
        return [{"id": i, "image_id": iid, "prediction": text, "references": refs, "score": finite_or_none(sc),
                 "length": len(toks)}
                for i, iid, text, refs, sc, toks in zip(batch["ids"], batch["image_ids"], self.processor.texts(out),
                                                        batch["references"], out["scores"], out["tokens"])]

    @functools.cached_property
    def ner_model(self) -> str:
        """The spaCy pipeline the entity metrics use (``eval.ner_model``; ``auto``: the best installed)."""
        return resolve_model(self.eval.ner_model or DEFAULT_MODEL)

    @functools.cached_property
    def train_words(self) -> set[str]:
        """The proper nouns (spaCy PROPN tokens, :func:`tellkit.metrics.ner.train_proper_nouns`)
        of the training captions: a proper noun outside them is rare. Kept beside the feature
        cache, if any, one file per spaCy pipeline, so evaluation does not re-read and re-tag
        the training data."""
        name = self.ner_model
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        cache = Path(self.data.features) / f"train_caption_propn-{safe}.txt" if self.data.features else None
        if cache is not None and cache.is_file():
            return set(cache.read_text(encoding="utf-8").split("\n")) - {""}
        words = train_proper_nouns((s.caption for s in self.load_samples("train")), model=name)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache, "\n".join(sorted(words)).encode("utf-8"))
        return words

    def score(self, predictions):
        preds = {p["id"]: p["prediction"] for p in predictions}
        refs = {p["id"]: p["references"] for p in predictions}
        metrics, per = score_captions_detailed(preds, refs, self.eval.metrics or METRICS, lowercase=self.eval.lowercase)
        for p in predictions:  # per-example scores go into predictions_<split>.jsonl
            p["scores"] = per[p["id"]]
        metrics.update(linguistic_scores(preds.values()))
        if self.eval.ner:
            words = self.train_words if self.eval.rare_proper_nouns else None
            metrics.update(entity_scores(preds, {k: v[0] for k, v in refs.items()}, train_words=words,
                                         model=self.ner_model))
            self.eval_info["ner_model"] = self.ner_model
        return metrics
