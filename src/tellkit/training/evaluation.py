"""Evaluation shared by the training loop (validation) and ``tellkit evaluate``.

Each process takes every ``world``-th batch of the split (no padding samples, so nothing is
counted twice); losses are summed over tokens and all-reduced; predictions are gathered on every
rank, put back in batch order, checked for duplicate ids, and scored ONCE over the whole split
by ``Task.score`` on rank 0 (corpus-level metrics such as CIDEr are never averaged per batch).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from tellkit.errors import TellkitError
from tellkit.training.distributed import DistInfo
from tellkit.training.task import Task
from tellkit.utils import precision
from tellkit.utils.files import atomic_write_bytes, atomic_write_json


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def autocast(device: torch.device, amp_dtype: str | None):
    """Mixed precision in ``amp_dtype`` where ``device`` has it (``tellkit.utils.precision``);
    a no-op context elsewhere."""
    return precision.resolve(device, amp_dtype).autocast()


def plain_batches(task: Task, dataset: Dataset, split: str, batch_size: int, *, shuffle: bool, seed: int,
                  epoch: int) -> list[list[int]]:
    """The task's batches (e.g. length buckets) or fixed-size ones, as lists of indices."""
    custom = task.batch_sampler(dataset, split, shuffle=shuffle, seed=seed, epoch=epoch)
    if custom is not None:
        return [list(b) for b in custom if len(b)]
    n = len(dataset)
    if shuffle:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def make_loader(task: Task, dataset: Dataset, batches: list[list[int]], num_workers: int, seed: int,
                pin: bool) -> DataLoader:
    # an explicit generator: creating the iterator must not consume the global RNG (exact resume)
    return DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=task.collate,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=pin,
    )


@torch.no_grad()
def run_eval(
    task: Task,
    model: nn.Module,
    dataset: Dataset,
    split: str,
    dist: DistInfo,
    *,
    batch_size: int,
    num_workers: int = 0,
    amp_dtype: str | None = None,
    with_loss: bool = True,
    generate: bool = True,
    progress: bool = False,
    generator: Any = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Loss and/or generation + corpus scores over a whole split. Same result on every rank.
    ``generator``: the model whose ``generate`` the task's predictions call (default: ``model``;
    the same model on another runtime, :func:`tellkit.runtime.generating_model`)."""
    batches = plain_batches(task, dataset, split, batch_size, shuffle=False, seed=0, epoch=0)
    mine = list(range(dist.rank, len(batches), dist.world))
    loader = make_loader(task, dataset, [batches[i] for i in mine], num_workers, 0, dist.device.type == "cuda")
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=dist.device)
    ntok = torch.zeros((), dtype=torch.float64, device=dist.device)
    preds: list[tuple[int, list[dict[str, Any]]]] = []
    if progress and dist.is_main:
        it = tqdm(loader, total=len(mine), desc=f"eval {split}", dynamic_ncols=True, leave=False)
    else:
        it = loader
    try:
        for bi, batch in zip(mine, it):
            batch = task.on_device(to_device(batch, dist.device), model)
            if with_loss:
                with autocast(dist.device, amp_dtype):
                    out = model(batch)
                n = float(out["ntokens"])
                loss_sum += out["loss"].double() * n
                ntok += n
            if generate:
                preds.append((bi, task.predict(model if generator is None else generator, batch)))
    finally:
        model.train(was_training)
    metrics: dict[str, float] = {}
    if with_loss:
        stats = dist.sum_(torch.stack([loss_sum, ntok]))
        if stats[1] > 0:
            metrics["loss"] = float(stats[0] / stats[1])
    predictions: list[dict[str, Any]] = []
    if generate:
        # batch order over all ranks, as a single process would produce them
        merged = sorted((bp for part in dist.gather(preds) for bp in part), key=lambda x: x[0])
        predictions = [p for _, ps in merged for p in ps]
        ids = [p.get("id") for p in predictions]
        if len(set(map(str, ids))) != len(ids):
            raise TellkitError(f"{split}: predictions contain duplicate ids (a sample was evaluated twice)")
        scores = task.score(predictions) if dist.is_main else None
        metrics.update(dist.broadcast(scores))
    return metrics, predictions


def write_eval_outputs(out_dir: str | Path, split: str, metrics: dict[str, Any], predictions: list[dict[str, Any]],
                       info: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """``metrics_<split>.json`` (summary) and ``predictions_<split>.jsonl`` (one line per example)."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = out / f"metrics_{split}.json"
    per_example = out / f"predictions_{split}.jsonl"
    atomic_write_json(summary, {"split": split, "n": len(predictions), "metrics": metrics, **(info or {})})
    lines = "".join(json.dumps(p, ensure_ascii=False, default=_jsonable) + "\n" for p in predictions)
    atomic_write_bytes(per_example, lines.encode("utf-8"))
    return summary, per_example


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
