"""``tellkit table``: train each recipe of a list and score it, one row of a results table each.

    row = table_row("configs/baselines/flickr8k_papers/show_tell.yaml", TableOptions(out="runs/t"))
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tellkit.config import deep_merge, load_yaml, parse_overrides, resolve_config_path
from tellkit.errors import TellkitError
from tellkit.recipes import section, task_key
from tellkit.tasks import get_task, make_task
from tellkit.tasks.captioning import model_contexts
from tellkit.training.loop import logged_train_seconds, train
from tellkit.training.task import Task
from tellkit.utils.files import atomic_write_json
from tellkit.utils.runlock import check_not_running
from tellkit.workflows.evaluate import evaluate_checkpoint


@dataclass
class TableOptions:
    """The settings every row of one ``tellkit table`` run shares."""

    out: str | os.PathLike = "runs/table"  # rows train into OUT/<recipe name>/
    split: str = "test"
    data: str | None = None  # data.root of every row
    budget: int | None = None  # optimizer steps per row (train.max_steps)
    overrides: Sequence[str] = ()  # key=value for every row
    features: str | None = None  # captioning feature caches under FEATURES/<key>, shared by rows
    device: str | None = None
    progress: bool = True
    rerun: bool = False  # train and score again rows that have results (and restart unfinished ones)
    save_every_minutes: float = 10.0  # an interrupted row resumes from its newest state


# Encoders and their outputs shared by the rows of one table run (process-wide): rows that encode
# the same images / texts with the same encoders do it once. float16, like the task's disk cache.
_MEMO: dict[tuple, object] = {}


def cacheable(recipe: Mapping[str, Any]) -> bool:
    """Whether the captioning task's disk cache (data.features) can hold this row's contexts."""
    contexts = model_contexts(recipe.get("model") or {})
    return "article" not in contexts or (recipe.get("data") or {}).get("context") != "other_captions"


def feature_key(recipe: Mapping[str, Any]) -> str:
    """Rows with equal encoders, contexts and data (but for the cache folder) share features."""
    data = {k: v for k, v in (recipe.get("data") or {}).items() if k != "features"}
    what = {"encoders": recipe.get("encoders") or {}, "contexts": (recipe.get("model") or {}).get("contexts"),
            "data": data}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _row_task(recipe: Mapping[str, Any]) -> Task:
    """The recipe's task, sharing what it can with the other rows of this run (a captioning
    task: the built encoders and their encodings, in memory: :meth:`Task.shared_options`)."""
    return make_task(recipe, **get_task(recipe["task"]).shared_options(recipe, _MEMO))


def published_numbers(value: Any, where: str) -> dict[str, Any] | None:
    """A recipe's ``published:`` block (the paper's figures for this row, shown beside it):
    ``source`` (text), optional ``encoder`` / ``note`` (text), and metric keys with numbers."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("source"), str):
        raise TellkitError(f"{where}: 'published' must be a mapping with a 'source' text and metric numbers")
    out: dict[str, Any] = {"source": value["source"], "metrics": {}}
    for k, v in value.items():
        if k in ("encoder", "note"):
            out[k] = str(v)
        elif k != "source":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TellkitError(f"{where}: published.{k} must be a number, got {v!r}")
            out["metrics"][str(k)] = float(v)
    return out


def _table_recipe(cfg_path: Path, opts: TableOptions) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """(recipe with the run's settings on top, row label, published numbers)."""
    recipe = load_yaml(cfg_path)
    label = str(recipe.pop("row", cfg_path.stem))
    published = published_numbers(recipe.pop("published", None), str(cfg_path))
    extra: dict[str, Any] = {}
    if opts.data:
        extra["data"] = {"root": opts.data}
    if opts.budget:
        extra["train"] = {"max_steps": int(opts.budget), "max_epochs": 10**6}
    recipe = deep_merge(deep_merge(recipe, extra), parse_overrides(list(opts.overrides)))
    if "task" not in recipe:
        raise TellkitError(f"{cfg_path}: the recipe has no 'task:'")
    if get_task(recipe["task"], f"{cfg_path}: task:").caches_features:
        recipe["data"] = dict(recipe.get("data") or {})
        if not cacheable(recipe):
            recipe["data"].pop("features", None)  # encoded in memory, shared across rows (see _row_task)
        elif opts.features:
            recipe["data"]["features"] = str(Path(opts.features) / feature_key(recipe))
    return recipe, label, published


def _train_seconds(run_dir: Path, known: float | None) -> float:
    """A row's training time: what the run reported, or the sum over its sittings from its log when
    that is more (rows of runs saved before the trainer's clock went on across resumes)."""
    return round(max(known or 0.0, logged_train_seconds(run_dir / "train_log.csv")), 1)


def table_row(path: str | os.PathLike, opts: TableOptions, log: Callable[[str], None] = lambda msg: None) -> dict:
    """Train the recipe at ``path`` into ``OUT/<name>/`` and score its best checkpoint on the
    split. Finished rows are read back (``table_row.json``); an interrupted row resumes from its
    newest saved state (``opts.rerun`` starts it over). KeyboardInterrupt when training is stopped
    by a signal (its state is saved)."""
    cfg_path = resolve_config_path(path)
    recipe, label, published = _table_recipe(cfg_path, opts)
    name = cfg_path.stem if cfg_path.parent.name in ("", ".") else f"{cfg_path.parent.name}_{cfg_path.stem}"
    run_dir = Path(opts.out) / name
    eval_file, summary_file = run_dir / "eval" / f"metrics_{opts.split}.json", run_dir / "table_row.json"
    if eval_file.is_file() and summary_file.is_file() and not opts.rerun:
        log(f"{label}: results exist in {run_dir} (--rerun to redo)")
        row = json.loads(summary_file.read_text(encoding="utf-8"))
        row["train_seconds"] = _train_seconds(run_dir, row.get("train_seconds"))
        return {**row, "published": published}
    resume = (run_dir / "checkpoints").exists()
    if resume and opts.rerun:
        check_not_running(run_dir)  # never delete a run another process is training
        shutil.rmtree(run_dir)
        resume = False
    log(f"{label}: {'resuming' if resume else 'training'} {cfg_path} -> {run_dir}")
    task = _row_task(recipe)
    summary = train(recipe, run_dir, task, resume=resume, device=opts.device,
                    save_every_minutes=opts.save_every_minutes, progress=opts.progress)
    if summary["stopped"] == "signal":
        raise KeyboardInterrupt
    t_train = _train_seconds(run_dir, summary["elapsed_s"])
    ckpt = summary["best_checkpoint"] or summary["last_checkpoint"]
    log(f"{label}: {summary['steps']} steps in {t_train:.0f}s; scoring {ckpt} on {opts.split}")
    t0 = time.time()
    try:
        result = evaluate_checkpoint(ckpt, opts.split, out=run_dir / "eval", device=opts.device,
                                     progress=opts.progress, recipe=recipe, task=task)
    except TellkitError as exc:
        raise TellkitError(f"{label}: {exc}") from exc
    preds = result.predictions
    row = {
        "row": label, "config": str(path), "task": task_key(recipe["task"]), "family": recipe["model"]["name"],
        "encoder": section(recipe, "encoders").get("image"), "params": result.parameters,
        "steps": summary["steps"], "train_seconds": t_train,
        "eval_seconds": round(time.time() - t0, 1), "split": opts.split, "n": len(preds),
        "best_val": summary["best"], "monitor": summary["monitor"], "metrics": result.metrics,
        "example": {"prediction": preds[0].get("prediction"),
                    "reference": (preds[0].get("references") or [preds[0].get("reference")])[0]} if preds else None,
    }
    atomic_write_json(summary_file, row)
    return {**row, "published": published}
