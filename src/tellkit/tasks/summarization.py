"""Multimodal summarization (How2 video + transcript -> summary) for VG-BART / VG-T5 and the
How2 seq2seq baseline.

Recipe sections read here (``configs/vg/*.yaml``), typed: an unknown key is an error::

    data: {root, train: [parts], val: [parts], test: [parts], max_source_tokens: 512,
           max_target_tokens: 128, max_frames: 256, pad_frames: true, source_prefix: "", dedupe: true}
    eval: {beam_size: 5, max_len: 64, min_len: 0, no_repeat_ngram_size: 3, length_penalty: 1.0,
           batch_size: null, metrics: [rouge, caption, content_f1]}

``data.root`` has no default: it comes from the recipe, ``data.root=...`` on the command line or
``tellkit evaluate --data``. Parts are ``tellkit.data.how2`` names (``"mfn_sample:sum_train"``,
``"mcls_demo:val"``, or ``"sum_train"`` for the official layout directly under ``root``). The
decoding fields of ``eval`` are :class:`tellkit.recipes.SummaryGeneration`, the one generation config
of the family (also read by ``tellkit.pipelines.summarization``). Training starts from the
pre-trained backbone's weights; the model's ``boosted_parameters()`` (VG-GPLM: fusion linears,
attention, forget gate) get ``lr x model.new_layer_lr_scale``. Validation generates and selects /
early-stops on ROUGE-2 (the reference implementation).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tellkit.data.how2 import How2Dataset, collate_how2, read_parts
from tellkit.errors import TellkitError
from tellkit.metrics.summarization import flatten_scores, score_summaries
from tellkit.models.vg_gplm import load_tokenizer
from tellkit.recipes import How2DataConfig, SummaryEvalConfig, section
from tellkit.registry import build_config
from tellkit.tasks import register_task
from tellkit.training.task import Task


@register_task("summarization")
class SummarizationTask(Task):
    monitor = "rouge2"
    monitor_mode = "max"

    def __init__(self, recipe: Mapping[str, Any]):
        super().__init__(recipe)
        self.data = section(recipe, "data", How2DataConfig)
        self.eval = section(recipe, "eval", SummaryEvalConfig)
        self.model_config = build_config(recipe)[1]
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
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
        out = model.generate(batch, **self.eval.kwargs())
        texts = [
            self.tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
            for t in out["tokens"]
        ]
        return [
            {"id": i, "prediction": p, "reference": r}
            for i, p, r in zip(batch["ids"], texts, batch["summaries"])
        ]

    def score(self, predictions: list[dict[str, Any]]) -> dict[str, float]:
        preds = {str(p["id"]): p["prediction"] for p in predictions}
        refs = {str(p["id"]): p["reference"] for p in predictions}
        return flatten_scores(score_summaries(preds, refs, self.eval.metrics))
