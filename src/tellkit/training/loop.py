"""The one training loop, for every model family (bound to its data and metrics by a Task).

    train(recipe, run_dir)            # or: tellkit train CONFIG key=value ... --out RUN [--resume]

Read top to bottom: set-up (processes, device, seeds, task, model, optimizer, schedule), then
epochs of optimizer steps, each step = ``accumulate`` micro-batches per process; validation at
the end of every ``eval_every_epochs``-th epoch with early stopping on ``task.monitor``.

Explicit choices:
- Loss normalisation: every micro-batch contributes ``loss * ntokens`` and the summed gradient is
  divided by the token count over all micro-batches and all processes, so a step over N
  processes x K micro-batches equals one step over the union of those batches in one process.
- Batches are planned per epoch from (seed, epoch) alone, and the position in the epoch is saved,
  so ``--resume`` skips exactly the batches already seen and, with the RNG states restored,
  continues bit-for-bit (on CPU; cuDNN / atomics may make GPU runs differ in the last bits).
- Under DDP each process takes every ``world``-th batch; an epoch's trailing batches that cannot
  be shared out evenly (fewer than ``world``) are dropped so every process does the same steps.
- Mixed precision only on CUDA (fp16 with a loss scaler, or bf16); CPU runs are fp32.
- Frozen encoders / cached features are the Task's business: only parameters with
  ``requires_grad`` reach the optimizer (see ``Task.param_groups``).
"""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import time
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Any, Mapping

import torch
import yaml
from torch import nn

from tellkit.config import to_dict
from tellkit.errors import TellkitError
from tellkit.tasks.base import Task
from tellkit.training import distributed
from tellkit.training.checkpointing import CheckpointManager
from tellkit.training.config import TrainConfig, train_config
from tellkit.training.evaluation import autocast, make_loader, plain_batches, run_eval, to_device

TRAIN_COLUMNS = ["step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"]
EVAL_COLUMNS = ["step", "epoch", "split", "metric", "value"]


# --- small pieces ---------------------------------------------------------------------------
def build_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise TellkitError("the model has no trainable parameters")
    if cfg.optimizer == "adamw":  # decoupled weight decay ("bert_adam"-style)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "bert_adam":  # the Transform and Tell reference's (training/bert_adam.py)
        from tellkit.training.bert_adam import BertAdam

        return BertAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        max_grad_norm=cfg.max_grad_norm)
    if cfg.optimizer == "adam":  # L2 penalty added to the gradient
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.Adadelta(groups, lr=cfg.lr, rho=cfg.rho, eps=cfg.eps, weight_decay=cfg.weight_decay)


class LRSchedule:
    """lr of each param group = its base lr x ``factor``; the state is three numbers (JSON)."""

    def __init__(self, cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int, mode: str):
        self.cfg, self.opt, self.total, self.mode = cfg, optimizer, max(1, total_steps), mode
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.warm = int(round(cfg.warmup * self.total)) if cfg.scheduler == "linear_warmup" else 0
        self.plateau_scale, self.plateau_best, self.plateau_bad = 1.0, None, 0

    def factor(self, step: int, epoch: int) -> float:
        """For the optimizer step numbered ``step`` (0-based) taken during ``epoch``."""
        s = self.cfg.scheduler
        if s == "linear_warmup":
            if step < self.warm:
                return (step + 1) / self.warm
            return max(0.0, (self.total - step) / max(1, self.total - self.warm))
        if s == "step":
            return self.cfg.step_gamma ** (epoch // self.cfg.step_every_epochs)
        if s == "plateau":
            return self.plateau_scale
        return 1.0

    def apply(self, step: int, epoch: int) -> float:
        f = self.factor(step, epoch)
        for g, base in zip(self.opt.param_groups, self.base):
            g["lr"] = base * f
        return self.opt.param_groups[0]["lr"]

    def on_eval(self, value: float) -> None:
        if self.cfg.scheduler != "plateau":
            return
        better = self.plateau_best is None or (value < self.plateau_best if self.mode == "min" else value > self.plateau_best)
        if better:
            self.plateau_best, self.plateau_bad = value, 0
        else:
            self.plateau_bad += 1
            if self.plateau_bad > self.cfg.plateau_patience:
                self.plateau_scale *= self.cfg.plateau_factor
                self.plateau_bad = 0

    def state_dict(self) -> dict[str, Any]:
        return {"plateau_scale": self.plateau_scale, "plateau_best": self.plateau_best, "plateau_bad": self.plateau_bad}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.plateau_scale, self.plateau_best, self.plateau_bad = d["plateau_scale"], d["plateau_best"], d["plateau_bad"]


def epoch_batches(task: Task, dataset, cfg: TrainConfig, epoch: int, world: int) -> list[list[int]]:
    """The global list of training batches of ``epoch``, a pure function of (seed, epoch).

    With ``samples_per_epoch`` the passes over the data form one stream (pass p shuffled with
    seed p) and epoch e is the stretch of batches starting in samples [e*S, (e+1)*S).
    """

    def one_pass(p: int) -> list[list[int]]:
        return plain_batches(task, dataset, "train", cfg.batch_size, shuffle=True, seed=cfg.seed, epoch=p)

    if cfg.samples_per_epoch is None:
        batches = one_pass(epoch)
    else:
        start, stop = epoch * cfg.samples_per_epoch, (epoch + 1) * cfg.samples_per_epoch
        batches, seen, p = [], 0, 0
        while seen < stop:
            chunk = one_pass(p)
            if not chunk:
                break
            for b in chunk:
                if seen >= stop:
                    break
                if seen >= start:
                    batches.append(b)
                seen += len(b)
            p += 1
    return batches[: len(batches) - len(batches) % world]


class _CsvLog:
    """Append-only CSV; on resume, rows after the resumed step are dropped (they are redone)."""

    def __init__(self, path: Path, columns: list[str], keep_until_step: int | None):
        self.path, self.columns = path, columns
        if keep_until_step is not None and path.is_file():
            with open(path, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= keep_until_step]
            self._rewrite(rows)
        elif not path.is_file():
            self._rewrite([])

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        with open(self.path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, self.columns).writerow(row)


def _tensorboard(run_dir: Path, log):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log("TensorBoard is not installed (pip install 'tellkit[train]'): logging to CSV only")
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


class _StopSignal:
    """First SIGTERM/SIGINT: finish the current step, save, stop. A second SIGINT interrupts."""

    def __init__(self):
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --- the loop ---------------------------------------------------------------------------------
def train(
    recipe: Mapping[str, Any],
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    task: Task | None = None,
    device: str | None = None,
    save_every_steps: int | None = None,
    save_every_minutes: float | None = 30.0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train ``recipe`` into ``run_dir``; returns a summary (steps, best metric, checkpoints)."""
    cfg = train_config(recipe)
    run_dir = Path(run_dir)
    dist = distributed.setup(device)
    log = (lambda msg: print(f"[tellkit train] {msg}", flush=True)) if dist.is_main else (lambda msg: None)
    try:
        return _train(recipe, cfg, run_dir, dist, log, resume, task, save_every_steps, save_every_minutes, progress)
    finally:
        distributed.teardown(dist)


def _train(recipe, cfg: TrainConfig, run_dir: Path, dist, log, resume, task, save_every_steps, save_every_minutes, progress):
    from tellkit.tasks import get_task

    ckpts = CheckpointManager(run_dir)
    resolved = json.loads(json.dumps({**dict(recipe), "train": to_dict(cfg)}))  # plain YAML/JSON types
    resume_from = ckpts.resolve("last") if resume else None
    if resume and resume_from is None:
        raise TellkitError(f"--resume: no checkpoint under {ckpts.dir}")
    if not resume and ckpts.resolve("last") is not None:
        raise TellkitError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --out")
    if resume and (run_dir / "config.yaml").is_file():
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        diff = sorted(k for k in set(saved) | set(resolved) if saved.get(k) != resolved.get(k))
        if diff:
            raise TellkitError(f"--resume: the config differs from the run's saved config.yaml in section(s) {', '.join(diff)}")
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False), encoding="utf-8")

    # -- task, model, data --------------------------------------------------------------------
    _seed_all(cfg.seed)  # identical initial weights on every process
    if task is None:
        if "task" not in recipe:
            raise TellkitError("the recipe has no 'task:' (which task trains this model)")
        task = get_task(recipe["task"])(recipe)
    model = task.build_model()
    if cfg.init_from and not resume:
        from tellkit.checkpoint import load_weights_into

        log(f"initial weights from {load_weights_into(model, cfg.init_from)}")
    model = model.to(dist.device)
    train_set = task.build_dataset("train")
    val_set = task.build_dataset("val")
    if len(train_set) == 0:
        raise TellkitError("the training set is empty")
    if val_set is not None and len(val_set) == 0:
        val_set = None
    if val_set is None:
        log("no validation set: no early stopping, the last state is also the best")

    groups = task.param_groups(model, cfg.lr)
    optimizer = build_optimizer(cfg, groups)
    n_batches = len(epoch_batches(task, train_set, cfg, 0, dist.world))
    if n_batches == 0:
        raise TellkitError(f"the training set gives fewer batches than processes ({dist.world})")
    steps_per_epoch = math.ceil(n_batches / dist.world / cfg.accumulate)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.max_epochs
    schedule = LRSchedule(cfg, optimizer, total_steps, task.monitor_mode)

    amp_dtype = cfg.amp_dtype if dist.device.type == "cuda" else None
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == "float16" else None
    log(
        f"{type(model).__name__} on {dist.device} x{dist.world}: "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters; "
        f"{len(train_set)} train / {len(val_set) if val_set is not None else 0} val samples; "
        f"{steps_per_epoch} steps per epoch, {total_steps} in all; mixed precision {amp_dtype or 'off'}"
    )

    # -- state, possibly resumed ------------------------------------------------------------
    st = {"step": 0, "epoch": 0, "pos": 0, "best": None, "best_step": None, "bad_evals": 0, "last_eval_step": None, "world": dist.world}
    if resume_from is not None:
        saved = CheckpointManager.load(resume_from, model, optimizer, dist.rank)
        for k in st:
            st[k] = saved.get(k, st[k])
        schedule.load_state_dict(saved["schedule"])
        if scaler is not None and saved.get("scaler"):
            scaler.load_state_dict(saved["scaler"])
        if saved.get("world") != dist.world:
            log(f"resuming with {dist.world} processes, saved with {saved.get('world')}: data order continues, RNG streams do not")
        if saved.get("rng_restored") is False:
            _seed_all(cfg.seed * 7919 + dist.rank + st["step"])
        st["world"] = dist.world
        log(f"resumed from {resume_from} (step {st['step']}, epoch {st['epoch']}, batch {st['pos']})")
    else:
        _seed_all(cfg.seed * 7919 + dist.rank)  # per-process randomness (dropout) from here on

    ddp_model = model
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [dist.device.index] if dist.device.type == "cuda" else None
        ddp_model = DDP(model, device_ids=ids, find_unused_parameters=task.ddp_find_unused_parameters)
    params = [p for g in optimizer.param_groups for p in g["params"]]

    # -- logs ---------------------------------------------------------------------------------
    tb = train_csv = eval_csv = None
    if dist.is_main:
        keep = st["step"] if resume_from is not None else None
        train_csv = _CsvLog(run_dir / "train_log.csv", TRAIN_COLUMNS, keep)
        eval_csv = _CsvLog(run_dir / "eval_log.csv", EVAL_COLUMNS, keep)
        tb = _tensorboard(run_dir, log)
    # every section but the model (which config.json holds already): task, data, eval, train,
    # encoders ... at the top level of config.json, so `tellkit evaluate` / `caption` / `serve`
    # can rebuild the task and its encoders from the checkpoint alone
    reserved = {"format_version", "family", "config", "tellkit_version"} & set(resolved)
    if reserved:
        raise TellkitError(f"recipe sections {sorted(reserved)} clash with checkpoint metadata names")
    extra = {**{k: v for k, v in resolved.items() if k != "model"}, "task": task.name}

    def trainer_state() -> dict[str, Any]:
        return {**st, "schedule": schedule.state_dict(), "scaler": scaler.state_dict() if scaler else None}

    def save(best: bool = False) -> None:
        ckpts.save(st["step"], model, optimizer, trainer_state(), extra=extra, rank=dist.rank, barrier=dist.barrier, best=best)

    def evaluate() -> bool:
        """Validate, update best / early stopping, save. True when training should stop."""
        st["last_eval_step"] = st["step"]
        if val_set is None:
            save(best=True)
            return False
        generate = task.monitor != "loss"
        metrics, _ = run_eval(task, model, val_set, "val", dist, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                              amp_dtype=amp_dtype, generate=generate, progress=progress)
        if task.monitor not in metrics:
            raise TellkitError(f"task '{task.name}' monitors '{task.monitor}' but validation gave {sorted(metrics)}")
        value = metrics[task.monitor]
        better = st["best"] is None or (value < st["best"] if task.monitor_mode == "min" else value > st["best"])
        if better:
            st["best"], st["best_step"], st["bad_evals"] = value, st["step"], 0
        else:
            st["bad_evals"] += 1
        schedule.on_eval(value)
        if dist.is_main:
            for k, v in metrics.items():
                eval_csv.write({"step": st["step"], "epoch": st["epoch"], "split": "val", "metric": k, "value": v})
                if tb:
                    tb.add_scalar(f"val/{k}", v, st["step"])
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            log(f"step {st['step']} epoch {st['epoch']}: val {shown}" + ("  (best)" if better else f"  ({st['bad_evals']} without improvement)"))
        save(best=better)
        return cfg.patience is not None and st["bad_evals"] >= cfg.patience

    # -- epochs -------------------------------------------------------------------------------
    t0 = time.time()
    last_save = time.time()
    win_loss = win_tok = 0.0
    win_t = time.time()
    stop_reason = None
    with _StopSignal() as stop_signal:
        while stop_reason is None:
            if st["epoch"] >= cfg.max_epochs:
                stop_reason = "max_epochs"
                break
            if cfg.max_steps is not None and st["step"] >= cfg.max_steps:
                stop_reason = "max_steps"
                break
            batches = epoch_batches(task, train_set, cfg, st["epoch"], dist.world)
            mine = batches[st["pos"] + dist.rank :: dist.world]
            loader = make_loader(task, train_set, mine, cfg.num_workers, cfg.seed * 1_000_003 + st["epoch"] * 1009 + st["pos"],
                                 dist.device.type == "cuda")
            it = iter(loader)
            bar = None
            if progress and dist.is_main:
                from tqdm.auto import tqdm

                bar = tqdm(total=math.ceil(len(batches) / dist.world / cfg.accumulate), initial=st["pos"] // dist.world // cfg.accumulate,
                           desc=f"epoch {st['epoch']}", dynamic_ncols=True)
            while True:
                group = list(islice(it, cfg.accumulate))
                if not group:
                    break
                # ---- one optimizer step over len(group) micro-batches per process ----
                lr = schedule.apply(st["step"], st["epoch"])
                model.train()
                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), dtype=torch.float64, device=dist.device)
                step_tok = torch.zeros((), dtype=torch.float64, device=dist.device)
                for i, batch in enumerate(group):
                    batch = to_device(batch, dist.device)
                    sync = i == len(group) - 1
                    with (ddp_model.no_sync() if dist.enabled and not sync else nullcontext()):
                        with autocast(dist.device, amp_dtype):
                            out = ddp_model(batch)
                        n = float(out["ntokens"])
                        summed = out["loss"].float() * n  # undo the per-batch mean: weight by tokens
                        (scaler.scale(summed) if scaler else summed).backward()
                    step_loss += summed.detach().double()
                    step_tok += n
                totals = dist.sum_(torch.stack([step_loss, step_tok]))
                if scaler:
                    scaler.unscale_(optimizer)
                if totals[1] > 0:
                    # DDP averaged the token-weighted sums over processes: x world / all tokens
                    scale = dist.world / float(totals[1])
                    for p in params:
                        if p.grad is not None:
                            p.grad.mul_(scale)
                gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm if cfg.clip_norm > 0 else float("inf"))
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                elif torch.isfinite(gnorm):
                    optimizer.step()
                else:
                    log(f"step {st['step']}: non-finite gradient norm, step skipped")
                st["step"] += 1
                st["pos"] += len(group) * dist.world
                # ---- logging ----
                win_loss += float(totals[0])
                win_tok += float(totals[1])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{float(totals[0]) / max(1.0, float(totals[1])):.3f}", lr=f"{lr:.2e}")
                if st["step"] % cfg.log_every == 0 and dist.is_main:
                    dt = max(1e-9, time.time() - win_t)
                    row = {"step": st["step"], "epoch": st["epoch"], "loss": win_loss / max(1.0, win_tok), "lr": lr,
                           "grad_norm": float(gnorm), "tokens": int(win_tok), "tokens_per_s": win_tok / dt, "elapsed_s": time.time() - t0}
                    train_csv.write(row)
                    if tb:
                        for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
                            tb.add_scalar(f"train/{k}", row[k], st["step"])
                    if bar is None:
                        log(f"step {st['step']} epoch {st['epoch']}: loss {row['loss']:.4f} lr {lr:.3g} |g| {row['grad_norm']:.3g}")
                if st["step"] % cfg.log_every == 0:
                    win_loss = win_tok = 0.0
                    win_t = time.time()
                # ---- stopping and periodic saving ----
                if cfg.max_steps is not None and st["step"] >= cfg.max_steps:
                    stop_reason = "max_steps"
                    break
                # collectives on every rank, every step: all processes must agree to save / stop
                stop_now = dist.any(stop_signal.requested)
                timed = dist.any(save_every_minutes is not None and time.time() - last_save >= 60 * save_every_minutes)
                if stop_now or timed or (save_every_steps and st["step"] % save_every_steps == 0):
                    save()
                    last_save = time.time()
                    if stop_now:
                        stop_reason = "signal"
                        break
            if bar is not None:
                bar.close()
            if stop_reason is not None:
                break
            st["epoch"] += 1
            st["pos"] = 0
            if st["epoch"] % cfg.eval_every_epochs == 0:
                if evaluate():
                    stop_reason = "early_stopping"
                last_save = time.time()

        if stop_reason != "signal" and st["last_eval_step"] != st["step"]:
            evaluate()  # final state: validate and save
    if tb:
        tb.close()
    best_dir = ckpts.resolve("best")
    summary = {
        "stopped": stop_reason, "steps": st["step"], "epochs": st["epoch"], "monitor": task.monitor,
        "best": st["best"], "best_step": st["best_step"], "run_dir": str(run_dir),
        "last_checkpoint": str(ckpts.resolve("last")), "best_checkpoint": str(best_dir) if best_dir else None,
        "elapsed_s": time.time() - t0,
    }
    log(f"stopped ({stop_reason}) after {st['step']} steps; best {task.monitor} {st['best']} at step {st['best_step']}")
    return summary
