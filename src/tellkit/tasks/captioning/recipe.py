"""A captioning recipe's own sections (``data:``, ``eval:``, the generation settings) and the
contexts a captioner reads."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tellkit.errors import TellkitError
from tellkit.recipes import (
    CAPTION_FORMATS,
    CONTEXT_MODES,
    CONTEXT_POLICIES,
    GenerationSettings,
    check_limits,
)
from tellkit.registry import get_entry

# the numbers each caption metric of ``eval.metrics`` gives
METRIC_NAMES = {"bleu": ("bleu1", "bleu2", "bleu3", "bleu4"), "meteor": ("meteor",), "rouge": ("rouge_l",),
                "cider": ("cider",)}

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
    # also score proper nouns unseen in the training captions (and, in tellkit evaluate, articles)
    rare_proper_nouns: bool = True
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
