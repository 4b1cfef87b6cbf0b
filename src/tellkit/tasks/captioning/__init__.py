"""Captioning (the task, its processor, recipe sections, inputs, feature cache and dataset):
see :mod:`tellkit.tasks.captioning.task`."""
from tellkit.tasks.captioning.task import (
    METRIC_NAMES,
    NO_OBJECT_DETECTOR,
    CaptionDataConfig,
    CaptionDataset,
    CaptionEvalConfig,
    CaptionGeneration,
    CaptioningTask,
    CaptionProcessor,
    article_input,
    cached_features,
    dataset_inputs,
    feature_config,
    model_contexts,
    sample_input,
)

__all__ = [
    "METRIC_NAMES",
    "NO_OBJECT_DETECTOR",
    "CaptionDataConfig",
    "CaptionDataset",
    "CaptionEvalConfig",
    "CaptionGeneration",
    "CaptionProcessor",
    "CaptioningTask",
    "article_input",
    "cached_features",
    "dataset_inputs",
    "feature_config",
    "model_contexts",
    "sample_input",
]
