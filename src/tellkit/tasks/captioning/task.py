"""The captioning task: binds a captioner to its data, encoders, batches, self-critical training
and scoring, for the generic trainer and ``tellkit evaluate``."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tellkit.checkpoint import IMAGE_ENCODER_FILE, carried_encoder_files, read_checkpoint_config
from tellkit.data import load_captions
from tellkit.data.batch import CaptionBatch, CaptionItem, collate_captions
from tellkit.data.bucketing import bucket_batches
from tellkit.data.sample import CaptionSample
from tellkit.encoders.bundle import EncoderBundle, EncodersConfig
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.encoders.weights import load_strict, read_weights_file
from tellkit.errors import TellkitError
from tellkit.metrics.caption import METRICS, score_captions_detailed
from tellkit.metrics.linguistic import linguistic_scores
from tellkit.metrics.ner import DEFAULT_MODEL, entity_scores, resolve_model
from tellkit.recipes import (
    SelfCriticalConfig,
    section,
)
from tellkit.tasks import register_task
from tellkit.tasks.captioning.dataset import CaptionDataset
from tellkit.tasks.captioning.inputs import sample_input
from tellkit.tasks.captioning.names import NEWS_FORMATS, NameCounts, training_name_counts
from tellkit.tasks.captioning.processor import CaptionProcessor
from tellkit.tasks.captioning.recipe import METRIC_NAMES, CaptionDataConfig, CaptionEvalConfig, model_contexts
from tellkit.tasks.processor import finite_or_none
from tellkit.training.evaluation import to_device
from tellkit.training.self_critical import SelfCritical
from tellkit.training.task import Task


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
        self._name_counts: dict[bool, NameCounts] = {}

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

    def _training_text(self) -> tuple[str, dict[str, Any]]:
        """The training split's location and the loader options that change its text."""
        d = self.data
        if d.format is None:
            raise TellkitError("the recipe's data section has no 'format'")
        root = d.files.get("train") if d.format == "coco" and d.files else d.root
        if not root:
            raise TellkitError("the recipe names no training data (data.root, or data.files.train for COCO)")
        options = {k: v for k, v in d.options.items() if k not in ("objects", "limit")}
        if d.format in ("coco", "flickr8k"):
            options.setdefault("context", d.context if d.context in ("none", "other_captions") else "none")
        return str(root), options

    def name_counts(self, articles: bool) -> NameCounts:
        """The PROPN counts of the training split's captions (and, with ``articles``, of its
        articles): :func:`tellkit.tasks.captioning.names.training_name_counts`, cached in the
        feature cache (``data.features``), else in the evaluation's output folder."""
        key = bool(articles)
        if key not in self._name_counts:
            root, options = self._training_text()
            cache = self.data.features or self.evaluation_dir
            self._name_counts[key] = training_name_counts(self.data.format, root, options, self.ner_model,
                                                          articles=articles, cache_dir=cache)
        return self._name_counts[key]

    def rare_vocabularies(self) -> tuple[set[str] | None, set[str] | None]:
        """(training caption names, training article names) for the rare-name figures, and where
        they came from in ``eval_info["rare_names"]``. The article names (a pass over every
        training article) are counted for a final evaluation only (``evaluation_dir`` set), not
        for the validation of a training run. A training split that cannot be read gives
        (None, None) and a note saying why, never a made-up figure."""
        articles = self.evaluation_dir is not None and self.data.format in NEWS_FORMATS
        try:
            counts = self.name_counts(articles)
        except TellkitError as exc:
            self.eval_info["rare_names"] = {"note": f"no rare-name figures: the training split could not be read "
                                                    f"({exc})"}
            return None, None
        info = dict(counts.info)
        if counts.context is None:
            info["article_note"] = ("no article rare-name figures: " + (
                f"{self.data.format} has no articles" if self.data.format not in NEWS_FORMATS
                else "counted by tellkit evaluate only"))
        self.eval_info["rare_names"] = info
        return set(counts.caption), (set(counts.context) if counts.context is not None else None)

    def score(self, predictions):
        preds = {p["id"]: p["prediction"] for p in predictions}
        refs = {p["id"]: p["references"] for p in predictions}
        metrics, per = score_captions_detailed(preds, refs, self.eval.metrics or METRICS, lowercase=self.eval.lowercase)
        for p in predictions:  # per-example scores go into predictions_<split>.jsonl
            p["scores"] = per[p["id"]]
        metrics.update(linguistic_scores(preds.values()))
        # the same measures of the human captions, as the reference reports them beside the generations'
        metrics.update(linguistic_scores((r for k in preds for r in refs[k]), prefix="reference_"))
        if self.eval.ner:
            words, article_words = self.rare_vocabularies() if self.eval.rare_proper_nouns else (None, None)
            metrics.update(entity_scores(preds, {k: v[0] for k, v in refs.items()}, train_words=words,
                                         article_words=article_words, model=self.ner_model))
            self.eval_info["ner_model"] = self.ner_model
        return metrics
