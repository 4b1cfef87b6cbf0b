"""Cached features: a captioning split's ``tellkit features`` shards
(:mod:`tellkit.encoders.features`), one folder per split, extracted when missing."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tellkit.data.sample import CaptionSample
from tellkit.encoders.bundle import CaptionInput
from tellkit.encoders.features import FeatureConfig, FeatureStore, extract_features
from tellkit.errors import TellkitError
from tellkit.registry import build_config
from tellkit.tasks.captioning.inputs import sample_input
from tellkit.training.task import Task


def feature_config(task: Task) -> FeatureConfig:
    return FeatureConfig(encoders=task.encoders, faces="faces" in task.contexts, article="article" in task.contexts,
                         objects="objects" in task.contexts, max_article_tokens=task.data.max_article_tokens,
                         context_policy=task.data.context_policy)


def cached_features(task: Task, samples: list[CaptionSample], split: str, progress: bool = True):
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
