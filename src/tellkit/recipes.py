"""Run recipes: the shared mechanism under everything that reads one.

A recipe (``configs/**.yaml``, or the sections a checkpoint's ``config.json`` keeps) has the
sections ``task``, ``model``, ``data``, ``train``, ``eval``, ``encoders`` (and ``scst``, and
``row`` for ``tellkit table``). Every typed section is a dataclass read with :func:`section`
(one error text for a section that is not a mapping; an unknown key is an error, see
:func:`tellkit.config.from_dict`). A section lives with the code that gives it its meaning, and
every class is named ``<Task><Section>Config`` (a generation config ``<Task>Generation``):

    ====================  ========================================================================
    here                  :class:`TrainConfig` (``train:``), :class:`SelfCriticalConfig` (``scst:``),
                          :class:`GenerationSettings` (what every generation config shares)
    tellkit.tasks.*       CaptionDataConfig, CaptionEvalConfig, CaptionGeneration (captioning);
                          RecognitionEvalConfig, RecognitionGeneration (recognition);
                          SummaryDataConfig, SummaryEvalConfig, SummaryGeneration (summarization)
    tellkit.data          RecognitionDataConfig (``data/recognition.py``: renderer, bitmaps)
    tellkit.encoders      EncodersConfig (``encoders/bundle.py``: the frozen captioning encoders)
    ====================  ========================================================================

::

    data = section(recipe, "data", CaptionDataConfig)
    gen = section(recipe, "eval", CaptionEvalConfig).generation.updated(beam_size=args.beam_size)
    out = model.generate(batch, **gen.kwargs())

Each task has ONE generation config (like Hugging Face's ``GenerationConfig``), all of one shape
(:class:`GenerationSettings`: ``from_section``, ``updated``, ``kwargs``, the search caps); a
task's ``eval`` section is its generation config plus how predictions are scored.

Also owned here: the task keys (:data:`TASK_KEYS`, :func:`task_key`), the values a recipe may name
that several layers read (data formats, context modes, the packaged encoders), the packaged
default models (:func:`packaged_default`) and the
checkpoint metadata keys a recipe section may not use (:data:`RESERVED_CHECKPOINT_KEYS`). This
module imports only :mod:`tellkit.config` and :mod:`tellkit.errors`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

from tellkit.config import from_dict
from tellkit.errors import TellkitError

T = TypeVar("T")

SPLITS = ("train", "val", "test")

# checkpoint metadata written beside the recipe sections in config.json (tellkit.checkpoint)
RESERVED_CHECKPOINT_KEYS = ("format_version", "family", "config", "tellkit_version")

# --- task keys ------------------------------------------------------------------------------------
# One key per task, its command's name, used everywhere: the command, ``tellkit.pipeline(task)``,
# the task registry (``@register_task``), a recipe's and a checkpoint's ``task:``, the server's
# route (``/api/<task>``) and its ``--models`` / ``--checkpoint`` names
TASK_KEYS = ("caption", "recognize", "summarize")
# the names these tasks had before (registry and recipes; the server's "math"), still read
FORMER_TASK_NAMES = {"captioning": "caption", "recognition": "recognize", "math": "recognize",
                     "summarization": "summarize"}
_told: set[tuple[str, str]] = set()


def task_key(name: Any, where: str = "task") -> Any:
    """The key of the task ``name`` names: a former name (:data:`FORMER_TASK_NAMES`) is read as
    its key, with a one-line deprecation message on standard error (once per name and place);
    anything else comes back unchanged (the caller refuses what it does not know)."""
    new = FORMER_TASK_NAMES.get(name) if isinstance(name, str) else None
    if new is None:
        return name
    if (name, where) not in _told:
        _told.add((name, where))
        logging.getLogger("tellkit").warning("tellkit: %s '%s' is deprecated, the task is now called '%s'",
                                             where, name, new)
    return new


# --- the packaged default models ------------------------------------------------------------------
ASSETS = Path(__file__).resolve().parent / "assets"
# the default model of each pipeline task, named by its command (`tellkit caption`, `tellkit recognize`;
# also `demo`, `serve` and `tellkit.pipeline(task)` without a model); summarization ships none
PACKAGED_DEFAULTS: dict[str, Path] = {"caption": ASSETS / "default_caption", "recognize": ASSETS / "bttr_default"}


def packaged_default(task: str) -> Path | None:
    """The packaged default checkpoint of ``task`` ("caption" or "recognize") when it is
    installed (its weights file is there), else None (also for a task that ships none)."""
    path = PACKAGED_DEFAULTS.get(task)
    return path if path is not None and (path / "model.safetensors").is_file() else None


# --- reading a section ----------------------------------------------------------------------------
@overload
def section(recipe: Mapping[str, Any], name: str) -> dict[str, Any]: ...
@overload
def section(recipe: Mapping[str, Any], name: str, cls: type[T], where: str | None = None) -> T: ...
def section(recipe, name, cls=None, where=None):
    """The recipe's section ``name``: a plain dict (``cls`` None) or the dataclass ``cls`` built
    from it (unknown keys refused). A missing or null section is empty; ``where`` names the
    section in error messages (default: ``name``)."""
    where = where or name
    sec = recipe.get(name) if isinstance(recipe, Mapping) else None
    if cls is not None and isinstance(sec, cls):
        return sec
    if sec is None:
        sec = {}
    if not isinstance(sec, Mapping):
        raise TellkitError(f"{where}: the recipe's '{name}' section must be a mapping, got {type(sec).__name__}")
    return dict(sec) if cls is None else from_dict(cls, dict(sec), where)


def known_keys(sec: Mapping[str, Any] | None, cls: type) -> dict[str, Any]:
    """The keys of ``sec`` that dataclass ``cls`` knows: for sections stored by an older version
    in a checkpoint, which may hold keys this version dropped (recipes are checked strictly)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in dict(sec or {}).items() if k in names}


def model_section(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The model part of a recipe: its ``model`` section, or the recipe itself (a model config file)."""
    sec = section(recipe, "model") if "model" in recipe else dict(recipe)
    if "name" not in sec:
        raise TellkitError("config has no model section with a 'name' (the model family)")
    return sec


# --- generation: one config per family, all of one shape -----------------------------------------
# Caps on a search's work, checked wherever generation settings are read (a checkpoint's stored
# recipe, a recipe file, a command's flags): a beam of 100,000 or a length of 1e8 would take
# gigabytes and hours. Models with learned position tables cap max_len further
# (GenerationSettings.check_positions).
MAX_BEAM_SIZE = 256
MAX_GENERATION_LEN = 1024


def check_limits(limit: Mapping[str, Any] | None) -> dict[str, int]:
    """``data.limit`` ({split: N}): the first / a seeded N samples of a split. Splits are those of
    :data:`SPLITS`; N is a whole number >= 1, or null for the whole split. Returns the limits
    that are set, as ints; a one-line :class:`TellkitError` otherwise."""
    if limit is None:
        return {}
    if not isinstance(limit, Mapping):
        raise TellkitError(f"data.limit must be a mapping such as {{val: 400}}, got {limit!r}")
    bad = sorted(str(k) for k in set(limit) - set(SPLITS))
    if bad:
        raise TellkitError(f"data.limit: unknown split(s) {', '.join(bad)}; known: {', '.join(SPLITS)}")
    out = {}
    for split, n in limit.items():
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise TellkitError(f"data.limit.{split} must be a whole number >= 1 (or null for the whole split), "
                               f"got {n!r}")
        out[split] = n
    return out


def check_search_setting(name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high], else a one-line TellkitError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or int(value) != value:
        raise TellkitError(f"generation: {name} must be a whole number, got {value!r}")
    if int(value) < low:
        raise TellkitError(f"generation: {name} must be at least {low}, got {int(value)}")
    if high is not None and int(value) > high:
        raise TellkitError(f"generation: {name} {int(value):,} is over the limit of {high:,}")
    return int(value)


class GenerationSettings:
    """What the generation configs of the families share (they are dataclasses)."""

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def generation_fields(cls) -> tuple[str, ...]:
        """The fields of the family's generation config (an eval section adds scoring fields)."""
        base = next(c for c in cls.__mro__ if GenerationSettings in c.__bases__)
        return tuple(f.name for f in dataclasses.fields(base))  # type: ignore[arg-type]

    @classmethod
    def from_section(cls, sec: Mapping[str, Any] | None, where: str = "eval", **overrides: Any):
        """The generation fields of a recipe section (its other keys are left to the eval
        config), with non-None ``overrides`` on top."""
        keep = cls.generation_fields()
        d = {k: v for k, v in dict(sec or {}).items() if k in keep}
        d.update({k: v for k, v in overrides.items() if v is not None})
        base = next(c for c in cls.__mro__ if GenerationSettings in c.__bases__)
        return from_dict(base, d, where)

    def updated(self, **overrides: Any):
        """A copy with the given fields replaced; ``None`` values leave a field unchanged."""
        unknown = sorted(set(overrides) - set(self.fields()))
        if unknown:
            raise TellkitError(f"generation: unknown setting(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore

    @property
    def generation(self):
        """The family's generation config alone (an eval section without its scoring fields)."""
        base = next(c for c in type(self).__mro__ if GenerationSettings in c.__bases__)
        return base(**{f: getattr(self, f) for f in self.generation_fields()})

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the family's ``model.generate``."""
        return {f: getattr(self, f) for f in self.generation_fields()}

    def _check_search(self, min_len_low: int = 1) -> None:
        """Every family's bounds: beam_size in [1, MAX_BEAM_SIZE], max_len (when set) in
        [1, MAX_GENERATION_LEN], min_len / no_repeat_ngram_size (when the family has them)."""
        self.beam_size = check_search_setting("beam_size", self.beam_size, 1, MAX_BEAM_SIZE)
        if self.max_len is not None:
            self.max_len = check_search_setting("max_len", self.max_len, 1, MAX_GENERATION_LEN)
        if hasattr(self, "min_len"):
            self.min_len = check_search_setting("min_len", self.min_len, min_len_low, MAX_GENERATION_LEN)
        if hasattr(self, "no_repeat_ngram_size"):
            self.no_repeat_ngram_size = check_search_setting("no_repeat_ngram_size", self.no_repeat_ngram_size, 0,
                                                             MAX_GENERATION_LEN)

    def check_positions(self, positions: int | None, what: str = "the model") -> None:
        """Refuse a max_len past the positions a model with a fixed position table has."""
        if positions is not None and self.max_len is not None and int(self.max_len) > int(positions):
            raise TellkitError(f"generation: max_len {self.max_len:,} is over the {int(positions):,} positions "
                               f"{what} has")


# --- captioning -------------------------------------------------------------------------------------
CAPTION_FORMATS = ("goodnews", "nytimes800k", "coco", "flickr8k")
CONTEXT_MODES = ("location_aware", "first_tokens", "other_captions", "none")
CONTEXT_POLICIES = ("reference", "cut")  # see tellkit.encoders.context
IMAGE_FITS = ("crop", "squash")  # tellkit.encoders.preprocess.FITS
DEFAULT_IMAGE_ENCODER = "mobilenet_v2"  # the one with pre-trained weights that ship offline
DEFAULT_ARTICLE_ENCODER = "all-MiniLM-L6-v2"  # packaged; the paper used roberta-large
DEFAULT_FACE_ENCODER = "facenet_casia"  # packaged CASIA-WebFace FaceNet; the paper used VGGFace2
MAX_FACES = 4  # Transform and Tell keeps the 4 largest faces
FACE_DIM = 512
OBJECT_DIM = 2048


SCST_BASELINES = ("mean", "greedy")


@dataclass
class SelfCriticalConfig:
    """A captioning recipe's ``scst:`` section: self-critical sequence training (Rennie et al.
    2017), fine-tuning a trained captioner on the CIDEr-D of captions it draws itself
    (:mod:`tellkit.training.self_critical`). Present = on; absent = cross-entropy training."""

    samples: int = 5  # captions drawn per image and step
    max_len: int = 20  # BPE tokens per drawn caption, EOS included
    min_len: int = 1
    temperature: float = 1.0
    # what a drawn caption's reward is compared with: "mean" of the image's other drawn captions
    # (Luo 2020, no extra decoding) | "greedy": the image's greedy caption (Rennie et al. 2017)
    baseline: str = "mean"
    lowercase: bool = True  # the reward's text is lower-cased like the Flickr8k / COCO metrics'
    # the cross-entropy's share w of the loss, w * XE(all the image's references) + (1 - w) * PG
    # (the reference's 1 - structure_loss_weight; Paulus et al. 2018); 0 = self-critical alone
    xe_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.baseline not in SCST_BASELINES:
            raise TellkitError(f"scst.baseline must be one of {', '.join(SCST_BASELINES)}, got {self.baseline!r}")
        if int(self.samples) < 1 or (self.baseline == "mean" and int(self.samples) < 2):
            raise TellkitError(f"scst.samples must be >= 2 with baseline 'mean' (>= 1 with 'greedy'), "
                               f"got {self.samples}")
        if int(self.max_len) < 1 or not 1 <= int(self.min_len) <= int(self.max_len):
            raise TellkitError(f"scst needs 1 <= min_len <= max_len, got {self.min_len} and {self.max_len}")
        if not 0 <= self.xe_weight < 1:
            raise TellkitError(f"scst.xe_weight must be in [0, 1) (the cross-entropy's share), got {self.xe_weight}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise TellkitError(f"scst.temperature must be a positive finite number, got {self.temperature}")


# --- training ---------------------------------------------------------------------------------------
OPTIMIZERS = ("adamw", "adam", "adadelta", "bert_adam")
SCHEDULERS = ("linear_warmup", "cosine", "step", "plateau", "constant")


@dataclass
class TrainConfig:
    """The ``train:`` section. Defaults are the Transform and Tell reference recipe (AllenNLP
    "bert_adam"): AdamW with lr 1e-4, betas (0.9, 0.98), eps 1e-6, decoupled weight decay 1e-5,
    5% linear warm-up then linear decay to zero, gradient-norm clip 0.1, early stopping after 30
    evaluations without improvement. One difference from "bert_adam": ``torch.optim.AdamW``
    applies Adam's bias correction."""

    # optimizer
    optimizer: str = "adamw"  # adamw (decoupled weight decay) | adam (L2 in the gradient) | adadelta
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 1e-5
    rho: float = 0.9  # adadelta only
    # learning-rate schedule
    scheduler: str = "linear_warmup"  # linear_warmup | cosine | step | plateau | constant
    warmup: float = 0.05  # fraction of the total optimizer steps (of each cycle for cosine)
    # cosine: a linear warm-up, then half a cosine from lr down to lr * min_lr_ratio, over the whole
    # run or, with cycle_epochs, over cycles of that many epochs, each a warm restart (SGDR)
    cycle_epochs: float | None = None
    min_lr_ratio: float = 0.0
    step_every_epochs: int = 1  # step: multiply lr by step_gamma every this many epochs
    step_gamma: float = 0.1
    plateau_patience: int = 2  # plateau: evaluations without improvement before lr *= factor
    plateau_factor: float = 0.5
    clip_norm: float = 0.1  # max gradient L2 norm; 0 = no clipping
    max_grad_norm: float = 0.0  # bert_adam only: clip EACH parameter's gradient to this norm
    # batches
    batch_size: int = 16  # samples per process per micro-batch (a cap when max_tokens is set)
    max_tokens: int | None = None  # optional cap on tokens per batch (length-bucketed batches)
    accumulate: int = 1  # micro-batches per optimizer step (per process)
    # length of training
    max_epochs: int = 100
    max_steps: int | None = None  # optimizer steps; stops earlier than max_epochs when reached
    samples_per_epoch: int | None = None  # None = one pass over the training set per epoch
    eval_every_epochs: int = 1
    patience: int | None = 30  # early stopping, in evaluations without improvement; None = never
    # start from the weights of a checkpoint or run folder (fine-tuning, staged training); the
    # optimizer, schedule and data order start fresh. Ignored by --resume (the run's own state wins).
    init_from: str | None = None
    # an exponential moving average of the weights with this decay (e.g. 0.999), kept beside the
    # raw weights, saved in every state and validated beside them (tellkit.training.ema); null: none
    ema: float | None = None
    # runtime
    # mixed precision: true/"fp16" (CUDA, with loss scaling; float32 on a CPU), "bf16" (CUDA, and
    # CPUs with native bf16; float32 with a log line elsewhere), false
    amp: bool | str = True
    seed: int = 1
    num_workers: int = 0
    log_every: int = 50  # optimizer steps between log lines / CSV rows

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise TellkitError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.scheduler not in SCHEDULERS:
            raise TellkitError(f"train.scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.amp not in (True, False, "fp16", "bf16"):
            raise TellkitError(f"train.amp must be true, false, 'fp16' or 'bf16', got {self.amp!r}")
        if not 0.0 <= self.warmup < 1.0:
            raise TellkitError(f"train.warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        for name in ("batch_size", "accumulate", "max_epochs", "eval_every_epochs", "log_every", "step_every_epochs"):
            if int(getattr(self, name)) < 1:
                raise TellkitError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.cycle_epochs is not None and not (math.isfinite(float(self.cycle_epochs)) and self.cycle_epochs > 0):
            raise TellkitError(f"train.cycle_epochs must be a positive number or null, got {self.cycle_epochs}")
        if not 0.0 <= float(self.min_lr_ratio) <= 1.0:
            raise TellkitError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("max_tokens", "max_steps", "samples_per_epoch"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise TellkitError(f"train.{name} must be >= 1 or null, got {v}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise TellkitError(f"train.lr must be a positive finite number, got {self.lr}")
        for name in ("eps", "weight_decay", "rho", "step_gamma", "plateau_factor", "clip_norm", "max_grad_norm"):
            if not math.isfinite(float(getattr(self, name))) or float(getattr(self, name)) < 0:
                raise TellkitError(f"train.{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.ema is not None and (isinstance(self.ema, bool) or not 0.0 < float(self.ema) < 1.0):
            raise TellkitError(f"train.ema must be a decay between 0 and 1 (e.g. 0.999) or null, got {self.ema}")
        if len(self.betas) != 2:
            raise TellkitError(f"train.betas must be two numbers, got {self.betas}")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]

    @property
    def amp_dtype(self) -> str | None:
        """'float16', 'bfloat16' or None: what the recipe asks for (``tellkit.utils.precision``
        decides what a device grants)."""
        if self.amp is False:
            return None
        return "bfloat16" if self.amp == "bf16" else "float16"


def train_config(recipe: Mapping[str, Any]) -> TrainConfig:
    """The recipe's ``train:`` section as a validated :class:`TrainConfig`."""
    return section(recipe, "train", TrainConfig)


def eval_batch_size(recipe: Mapping[str, Any], override: int | None = None) -> int:
    """Samples per evaluation batch: ``override`` (``--batch-size``), else ``eval.batch_size``,
    else ``train.batch_size``, else 16."""
    ev, train = section(recipe, "eval"), section(recipe, "train")
    return int(override or ev.get("batch_size") or train.get("batch_size") or 16)
