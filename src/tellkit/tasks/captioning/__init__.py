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
PROPN tokens of the training split's captions and articles (``names``: counted once, streamed,
cached; where they came from in ``task.eval_info["rare_names"]``). The human captions' length,
distinct words, TTR and Flesch are reported beside the generations' (``reference_*``).

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

Modules: ``recipe`` (the sections above), ``names`` (the rare-name counts), ``inputs`` (samples
and articles -> encoder inputs), ``processor`` (:class:`CaptionProcessor`), ``features`` (the
feature cache), ``dataset`` (:class:`CaptionDataset`) and ``task`` (:class:`CaptioningTask`,
self-critical training included).
"""
from tellkit.tasks.captioning.dataset import CaptionDataset
from tellkit.tasks.captioning.features import cached_features, feature_config
from tellkit.tasks.captioning.inputs import article_input, dataset_inputs, sample_input
from tellkit.tasks.captioning.processor import NO_OBJECT_DETECTOR, CaptionProcessor
from tellkit.tasks.captioning.recipe import (
    METRIC_NAMES,
    CaptionDataConfig,
    CaptionEvalConfig,
    CaptionGeneration,
    model_contexts,
)
from tellkit.tasks.captioning.task import CaptioningTask

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
