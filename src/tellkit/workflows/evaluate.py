"""Evaluate a checkpoint on a data split: what ``tellkit evaluate`` runs.

    result = evaluate_checkpoint("runs/tiny", "test", data="/data/flickr8k")
    result.metrics, result.summary_file, result.predictions_file

Evaluation is: checkpoint -> its stored recipe (``config.json``, with ``data.root`` and
``key=value`` overrides on top) -> the recipe's task -> the split's dataset -> batch size
(``--batch-size``, else ``eval.batch_size``, else ``train.batch_size``) -> generate and score
-> ``metrics_<split>.json`` and ``predictions_<split>.jsonl``. Works under ``torchrun`` too
(predictions gathered, scored and written once).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tellkit import runtime as runtimes
from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
from tellkit.config import deep_merge, parse_overrides
from tellkit.errors import TellkitError
from tellkit.recipes import RESERVED_CHECKPOINT_KEYS, SPLITS, eval_batch_size, section, task_key
from tellkit.registry import build_config
from tellkit.tasks import make_task
from tellkit.training import distributed
from tellkit.training.evaluation import run_eval, write_eval_outputs
from tellkit.training.task import Task
from tellkit.utils import precision as precisions


def checkpoint_recipe(checkpoint: str | os.PathLike, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The recipe a checkpoint written by ``tellkit train`` keeps in its ``config.json``: every
    stored section, and the model section rebuilt from its family and config."""
    meta = read_checkpoint_config(checkpoint) if meta is None else meta
    if not meta.get("task"):
        raise TellkitError(f"{checkpoint}: the checkpoint does not name its task "
                           "(it was not written by `tellkit train`)")
    if not isinstance(meta["task"], str):
        raise TellkitError(f"{checkpoint}: 'task' in config.json must be a task name")
    recipe = {k: v for k, v in meta.items() if k not in RESERVED_CHECKPOINT_KEYS}
    recipe["task"] = task_key(meta["task"], f"{checkpoint}: task:")  # a former name, still read
    recipe["model"] = {"name": meta["family"], **meta["config"]}
    for name in ("data", "eval", "train"):
        recipe[name] = section(recipe, name, where=f"{checkpoint}: config.json")
    return recipe


@dataclass
class EvalResult:
    """What :func:`evaluate_checkpoint` measured and wrote (files: on the main process only)."""

    checkpoint: Path
    split: str
    metrics: dict[str, float]
    predictions: list[dict[str, Any]]
    parameters: int  # trainable parameters of the evaluated model
    summary_file: Path | None = None
    predictions_file: Path | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """The JSON summary ``tellkit evaluate`` prints."""
        return {"split": self.split, "n": len(self.predictions), "metrics": self.metrics,
                "dtype": self.info.get("dtype", "float32"), "runtime": self.info.get("runtime", "torch"),
                **({"rare_names": self.info["rare_names"]} if "rare_names" in self.info else {}),
                "summary": str(self.summary_file),
                "predictions": str(self.predictions_file)}


def default_eval_dir(checkpoint: Path) -> Path:
    """A run's ``checkpoints/<name>`` evaluates into ``<run>/eval``; any other checkpoint (an
    exported model, a packaged default inside the installed package) into
    ``./runs/eval/<checkpoint folder name>``, never beside the checkpoint itself."""
    if checkpoint.parent.name == "checkpoints":
        return checkpoint.parent.parent / "eval"
    return Path("runs") / "eval" / checkpoint.resolve().name


def check_model_overrides(recipe: Mapping[str, Any], changed: Any, ckpt: Path) -> None:
    """``model.key=value`` given to an evaluation: an unknown key or a bad value is refused as
    ``tellkit train`` refuses it; a known key that differs from the checkpoint's is refused too,
    since the model is rebuilt from the checkpoint as it was trained (it would be ignored)."""
    build_config(recipe)  # the one error train gives: unknown keys, bad values
    stored = read_checkpoint_config(ckpt).get("config") or {}
    differ = sorted(k for k, v in dict(changed).items() if k != "name" and stored.get(k) != v)
    if differ:
        raise TellkitError(f"model.{differ[0]}: the model is rebuilt from the checkpoint as trained, so its "
                           "model settings cannot change at evaluation (generation settings: eval.*)")


def evaluate_checkpoint(checkpoint: str | os.PathLike, split: str = "test", *, data: str | None = None,
                        overrides: Sequence[str] | Mapping[str, Any] | None = None,
                        out: str | os.PathLike | None = None,
                        batch_size: int | None = None, device: str | None = None, progress: bool = True,
                        recipe: Mapping[str, Any] | None = None, task: Task | None = None,
                        dtype: str | None = None, runtime: str | None = None) -> EvalResult:
    """Generate for ``split`` with a checkpoint (or a run folder: its best checkpoint), score it
    and write ``metrics_<split>.json`` / ``predictions_<split>.jsonl`` into ``out`` (default:
    :func:`default_eval_dir`). ``data`` replaces ``data.root``; ``overrides``: ``key=value``
    strings or a nested mapping. ``recipe`` / ``task``: the ones the checkpoint was trained with,
    when the caller holds them already (``tellkit table``); default: the stored recipe's.
    ``dtype``: "bf16" generates in bfloat16 autocast where the device computes it natively (else
    float32, and ``info`` says why), as the inference pipelines do; "fp32" or None: float32.
    ``runtime``: "onnx" generates with the model's ONNX graphs under ONNX Runtime
    (:mod:`tellkit.runtime`; the loss is still PyTorch's); None or "torch": PyTorch."""
    if split not in SPLITS:
        raise TellkitError(f"--split must be train, val or test, got {split!r}")
    if runtimes.check_runtime(runtime, device=device, dtype=dtype) == "onnx" and device is None:
        device = "cpu"  # ONNX Runtime runs on the CPU (the evaluator's default is CUDA when there is one)
    ckpt = resolve_checkpoint(checkpoint)
    recipe = checkpoint_recipe(ckpt) if recipe is None else dict(recipe)
    if data:
        if not Path(data).exists():
            raise TellkitError(f"--data: not found: {data}")
        recipe["data"] = {**section(recipe, "data"), "root": data}
    if overrides:
        extra = parse_overrides(list(overrides)) if not isinstance(overrides, Mapping) else overrides
        recipe = deep_merge(recipe, extra)
        if "model" in extra:
            check_model_overrides(recipe, extra["model"], ckpt)
    if (recipe.get("data") or {}).get("augment"):
        # evaluation never augments: a stored recipe's training augmentation (pen-stroke keys, say)
        # must not keep a model from reading other data (bitmaps with data.layout=tsv)
        recipe["data"] = {**recipe["data"], "augment": {}}
    # the ONNX runtime computes on the CPU: with no device named, that is where it runs
    info = distributed.setup("cpu" if device is None and runtime == "onnx" else device)
    try:
        task = make_task(recipe) if task is None else task
        if hasattr(task, "check_inputs"):  # e.g. encoder weights that cannot be reached: before the model loads
            task.check_inputs()
        model = load_model(ckpt, map_location=info.device).float()
        task.progress = progress
        task.precision = precisions.resolve_precision(info.device, dtype)
        out_dir = Path(out) if out else default_eval_dir(ckpt)
        task.evaluation_dir = out_dir
        dataset = task.build_dataset(split)
        if dataset is None or len(dataset) == 0:
            raise TellkitError(f"split '{split}' is empty")
        # the searches run on the runtime a pipeline would load (the loss is the PyTorch model's)
        generating, _ = runtimes.generating_model(model, runtime, ckpt, read_checkpoint_config(ckpt),
                                                  getattr(task, "processor", None), device=info.device, dtype=dtype)
        metrics, preds = run_eval(task, model, dataset, split, info,
                                  batch_size=eval_batch_size(recipe, batch_size),
                                  num_workers=int(section(recipe, "train").get("num_workers") or 0),
                                  progress=progress, generator=generating)
        result = EvalResult(ckpt, split, metrics, preds, model.num_parameters(trainable_only=True),
                            info={"checkpoint": str(ckpt), "task": task_key(recipe["task"]),
                                  "dtype": task.precision.name,
                                  **({"runtime": runtime} if runtime not in (None, "torch") else {}),
                                  **({"dtype_note": task.precision.note} if task.precision.note else {}),
                                  **getattr(task, "eval_info", {})})
        if info.is_main:
            result.summary_file, result.predictions_file = write_eval_outputs(
                out_dir, split, metrics, preds, result.info)
    finally:
        distributed.teardown(info)
    return result
