"""Multimodal summarization (How2 video + transcript -> summary) for VG-BART / VG-T5 and the
How2 seq2seq baseline.

Recipe sections read here (``configs/vg/*.yaml``), typed: an unknown key is an error::

    data: {root, train: [parts], val: [parts], test: [parts], max_source_tokens: 512,
           max_target_tokens: 128, max_frames: 256, pad_frames: true, source_prefix: "", dedupe: true}
    eval: {beam_size: 5, max_len: 64, min_len: 0, no_repeat_ngram_size: 3, length_penalty: 1.0,
           batch_size: null, metrics: [rouge, caption, content_f1]}

Typed as :class:`SummaryDataConfig` and :class:`SummaryEvalConfig` (whose decoding fields are
:class:`SummaryGeneration`). ``data.root`` has no default: it comes from the recipe,
``data.root=...`` on the command line or ``tellkit evaluate --data``. Parts are
``tellkit.data.how2`` names (``"mfn_sample:sum_train"``, ``"mcls_demo:val"``, or ``"sum_train"``
for the official layout directly under ``root``). The one input path, for evaluation and
``tellkit summarize`` alike, is :class:`SummaryProcessor` (the source built by
:func:`tellkit.data.how2.source_ids`, the batch by :func:`tellkit.data.how2.collate_how2`).
Training starts from the pre-trained backbone's weights; the model's ``boosted_parameters()`` (VG-GPLM: fusion linears,
attention, forget gate) get ``lr x model.new_layer_lr_scale``. Validation generates and selects /
early-stops on ROUGE-2 (the reference implementation).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tellkit.data.how2 import How2Dataset, collate_how2, load_features, read_parts, source_ids
from tellkit.errors import TellkitError
from tellkit.metrics.summarization import flatten_scores, score_summaries
from tellkit.models.vg_gplm import load_tokenizer
from tellkit.recipes import GenerationSettings, section
from tellkit.registry import build_config
from tellkit.tasks import register_task
from tellkit.tasks.processor import Processor, input_path, is_array
from tellkit.training.task import Task


@dataclass
class SummaryGeneration(GenerationSettings):
    """Decoding settings of the summarization family (VG-BART, VG-T5, seq2seq)."""

    beam_size: int = 5
    max_len: int = 64  # new tokens
    min_len: int = 0
    no_repeat_ngram_size: int = 3
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_len is None:
            raise TellkitError("generation: max_len must be a whole number, got None")
        self._check_search(min_len_low=0)
        if self.min_len > self.max_len:
            raise TellkitError(f"generation: min_len {self.min_len} is larger than max_len {self.max_len}")


@dataclass
class SummaryDataConfig:
    """A summarization recipe's ``data:`` section."""

    root: str | None = None  # the How2 folder; no default (recipe, data.root=..., or --data)
    train: tuple[str, ...] = ("sum_train",)
    val: tuple[str, ...] = ("sum_cv",)
    test: tuple[str, ...] = ("sum_devtest",)
    max_source_tokens: int = 512
    max_target_tokens: int = 128
    max_frames: int = 256
    pad_frames: bool = True  # pad every video to max_frames; else to the batch's longest (as the reference)
    source_prefix: str = ""  # text put before every transcript (e.g. T5's "summarize: ")
    source_special_tokens: bool = True  # the tokenizer's <s> / </s> around the transcript (reference: none)
    dedupe: bool = True  # skip a video id already read from an earlier part of the same split


@dataclass
class SummaryEvalConfig(SummaryGeneration):
    """A summarization recipe's ``eval:`` section."""

    batch_size: int | None = None
    metrics: tuple[str, ...] = ("rouge", "caption", "content_f1")


class SummaryProcessor(Processor):
    """Transcripts (+ video features) -> VG-BART / VG-T5 / seq2seq batches; generated ids ->
    ``{"text": summary, "frames": video frames read, "video_ignored": bool}``.

    An input is a transcript (text, or a ``.txt`` file whose ``<name>.npy`` beside it holds the
    video features), ``{"transcript": ..., "features": path or float array [T, video_dim]}``, or
    a ``(transcript, features)`` pair."""

    task = "summarize"
    generation_class = SummaryGeneration
    eval_class = SummaryEvalConfig

    def __init__(self, tokenizer: Any, data: SummaryDataConfig | None = None, *, video_dim: int = 2048,
                 uses_video: bool = True):
        self.tokenizer = tokenizer
        self.data = data or SummaryDataConfig()
        self.video_dim = int(video_dim)
        self.uses_video = bool(uses_video)

    @classmethod
    def from_checkpoint(cls, meta, path, *, device=None) -> SummaryProcessor:
        cfg = build_config({"name": meta["family"], **meta["config"]})[1]
        return cls(load_tokenizer(cfg.backbone, path), section(meta, "data", SummaryDataConfig, "stored recipe: data"),
                   video_dim=cfg.video_dim, uses_video=cfg.fusion != "none")

    def check(self, model, generation) -> None:
        """A backbone with a learned position table (BART) caps ``max_len``."""
        hf = getattr(getattr(model, "backbone", None), "config", None)
        n = getattr(hf, "max_position_embeddings", None)
        generation.check_positions(int(n) if isinstance(n, int) and n > 0 else None, f"the '{model.family}' model")

    # --- input ---------------------------------------------------------------------------------
    def prepare(self, item: Any) -> dict[str, Any]:
        transcript, features = self._split(item)
        transcript = " ".join(str(transcript).split())
        if not transcript:
            raise TellkitError("the transcript is empty")
        video = None
        if self.uses_video:
            if features is None:
                raise TellkitError("this model fuses video: give video features "
                                   f"(float32, shape (T, {self.video_dim}))")
            video = self._features(features)
        tok = self.tokenizer
        ids = source_ids(tok, transcript, max_source_tokens=self.data.max_source_tokens,
                         source_prefix=self.data.source_prefix, source_special_tokens=self.data.source_special_tokens)
        return {"id": "input", "input_ids": ids, "labels": [tok.pad_token_id], "video": video, "summary": "",
                "video_ignored": features is not None and not self.uses_video}

    def _split(self, item: Any) -> tuple[Any, Any]:
        if isinstance(item, Mapping):
            unknown = sorted(set(item) - {"transcript", "features"})
            if unknown or "transcript" not in item:
                raise TellkitError("summarize: an input mapping has 'transcript' and optionally 'features'"
                                   + (f" (unknown: {', '.join(map(str, unknown))})" if unknown else ""))
            return item["transcript"], item.get("features")
        if isinstance(item, tuple) and len(item) == 2:
            return item
        path = input_path(item)
        if path is not None and (isinstance(item, Path) or (path.suffix.lower() == ".txt" and path.is_file())):
            if not path.is_file():
                raise TellkitError(f"{path}: transcript file not found")
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise TellkitError(f"{path}: not UTF-8 text") from None
            beside = path.with_suffix(".npy")
            return text, (beside if self.uses_video and beside.is_file() else None)
        if isinstance(item, str):
            return item, None
        raise TellkitError(f"summarize: expected a transcript (text or .txt file) or a mapping, "
                           f"got {type(item).__name__}")

    def _features(self, features: Any):
        import numpy as np  # heavy

        dim, most = self.video_dim, self.data.max_frames
        if input_path(features) is not None:
            return load_features(features, most, dim)
        if not is_array(features) and not isinstance(features, (list, tuple)):
            raise TellkitError(f"video features: a .npy path or a float array (T, {dim}), "
                               f"got {type(features).__name__}")
        arr = np.asarray(features, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != dim:
            raise TellkitError(f"video features must have shape (T, {dim}) with T >= 1, got {arr.shape}")
        if not np.isfinite(arr).all():
            raise TellkitError("video features contain NaN or infinity")
        return np.ascontiguousarray(arr[:most])

    def collate(self, prepared, precision=None) -> dict[str, Any]:
        batch = collate_how2(prepared, self.tokenizer.pad_token_id, video_dim=self.video_dim,
                             frames=self.data.max_frames if self.data.pad_frames else None)
        batch["frames"] = [0 if s.get("video") is None else int(s["video"].shape[0]) for s in prepared]
        batch["video_ignored"] = [bool(s.get("video_ignored")) for s in prepared]
        return batch

    # --- output --------------------------------------------------------------------------------
    def texts(self, outputs: Mapping[str, Any]) -> list[str]:
        return [self.tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
                for t in outputs["tokens"]]

    def decode(self, outputs, batch, **options) -> list[dict[str, Any]]:
        return [{"text": text, "frames": n, "video_ignored": ignored}
                for text, n, ignored in zip(self.texts(outputs), batch["frames"], batch["video_ignored"])]


@register_task("summarize")
class SummarizationTask(Task):
    monitor = "rouge2"
    monitor_mode = "max"

    def __init__(self, recipe: Mapping[str, Any]):
        super().__init__(recipe)
        self.data = section(recipe, "data", SummaryDataConfig)
        self.eval = section(recipe, "eval", SummaryEvalConfig)
        self.generation = self.eval.generation
        self.model_config = build_config(recipe)[1]
        self._tokenizer = None
        self._processor: SummaryProcessor | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_config.backbone)
        return self._tokenizer

    @property
    def processor(self) -> SummaryProcessor:
        if self._processor is None:
            self._processor = SummaryProcessor(self.tokenizer, self.data, video_dim=self.model_config.video_dim,
                                               uses_video=self.uses_video)
        return self._processor

    @property
    def uses_video(self) -> bool:
        return self.model_config.fusion != "none"

    # --- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = super().build_model()
        model.load_backbone_weights()  # fine-tune the pre-trained BART / T5
        return model

    def param_groups(self, model: nn.Module, lr: float) -> list[dict[str, Any]]:
        if hasattr(model, "parameter_groups"):  # VG-GPLM: its own grouping (and the reference's)
            return model.parameter_groups(lr)
        boosted_fn = getattr(model, "boosted_parameters", None) or model.new_parameters
        boosted = {id(p) for p in boosted_fn()}
        old = [p for p in model.parameters() if p.requires_grad and id(p) not in boosted]
        added = [p for p in model.parameters() if p.requires_grad and id(p) in boosted]
        groups = [{"params": old, "lr": lr}]
        if added:
            groups.append({"params": added, "lr": lr * model.config.new_layer_lr_scale})
        return groups

    # --- data ----------------------------------------------------------------------------
    def build_dataset(self, split: str):
        parts = getattr(self.data, split, None)
        if parts is None:
            raise TellkitError(f"unknown split '{split}' (train, val or test)")
        if not parts:
            return None
        if not self.data.root:
            raise TellkitError(
                "data.root is not set: give the How2 folder in the recipe, as data.root=/path/to/how2, "
                "or with tellkit evaluate --data /path/to/how2"
            )
        examples = read_parts(self.data.root, parts, dedupe=self.data.dedupe, with_video=self.uses_video)
        return How2Dataset(
            examples,
            self.tokenizer,
            max_source_tokens=self.data.max_source_tokens,
            max_target_tokens=self.data.max_target_tokens,
            max_frames=self.data.max_frames,
            video_dim=self.model_config.video_dim,
            source_prefix=self.data.source_prefix,
            source_special_tokens=self.data.source_special_tokens,
            use_video=self.uses_video,
        )

    def collate(self, samples: list[Any]) -> dict[str, Any]:
        return collate_how2(
            samples,
            self.tokenizer.pad_token_id,
            video_dim=self.model_config.video_dim,
            frames=self.data.max_frames if self.data.pad_frames else None,
        )

    def sample_size(self, dataset, index: int) -> int:
        return len(dataset.examples[index].transcript.split())

    # --- evaluation ----------------------------------------------------------------------
    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.processor.generate(model, batch, self.generation, self.precision)
        texts = self.processor.texts(out)
        return [
            {"id": i, "prediction": p, "reference": r}
            for i, p, r in zip(batch["ids"], texts, batch["summaries"])
        ]

    def score(self, predictions: list[dict[str, Any]]) -> dict[str, float]:
        preds = {str(p["id"]): p["prediction"] for p in predictions}
        refs = {str(p["id"]): p["reference"] for p in predictions}
        return flatten_scores(score_summaries(preds, refs, self.eval.metrics))
