"""Multimodal summarization (How2 video + transcript -> summary) for VG-BART / VG-T5.

Recipe sections read here (``configs/vg/*.yaml``)::

    data: {root, train: [parts], val: [parts], test: [parts], max_source_tokens: 512,
           max_target_tokens: 128, max_frames: 256, pad_frames: true, source_prefix: "", dedupe: true}
    eval: {beam_size: 5, max_len: 64, min_len: 0, no_repeat_ngram_size: 3, length_penalty: 1.0,
           batch_size: null, metrics: [rouge, caption, content_f1]}

Parts are ``tellkit.data.how2`` names (``"mfn_sample:sum_train"``, ``"mcls_demo:val"``, or
``"sum_train"`` for the official layout directly under ``root``). Training starts from the
pre-trained backbone's weights; the new layers (fusion, VTF) get ``lr x
model.new_layer_lr_scale``. Validation generates and selects / early-stops on ROUGE-2 (the
reference implementation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from tellkit.config import from_dict
from tellkit.errors import TellkitError
from tellkit.tasks import register_task
from tellkit.tasks.base import Task


@dataclass
class How2DataConfig:
    root: str = "../shared/data/how2"
    train: tuple[str, ...] = ("sum_train",)
    val: tuple[str, ...] = ("sum_cv",)
    test: tuple[str, ...] = ("sum_devtest",)
    max_source_tokens: int = 512
    max_target_tokens: int = 128
    max_frames: int = 256
    pad_frames: bool = True  # pad every video to max_frames (as the reference); else to the batch's longest
    source_prefix: str = ""  # e.g. "summarize: " for T5
    dedupe: bool = True  # skip a video id already read from an earlier part of the same split


@dataclass
class SummaryEvalConfig:
    beam_size: int = 5
    max_len: int = 64
    min_len: int = 0
    no_repeat_ngram_size: int = 3
    length_penalty: float = 1.0
    batch_size: int | None = None
    metrics: tuple[str, ...] = ("rouge", "caption", "content_f1")


def _section(recipe: Mapping[str, Any], name: str) -> dict[str, Any]:
    sec = recipe.get(name) or {}
    if not isinstance(sec, Mapping):
        raise TellkitError(f"the recipe's '{name}' section must be a mapping")
    return dict(sec)


@register_task("summarization")
class SummarizationTask(Task):
    monitor = "rouge2"
    monitor_mode = "max"

    def __init__(self, recipe: Mapping[str, Any]):
        super().__init__(recipe)
        self.data = from_dict(How2DataConfig, _section(recipe, "data"), "data")
        self.eval = from_dict(SummaryEvalConfig, _section(recipe, "eval"), "eval")
        from tellkit.registry import build_config

        self.model_config = build_config(recipe)[1]
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tellkit.models.vg_gplm import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_config.backbone)
        return self._tokenizer

    @property
    def uses_video(self) -> bool:
        return self.model_config.fusion != "none"

    # --- model ---------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = super().build_model()
        model.load_backbone_weights()  # fine-tune the pre-trained BART / T5
        return model

    def param_groups(self, model: nn.Module, lr: float) -> list[dict[str, Any]]:
        new = {id(p) for p in model.new_parameters()}
        old = [p for p in model.parameters() if p.requires_grad and id(p) not in new]
        added = [p for p in model.parameters() if p.requires_grad and id(p) in new]
        groups = [{"params": old, "lr": lr}]
        if added:
            groups.append({"params": added, "lr": lr * model.config.new_layer_lr_scale})
        return groups

    # --- data ----------------------------------------------------------------------------
    def build_dataset(self, split: str):
        from tellkit.data.how2 import How2Dataset, read_parts

        parts = getattr(self.data, split, None)
        if parts is None:
            raise TellkitError(f"unknown split '{split}' (train, val or test)")
        if not parts:
            return None
        examples = read_parts(self.data.root, parts, dedupe=self.data.dedupe, with_video=self.uses_video)
        return How2Dataset(
            examples,
            self.tokenizer,
            max_source_tokens=self.data.max_source_tokens,
            max_target_tokens=self.data.max_target_tokens,
            max_frames=self.data.max_frames,
            video_dim=self.model_config.video_dim,
            source_prefix=self.data.source_prefix,
            use_video=self.uses_video,
        )

    def collate(self, samples: list[Any]) -> dict[str, Any]:
        from tellkit.data.how2 import collate_how2

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
        e = self.eval
        out = model.generate(
            batch, max_len=e.max_len, beam_size=e.beam_size, no_repeat_ngram_size=e.no_repeat_ngram_size,
            length_penalty=e.length_penalty, min_len=e.min_len,
        )
        texts = [self.tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip() for t in out["tokens"]]
        return [
            {"id": i, "prediction": p, "reference": r}
            for i, p, r in zip(batch["ids"], texts, batch["summaries"])
        ]

    def score(self, predictions: list[dict[str, Any]]) -> dict[str, float]:
        from tellkit.metrics.summarization import flatten_scores, score_summaries

        preds = {str(p["id"]): p["prediction"] for p in predictions}
        refs = {str(p["id"]): p["reference"] for p in predictions}
        return flatten_scores(score_summaries(preds, refs, self.eval.metrics))
