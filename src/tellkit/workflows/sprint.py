"""A time-boxed training run for a machine lent for minutes: profile the step, then train at the
fastest setting found, and leave a state the next run resumes from.

    tellkit sprint RECIPE [key=value ...] --out RUN --minutes 9 [--export DIR]

1. **Profile** (about ``profile_seconds``; written to ``RUN/profile.json`` and ``profile.md``). For
   each batch size, on the recipe's own training data and model:

   * ``loader``: data loading alone (``workers`` loader processes): images/s the loader can feed;
   * ``step``: the training step alone, on batches collated and moved to the device beforehand:
     images/s the device can train;
   * ``train``: both together, as training runs them: images/s, and the share of the wall time
     spent waiting for the next batch;
   * a few steps under ``torch.profiler``: the operators with the most device time (CPU time on
     a CPU), the host-device synchronisations (``aten::item`` / ``_local_scalar_dense``, stream
     synchronisations, device-to-host copies), and how busy the device was.

   Per-batch caps of the recipe (``data.max_batch_pixels``, ``train.max_tokens``) grow with the
   batch size. A batch size that runs out of device memory is reported as such and skipped.
2. **Train** for the rest of the time (less ``reserve_seconds``, by default 10% up to 30 s, to save
   and export) with the batch
   size that trained the most images/s: the learning rate scaled by sqrt(B / the recipe's batch
   size), ``train.amp: bf16`` (where the device has it), ``workers`` loader processes, an epoch
   stretched to about ``epoch_minutes`` of training (``train.samples_per_epoch``) so that
   validation comes at that rhythm, a state saved every minute. A later sprint with the same
   ``--out`` resumes the run with the setting the profile chose (``RUN/profile.json``), so the
   profile is measured once.
3. **Export** (``--export DIR``): the last state as an inference checkpoint (float16 weights and
   config.json) and the profile, logs and summary, all in one flat folder.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tellkit.config import deep_merge
from tellkit.errors import TellkitError
from tellkit.export.safetensors import export_safetensors
from tellkit.recipes import train_config
from tellkit.tasks import make_task
from tellkit.training import distributed
from tellkit.training.evaluation import make_loader, to_device
from tellkit.training.loop import Trainer, epoch_batches, train
from tellkit.utils.files import atomic_write_json

#: operator names that make the host wait for the device
SYNC_EVENTS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
               "cudaEventSynchronize", "Memcpy DtoH")
PROFILE_FILE, NOTES_FILE = "profile.json", "profile.md"


def default_workers() -> int:
    """Loader processes: every available core but one (the one that drives the device)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def scaled_recipe(recipe: Mapping[str, Any], batch_size: int) -> dict[str, Any]:
    """``recipe`` with ``train.batch_size = batch_size`` and its per-batch caps scaled alike."""
    base = int(train_config(recipe).batch_size)
    factor = batch_size / base
    over: dict[str, Any] = {"train": {"batch_size": int(batch_size)}}
    data = recipe.get("data") or {}
    if isinstance(data, Mapping) and data.get("max_batch_pixels"):
        over["data"] = {"max_batch_pixels": int(round(int(data["max_batch_pixels"]) * factor))}
    if (recipe.get("train") or {}).get("max_tokens"):
        over["train"]["max_tokens"] = int(round(int(recipe["train"]["max_tokens"]) * factor))
    return deep_merge(recipe, over)


# --- profile ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(budget: float, least: int, items) -> tuple[int, float]:
    """Consume ``items`` (callables) until ``budget`` seconds have passed and at least ``least``
    ran; (count, seconds)."""
    t0, n = time.perf_counter(), 0
    for run in items:
        run()
        n += 1
        if n >= least and time.perf_counter() - t0 >= budget:
            break
    return n, time.perf_counter() - t0


def _op_table(prof, device: torch.device, top: int = 12) -> dict[str, Any]:
    """The profiler's operators ranked by self device time (CPU time on a CPU), the host-device
    synchronisations counted, and the device's busy share of the profiled wall time."""
    cuda = device.type == "cuda"
    events = prof.key_averages()

    def self_us(e) -> float:
        if cuda:
            return float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))
        return float(e.self_cpu_time_total)

    ranked = sorted(events, key=self_us, reverse=True)[:top]
    syncs = Counter()
    for e in events:
        if any(s in e.key for s in SYNC_EVENTS):
            syncs[e.key] += int(e.count)
    busy_us = sum(self_us(e) for e in events if not e.key.startswith("ProfilerStep")) if cuda else None
    return {"top": [{"name": e.key, "calls": int(e.count), "self_ms": self_us(e) / 1e3} for e in ranked],
            "syncs": dict(syncs), "device_busy_us": busy_us}


class _Cycle:
    """A batch sampler that goes round ``batches`` for ever (measurements of any length)."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches

    def __iter__(self):
        while True:
            yield from self.batches

    def __len__(self) -> int:
        return 2**62


def profile_batch_size(trainer: Trainer, recipe: Mapping[str, Any], batch_size: int, *, workers: int,
                       seconds: float, least: int = 3, profiled_steps: int = 4) -> dict[str, Any]:
    """The four measurements of one batch size (see the module's docstring)."""
    from torch.profiler import ProfilerActivity, profile  # heavy

    dev = trainer.dist.device
    task = make_task(scaled_recipe(recipe, batch_size))
    cfg = train_config(scaled_recipe(recipe, batch_size))
    batches = epoch_batches(task, trainer.train_set, cfg, 0, 1)
    pin = dev.type == "cuda"
    budget = seconds / 4
    row: dict[str, Any] = {"batch_size": batch_size, "batches_in_an_epoch": len(batches)}

    def loader(start: int):  # the epoch's batches from ``start`` on, round and round
        return iter(make_loader(task, trainer.train_set, _Cycle(batches[start:] + batches[:start]), workers,
                                start, pin))

    # loader alone (the first batch, which waits for the processes to start, is not timed)
    it = loader(0)
    t0 = time.perf_counter()
    first = next(it)
    row["loader_first_batch_s"] = time.perf_counter() - t0
    sizes: list[int] = []
    n, dt = _timed(budget, least, ((lambda: sizes.append(len(next(it)["ids"]))) for _ in range(10**9)))
    row["loader_images_per_s"] = sum(sizes) / dt if dt > 0 else None
    del it
    # the step alone, on batches on the device already
    ready = [to_device(first, dev)] + [to_device(task.collate([trainer.train_set[i] for i in b]), dev)
                                       for b in batches[1:least + 2]]
    images = [len(b["ids"]) for b in ready]
    trainer.step([ready[0]])  # warm-up (allocator, kernels)
    _sync(dev)
    done: list[int] = []

    def step_on(k: int):
        def run():
            trainer.step([ready[k % len(ready)]])
            done.append(images[k % len(ready)])
        return run

    n, dt = _timed(budget, least, (step_on(k) for k in range(10**9)))
    _sync(dev)
    dt = max(dt, 1e-9)
    row["step_images_per_s"], row["step_seconds"] = sum(done) / dt, dt / n
    ready.clear()  # free the device memory they hold
    # both together, as training runs them
    it = loader(len(batches) // 2)
    next(it)
    waited, trained = [0.0], [0]

    def train_one():
        t = time.perf_counter()
        b = next(it)
        waited[0] += time.perf_counter() - t
        trainer.step([b])
        trained[0] += len(b["ids"])

    n, dt = _timed(budget, least, (train_one for _ in range(10**9)))
    _sync(dev)
    row["train_images_per_s"], row["train_step_seconds"] = trained[0] / dt, dt / n
    row["data_wait_share"] = waited[0] / dt
    # a few steps under the profiler
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(profiled_steps):
            train_one()
        _sync(dev)
    wall_us = (time.perf_counter() - t0) * 1e6
    ops = _op_table(prof, dev)
    if ops["device_busy_us"] is not None:
        ops["device_busy_share"] = min(1.0, ops.pop("device_busy_us") / wall_us)
    else:
        ops.pop("device_busy_us")
    ops["syncs_per_step"] = {k: v / profiled_steps for k, v in ops.pop("syncs").items()}
    row["profile"] = ops
    if dev.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return row


def run_profile(recipe: Mapping[str, Any], scratch: Path, batch_sizes: Sequence[int], *, workers: int,
                seconds: float, device: str | None, progress: bool) -> dict[str, Any]:
    """Profile every batch size on one model and data set (built once); scratch is removed."""
    dist = distributed.setup(device)
    if dist.enabled:
        raise TellkitError("tellkit sprint runs in one process (not under torchrun)")
    rec = deep_merge(recipe, {"train": {"init_from": None, "amp": "bf16"}})  # speed does not depend on the weights
    rows = []
    try:
        trainer = Trainer(rec, train_config(rec), scratch, dist, task=make_task(rec), save_every_minutes=None,
                          progress=False)
        t0 = time.perf_counter()
        trainer.setup()
        setup_s = time.perf_counter() - t0
        for bs in batch_sizes:
            if progress:
                print(f"[tellkit sprint] profiling batch size {bs}", flush=True)
            try:
                rows.append(profile_batch_size(trainer, rec, bs, workers=workers,
                                               seconds=seconds / max(1, len(batch_sizes))))
            except torch.OutOfMemoryError:
                rows.append({"batch_size": bs, "error": "out of device memory"})
            if dist.device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dist.device)
        device_name = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu"
        amp = trainer.amp_dtype or "float32"
    finally:
        distributed.teardown(dist)
        shutil.rmtree(scratch, ignore_errors=True)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        raise TellkitError("sprint: no batch size ran (all ran out of device memory)")
    best = max(ok, key=lambda r: r["train_images_per_s"])
    return {"device": device_name, "compute_dtype": amp, "workers": workers, "setup_seconds": setup_s,
            "rows": rows, "chosen_batch_size": best["batch_size"]}


def profile_markdown(p: Mapping[str, Any]) -> str:
    lines = [f"# Training-step profile on {p['device']} ({p['compute_dtype']}, {p['workers']} loader processes)", "",
             f"Model and data built in {p['setup_seconds']:.1f} s. Chosen batch size: {p['chosen_batch_size']}.", "",
             "| batch | loader img/s | step img/s | train img/s | s/step | data wait | device busy | syncs/step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in p["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch_size']} | {r['error']} | | | | | | |")
            continue
        prof = r["profile"]
        busy = prof.get("device_busy_share")
        lines.append(f"| {r['batch_size']} | {r['loader_images_per_s']:.1f} | {r['step_images_per_s']:.1f} | "
                     f"{r['train_images_per_s']:.1f} | {r['train_step_seconds']:.3f} | {r['data_wait_share']:.0%} | "
                     f"{'-' if busy is None else f'{busy:.0%}'} | {sum(prof['syncs_per_step'].values()):.1f} |")
    for r in p["rows"]:
        if "error" in r:
            continue
        lines += ["", f"## Batch size {r['batch_size']}: operators by self time", "",
                  "| operator | calls | self ms |", "|---|---:|---:|"]
        lines += [f"| `{o['name']}` | {o['calls']} | {o['self_ms']:.1f} |" for o in r["profile"]["top"]]
        if r["profile"]["syncs_per_step"]:
            lines += ["", "Host-device synchronisations per step: " + ", ".join(
                f"`{k}` {v:g}" for k, v in sorted(r["profile"]["syncs_per_step"].items()))]
    return "\n".join(lines) + "\n"


# --- the sprint ---------------------------------------------------------------------------------
def training_recipe(recipe: Mapping[str, Any], profile: Mapping[str, Any], epoch_minutes: float,
                    scale_lr: bool = True) -> dict[str, Any]:
    """The recipe a sprint trains: the chosen batch size (caps scaled, and the lr by the square
    root of the batch ratio unless ``scale_lr`` is false), bf16, the loader processes, an epoch of
    about ``epoch_minutes`` at the profiled rate."""
    chosen = int(profile["chosen_batch_size"])
    row = next(r for r in profile["rows"] if r.get("batch_size") == chosen)
    cfg = train_config(recipe)
    lr = float(cfg.lr) * (math.sqrt(chosen / int(cfg.batch_size)) if scale_lr else 1.0)
    per_epoch = max(chosen, int(row["train_images_per_s"] * 60 * epoch_minutes))
    over = {"train": {"lr": lr, "amp": "bf16", "num_workers": int(profile["workers"]),
                      "samples_per_epoch": per_epoch}}
    return deep_merge(scaled_recipe(recipe, chosen), over)


def sprint(recipe: Mapping[str, Any], out: str | os.PathLike, *, minutes: float,
           batch_sizes: Sequence[int] = (32, 64, 128), profile_seconds: float = 60.0,
           workers: int | None = None, device: str | None = None, epoch_minutes: float = 3.0,
           reserve_seconds: float | None = None, export: str | os.PathLike | None = None,
           scale_lr: bool = True, progress: bool = True) -> dict[str, Any]:
    """Profile (once per run folder), then train until ``minutes`` after the start; see the
    module's docstring. Returns a summary (also ``RUN/sprint.json``)."""
    start = time.time()
    if not (math.isfinite(minutes) and minutes > 0):
        raise TellkitError(f"--minutes must be a positive number, got {minutes}")
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise TellkitError(f"--batch-sizes must be positive whole numbers, got {list(batch_sizes)}")
    out = Path(out)
    workers = default_workers() if workers is None else int(workers)
    resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    prof_file = out / PROFILE_FILE
    if prof_file.is_file():
        profile = json.loads(prof_file.read_text(encoding="utf-8"))
        if progress:
            print(f"[tellkit sprint] the setting chosen before: batch size {profile['chosen_batch_size']}", flush=True)
    else:
        if resume:
            raise TellkitError(f"{out} holds a run but no {PROFILE_FILE}: it was not started by tellkit sprint")
        profile = run_profile(recipe, out.parent / f".{out.name}.profiling", [int(b) for b in batch_sizes],
                              workers=workers, seconds=profile_seconds, device=device, progress=progress)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(prof_file, profile)
        (out / NOTES_FILE).write_text(profile_markdown(profile), encoding="utf-8")
        if progress:
            print(profile_markdown(profile).split("\n\n## ")[0], flush=True)
    rec = training_recipe(recipe, profile, epoch_minutes, scale_lr)
    if reserve_seconds is None:  # time to save the last state and export it
        reserve_seconds = min(30.0, 6.0 * minutes)
    deadline = start + 60 * minutes - reserve_seconds
    if time.time() >= deadline:
        raise TellkitError(f"--minutes {minutes}: no time left to train after profiling")
    summary = train(rec, out, make_task(rec), resume=resume, device=device, save_every_minutes=1.0,
                    keep_checkpoints=5, progress=progress, deadline=deadline)
    summary = {**summary, "batch_size": profile["chosen_batch_size"], "resumed": resume,
               "wall_seconds": time.time() - start}
    atomic_write_json(out / "sprint.json", summary)
    if export is not None:
        export_run(out, Path(export))
    return summary


def export_run(run: Path, dest: Path) -> None:
    """``dest``: the run's last state as a float16 inference checkpoint and its profile, logs and
    summary, side by side in one flat folder (other files there are left alone)."""
    last = run / "checkpoints" / "last"
    if not last.exists():
        raise TellkitError(f"{run}: no saved state to export")
    dest.mkdir(parents=True, exist_ok=True)
    staging = dest / ".export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    export_safetensors(last, staging, weights="float16")
    for f in staging.iterdir():  # each file replaced whole: a reader never sees half of one
        os.replace(f, dest / f.name)
    staging.rmdir()
    for name in (PROFILE_FILE, NOTES_FILE, "train_log.csv", "eval_log.csv", "sprint.json"):
        if (run / name).is_file():
            shutil.copyfile(run / name, dest / name)
