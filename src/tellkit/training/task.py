"""The contract between a model family and the generic trainer / evaluator.

The trainer owns devices, DDP, mixed precision, optimizer steps, checkpoints and logging;
a Task owns everything specific to one kind of model and data. The model contract is::

    out = model(batch)          # batch: dict of tensors from Task.collate (moved to device);
                                # captioning: tellkit.data.batch.CaptionBatch (masks True = real)
    out["loss"]                 # scalar, mean over target tokens
    out["ntokens"]              # int/tensor, number of target tokens (for logging, tokens/s)
    model.generate(...)         # task-specific; called through the task's processor
                                # (tellkit.tasks.processor) by Task.predict and by the inference
                                # pipelines (tellkit.pipelines), with the recipe's generation
                                # settings (the task's generation config)

The training loop (:mod:`tellkit.training.loop`) and evaluator drive this class; the tasks
(:mod:`tellkit.tasks`) implement it. A task reads its recipe sections through
:func:`tellkit.recipes.section` into dataclasses that refuse unknown keys (its own, defined with
it); inference does not build a task, but runs the task's processor through
:mod:`tellkit.pipelines`, so that evaluation and inference share one path.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from tellkit.errors import TellkitError
from tellkit.registry import create_model

# recipe sections that only some tasks read (a task lists those it reads in ``task_sections``)
TASK_SECTIONS = ("scst",)


class Task:
    """Subclass, decorate with ``@register_task("name")`` and fill in the hooks."""

    name: str = "base"
    # the task-specific recipe sections (tellkit.config.RECIPE_SECTIONS) this task reads
    task_sections: tuple[str, ...] = ()
    # progress bars for long work the task does itself (e.g. a feature cache built while a
    # dataset is built); the trainer and the evaluator set it from their --no-progress
    progress: bool = True
    # the compute precision of generation in evaluation (a tellkit.utils.precision.Precision:
    # ``tellkit evaluate --dtype``); None: float32
    precision = None
    # whether the task encodes its inputs with frozen encoders into features a disk cache
    # (``data.features``) can hold, which the rows of one ``tellkit table`` run may share
    caches_features: bool = False
    # where a final evaluation (``tellkit evaluate``, ``tellkit table``) writes its outputs, set by
    # ``evaluate_checkpoint``; None during a training run's validation. A task may keep files
    # derived from its data there and compute figures only a final evaluation reports
    evaluation_dir: Path | None = None

    def __init__(self, recipe: Mapping[str, Any]):
        self.recipe = dict(recipe)  # the resolved recipe: task, model, data, train, eval sections
        for name in TASK_SECTIONS:
            if self.recipe.get(name) is not None and name not in self.task_sections:
                raise TellkitError(f"the recipe has an '{name}' section, which the '{self.name}' task does not read")

    @classmethod
    def shared_options(cls, recipe: Mapping[str, Any], memo: dict) -> dict[str, Any]:
        """Constructor options that let several runs in one process (the rows of ``tellkit
        table``) share work through ``memo`` (built encoders, say); default: none."""
        return {}

    # --- model -------------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        return create_model(self.recipe)

    def param_groups(self, model: nn.Module, lr: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups. Override for e.g. a higher lr on newly added layers."""
        return [{"params": [p for p in model.parameters() if p.requires_grad], "lr": lr}]

    # --- data --------------------------------------------------------------------------
    def build_dataset(self, split: str) -> Dataset:
        """``split`` in {"train", "val", "test"}; items are whatever ``collate`` accepts."""
        raise NotImplementedError

    def collate(self, samples: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def on_device(self, batch: dict[str, Any], model: nn.Module) -> dict[str, Any]:
        """The batch the model reads, from the collated ``batch`` once it is on the model's
        device; called by the training step and the evaluator (``model.training`` tells which),
        e.g. to run encoders in the step. Default: the batch as it is."""
        return batch

    def training_batch(self, batch: dict[str, Any], model: nn.Module) -> dict[str, Any]:
        """The batch the training step's forward reads, from the :meth:`on_device` batch (the
        unwrapped ``model`` in train mode), e.g. captions the model drew itself with their
        weights (self-critical training). Default: the batch as it is."""
        return batch

    def training_stats(self) -> dict[str, float]:
        """Figures of the steps since the last call that the trainer logs beside the loss
        (e.g. the mean reward of self-critical training); none by default."""
        return {}

    def batch_sampler(self, dataset: Dataset, split: str, *, shuffle: bool, seed: int,
                      epoch: int) -> Iterable[list[int]] | None:
        """Optional: lists of indices (e.g. length buckets with a token cap). None = fixed-size batches."""
        return None

    def sample_size(self, dataset: Dataset, index: int) -> int:
        """Optional: cost of one sample (tokens/pixels) for bucketing; default 1."""
        return 1

    # --- checkpoints -------------------------------------------------------------------
    def checkpoint_files(self) -> dict[str, dict[str, Any]]:
        """{file name: tensors} kept beside the model in every training checkpoint, for state
        that training changes outside the model (an encoder's BatchNorm statistics); none by
        default. :meth:`checkpoint_meta` names them in ``config.json``."""
        return {}

    def checkpoint_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The recipe sections a checkpoint's ``config.json`` stores, adjusted to name the
        :meth:`checkpoint_files` (default: unchanged)."""
        return meta

    def restore_checkpoint_files(self, directory: Path) -> bool:
        """Read back what :meth:`checkpoint_files` saved in the checkpoint ``directory`` (on
        ``--resume`` and from ``train.init_from``); True when something was read."""
        return False

    # --- evaluation --------------------------------------------------------------------
    def predict(self, model: nn.Module, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Generate for one collated batch; one dict per sample (must include an 'id')."""
        raise NotImplementedError

    def score(self, predictions: list[dict[str, Any]]) -> dict[str, float]:
        """Corpus-level metrics over ALL predictions of a split (gathered across ranks first)."""
        raise NotImplementedError

    # the metric to select/early-stop on, and whether larger is better ("min" | "max");
    # a monitor other than "loss" makes validation generate (predict) and score
    monitor: str = "loss"
    monitor_mode: str = "min"
    # further (metric, mode) pairs that order evaluations whose monitor ties (ExpRate 0 early on)
    monitor_tiebreak: tuple[tuple[str, str], ...] = ()

    def check_training(self) -> None:
        """Refuse, with a one-line error, settings that only training cannot work with (called
        before a run writes anything; evaluation does not call it)."""

    def monitor_key(self, metrics: Mapping[str, float]) -> tuple[float, ...]:
        """The monitor, then its tie-breakers, signed so that a larger tuple is better."""
        key = []
        for name, mode in ((self.monitor, self.monitor_mode), *self.monitor_tiebreak):
            if name not in metrics:
                raise TellkitError(f"task '{self.name}' monitors '{name}' but validation gave {sorted(metrics)}")
            value = metrics[name]
            if value is None:  # undefined (an entity ratio of 0/0): the worst value
                key.append(-math.inf)
                continue
            key.append(float(value) if mode == "max" else -float(value))
        return tuple(key)
    # DDP: True when some parameters may get no gradient in a step (unused contexts, adaptive
    # softmax tails); False is faster for models that always use every parameter
    ddp_find_unused_parameters: bool = True
