"""The ``train:`` section of a run recipe.

Defaults are the Transform and Tell reference recipe (AllenNLP "bert_adam"): AdamW with lr 1e-4,
betas (0.9, 0.98), eps 1e-6, decoupled weight decay 1e-5, 5% linear warm-up then linear decay
to zero, gradient-norm clip 0.1, early stopping after 30 evaluations without improvement.
One difference from "bert_adam": ``torch.optim.AdamW`` applies Adam's bias correction.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tellkit.config import from_dict
from tellkit.errors import TellkitError

OPTIMIZERS = ("adamw", "adam", "adadelta", "bert_adam")
SCHEDULERS = ("linear_warmup", "step", "plateau", "constant")


@dataclass
class TrainConfig:
    # optimizer
    optimizer: str = "adamw"  # adamw (decoupled weight decay) | adam (L2 in the gradient) | adadelta
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 1e-5
    rho: float = 0.9  # adadelta only
    # learning-rate schedule
    scheduler: str = "linear_warmup"  # linear_warmup | step | plateau | constant
    warmup: float = 0.05  # fraction of the total optimizer steps (linear_warmup only)
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
    # runtime
    amp: bool | str = True  # mixed precision on CUDA: true/"fp16" (with loss scaling), "bf16", false
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
        for name in ("max_tokens", "max_steps", "samples_per_epoch"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise TellkitError(f"train.{name} must be >= 1 or null, got {v}")
        if self.lr <= 0:
            raise TellkitError(f"train.lr must be positive, got {self.lr}")
        if len(self.betas) != 2:
            raise TellkitError(f"train.betas must be two numbers, got {self.betas}")
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]

    @property
    def amp_dtype(self) -> str | None:
        """'float16', 'bfloat16' or None (mixed precision is only ever used on CUDA)."""
        if self.amp is False:
            return None
        return "bfloat16" if self.amp == "bf16" else "float16"


def train_config(recipe: Mapping[str, Any]) -> TrainConfig:
    """The recipe's ``train:`` section as a validated :class:`TrainConfig`."""
    sec = recipe.get("train") or {}
    if not isinstance(sec, Mapping):
        raise TellkitError("the recipe's 'train' section must be a mapping")
    return from_dict(TrainConfig, sec, "train")
