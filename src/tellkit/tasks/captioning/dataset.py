"""The captioning dataset: caption ids, references and the context tensors of each item."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from tellkit.data.batch import CaptionItem
from tellkit.data.sample import CaptionSample
from tellkit.tasks.captioning.features import cached_features
from tellkit.tasks.captioning.inputs import sample_input
from tellkit.training.task import Task


class CaptionDataset(Dataset):
    """Items (:class:`~tellkit.data.batch.CaptionItem`): id, caption ids, references, and the
    context tensors the model uses."""

    def __init__(self, samples: list[CaptionSample], task: Task, split: str, per_image: bool):
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
