"""The one training loop, for every model family (bound to its data and metrics by a Task).

    train(recipe, run_dir, make_task(recipe))   # or: tellkit train CONFIG key=value ... --out RUN [--resume]

Read top to bottom: the building blocks (optimizer, schedule, batch plan, CSV log, stop
signal), then ``train`` and its :class:`Trainer`, one method per concern: ``setup`` (run folder,
task, model, data, optimizer, schedule, resumed state, logs), ``fit`` (epochs), ``step`` (one
optimizer step = ``accumulate`` micro-batches per process), ``log_step``, ``evaluate`` (at the
end of every ``eval_every_epochs``-th epoch, early stopping on ``task.monitor``) and ``save``.

Explicit choices:
- Loss normalisation: every micro-batch contributes ``loss * ntokens`` and the summed gradient is
  divided by the token count over all micro-batches and all processes, so a step over N
  processes x K micro-batches equals one step over the union of those batches in one process.
- Batches are planned per epoch from (seed, epoch) alone, and the position in the epoch is saved,
  so ``--resume`` skips exactly the batches already seen and, with the RNG states restored,
  continues bit-for-bit (on CPU; cuDNN / atomics may make GPU runs differ in the last bits).
- Under DDP each process takes every ``world``-th batch; an epoch's trailing batches that cannot
  be shared out evenly (fewer than ``world``) are dropped so every process does the same steps.
- Mixed precision (``train.amp``): on CUDA fp16 with a loss scaler, or bf16; on a CPU bf16 where
  it computes bf16 natively, else float32 with a log line (``tellkit.utils.precision``). Weights
  and optimiser state stay float32.
- Frozen encoders / cached features are the Task's business: only parameters with
  ``requires_grad`` reach the optimizer (see ``Task.param_groups``).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import os
import random
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tellkit.checkpoint import load_weights_into
from tellkit.config import check_recipe_sections, dump_yaml, read_yaml_file, to_dict
from tellkit.errors import TellkitError
from tellkit.recipes import RESERVED_CHECKPOINT_KEYS, TrainConfig, task_key, train_config
from tellkit.training import distributed
from tellkit.training.bert_adam import BertAdam
from tellkit.training.ema import EMA_FILE, WeightAverage, read_average
from tellkit.training.evaluation import autocast, make_loader, plain_batches, run_eval, to_device
from tellkit.training.run_states import CheckpointManager, SavedState, apply_state, fits_run
from tellkit.training.task import Task
from tellkit.utils import precision
from tellkit.utils.files import check_regular_file
from tellkit.utils.runlock import RunLock, hold_run

TRAIN_COLUMNS = ["step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "elapsed_s"]
EVAL_COLUMNS = ["step", "epoch", "split", "metric", "value"]


# --- small pieces ---------------------------------------------------------------------------
def build_optimizer(cfg: TrainConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise TellkitError("the model has no trainable parameters")
    if cfg.optimizer == "adamw":  # decoupled weight decay ("bert_adam"-style)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "bert_adam":  # the Transform and Tell reference's (training/bert_adam.py)

        return BertAdam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        max_grad_norm=cfg.max_grad_norm)
    if cfg.optimizer == "adam":  # L2 penalty added to the gradient
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    return torch.optim.Adadelta(groups, lr=cfg.lr, rho=cfg.rho, eps=cfg.eps, weight_decay=cfg.weight_decay)


class LRSchedule:
    """lr of each param group = its base lr x ``factor``; the state is three numbers (JSON)."""

    def __init__(self, cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int, mode: str,
                 steps_per_epoch: int = 1):
        self.cfg, self.opt, self.total, self.mode = cfg, optimizer, max(1, total_steps), mode
        self.base = [g["lr"] for g in optimizer.param_groups]
        # the stretch the warm-up and decay span: the whole run, or one cosine cycle
        self.cycle = self.total
        if cfg.scheduler == "cosine" and cfg.cycle_epochs is not None:
            self.cycle = max(1, int(round(cfg.cycle_epochs * steps_per_epoch)))
        self.warm = int(round(cfg.warmup * self.cycle)) if cfg.scheduler in ("linear_warmup", "cosine") else 0
        self.plateau_scale, self.plateau_best, self.plateau_bad = 1.0, None, 0

    def factor(self, step: int, epoch: int) -> float:
        """For the optimizer step numbered ``step`` (0-based) taken during ``epoch``."""
        s = self.cfg.scheduler
        if s == "linear_warmup":
            if step < self.warm:
                return (step + 1) / self.warm
            return max(0.0, (self.total - step) / max(1, self.total - self.warm))
        if s == "cosine":
            t = step % self.cycle
            if t < self.warm:
                return (t + 1) / self.warm
            done = (t - self.warm) / max(1, self.cycle - self.warm)
            floor = self.cfg.min_lr_ratio
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * done))
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

    def as_key(self, value: float | Sequence[float] | None) -> tuple[float, ...] | None:
        """A bare monitor value (states without tie-breakers, callers without them) as a signed key."""
        if value is None or isinstance(value, (list, tuple)):
            return None if value is None else tuple(value)
        return (float(value) if self.mode == "max" else -float(value),)

    def on_eval(self, key: float | Sequence[float]) -> None:
        """``key``: the monitor value, or ``Task.monitor_key`` (larger is better)."""
        if self.cfg.scheduler != "plateau":
            return
        key, best = self.as_key(key), self.as_key(self.plateau_best)
        if best is None or key > best:
            self.plateau_best, self.plateau_bad = list(key), 0
        else:
            self.plateau_bad += 1
            if self.plateau_bad > self.cfg.plateau_patience:
                self.plateau_scale *= self.cfg.plateau_factor
                self.plateau_bad = 0

    def state_dict(self) -> dict[str, Any]:
        return {"plateau_scale": self.plateau_scale, "plateau_best": self.plateau_best, "plateau_bad": self.plateau_bad}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.plateau_scale = d["plateau_scale"]
        self.plateau_best = d["plateau_best"]
        self.plateau_bad = d["plateau_bad"]


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


def batch_plan_digest(batches: list[list[int]]) -> str:
    """A short digest of an epoch's batches, saved with the state so a resume can tell whether it
    continues the same order."""
    flat = [[int(i) for i in b] for b in batches]
    return hashlib.sha1(json.dumps(flat, separators=(",", ":")).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _writing(run_dir: Path):
    """Start-up writes into the run folder: an OSError (a full disk, no permission, a read-only
    or pseudo file system such as /proc) is one line."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or run_dir
        raise TellkitError(f"cannot write the run folder {run_dir} ({where}: {exc.strerror or exc})") from None


def logged_train_seconds(train_log: Path) -> float:
    """Wall seconds of training in a run's ``train_log.csv`` over every process that trained it:
    ``elapsed_s`` goes on across resumes (:attr:`TrainerState.seconds`), except after states saved
    without that clock (states without ``seconds``), where it starts again at zero; each such restart adds the
    previous process's last value. 0.0 for a missing or column-less log."""
    total = last = 0.0
    try:
        check_regular_file(train_log, "train_log.csv")  # never opens a FIFO or a device
        with open(train_log, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                try:
                    value = float(row.get("elapsed_s") or "")
                except ValueError:
                    continue
                if value < last:
                    total += last
                last = value
    except (OSError, csv.Error, UnicodeDecodeError, TellkitError):
        return 0.0
    return total + last


class _CsvLog:
    """Append-only CSV; on resume, rows after the resumed step are dropped (they are redone)."""

    def __init__(self, path: Path, columns: list[str], keep_until_step: int | None):
        self.path, self.columns = path, columns
        if keep_until_step is not None and path.exists():
            check_regular_file(path, path.name)  # a FIFO or device in its place would hang or never end
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
        from torch.utils.tensorboard import SummaryWriter  # optional
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
    import numpy as np  # heavy

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --- the loop ---------------------------------------------------------------------------------
@dataclass
class TrainerState:
    """Everything about the run's progress that a checkpoint stores (``trainer_state.json``)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    pos: int = 0  # global batches of this epoch already used (over all processes)
    best: float | None = None
    best_key: list[float] | None = None  # Task.monitor_key of the best evaluation
    best_step: int | None = None
    bad_evals: int = 0
    last_eval_step: int | None = None
    world: int = 1
    plan: str | None = None  # batch_plan_digest of the current epoch's batches
    window_loss: float = 0.0  # loss x tokens summed since the last log row (restored on resume,
    window_tokens: float = 0.0  # so the first row after a resume equals the unbroken run's)
    seconds: float = 0.0  # wall seconds of training up to this state, over all resumed processes


def train(
    recipe: Mapping[str, Any],
    run_dir: str | os.PathLike,
    task: Task,
    *,
    resume: bool = False,
    device: str | None = None,
    save_every_steps: int | None = None,
    save_every_minutes: float | None = 30.0,
    keep_checkpoints: int = 0,
    progress: bool = True,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Train ``recipe`` into ``run_dir`` with ``task`` (built from the recipe, see
    :func:`tellkit.tasks.make_task`); returns a summary (steps, best metric, checkpoints).
    ``deadline``: a ``time.time()`` at which the run saves its state and stops (reason "time",
    no final validation), for runs on a machine lent for a fixed time."""
    if save_every_steps is not None and (isinstance(save_every_steps, bool) or int(save_every_steps) < 1):
        raise TellkitError(f"--save-every-steps must be a positive number of steps, got {save_every_steps}")
    if save_every_minutes is not None and not float(save_every_minutes) > 0:
        raise TellkitError(f"--save-every-minutes must be positive (or 0 for off), got {save_every_minutes}")
    if isinstance(keep_checkpoints, bool) or int(keep_checkpoints) < 0:
        raise TellkitError(f"--keep-checkpoints must be a whole number >= 0, got {keep_checkpoints}")
    check_recipe_sections(recipe)
    cfg = train_config(recipe)
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TellkitError(f"--out {run_dir}: exists and is not a folder")
    dist = distributed.setup(device)
    trainer = None
    try:
        trainer = Trainer(recipe, cfg, run_dir, dist, resume=resume, task=task, save_every_steps=save_every_steps,
                          save_every_minutes=save_every_minutes, keep_checkpoints=keep_checkpoints,
                          progress=progress, deadline=deadline)
        return trainer.setup().fit()
    finally:
        if trainer is not None and trainer.lock is not None:
            trainer.lock.release()
        distributed.teardown(dist)


class Trainer:
    """One run: ``setup`` (run folder, task, model, data, optimizer, schedule, resumed state,
    logs), then ``fit``: epochs of ``step`` (one optimizer step over ``accumulate``
    micro-batches per process), ``evaluate`` at epoch ends (best / early stopping), ``save``
    (periodic, on SIGTERM, after each evaluation) and ``log`` (console, CSV, TensorBoard)."""

    def __init__(self, recipe: Mapping[str, Any], cfg: TrainConfig, run_dir: Path, dist: distributed.DistInfo, *,
                 task: Task, resume: bool = False, save_every_steps: int | None = None,
                 save_every_minutes: float | None = 30.0, keep_checkpoints: int = 0, progress: bool = True,
                 deadline: float | None = None):
        self.recipe, self.cfg, self.run_dir, self.dist = recipe, cfg, run_dir, dist
        self.deadline = deadline
        self.resume, self.task, self.progress = resume, task, progress
        self.save_every_steps, self.save_every_minutes = save_every_steps, save_every_minutes
        self.ckpts = CheckpointManager(run_dir, keep=keep_checkpoints)
        self.state = TrainerState(world=dist.world)
        self.t0, self.seconds_before = time.time(), 0.0
        self.resolved = json.loads(json.dumps({**dict(recipe), "train": to_dict(cfg)}))  # plain YAML/JSON types
        if "task" in self.resolved:  # checkpoints name their task by its key, never by a former name
            self.resolved["task"] = task_key(self.resolved["task"], "the recipe's task:")
        self.saved: SavedState | None = None
        self.tb = self.train_csv = self.eval_csv = None
        self.lock: RunLock | None = None  # the run folder's owner lock (main process)

    def log(self, msg: str) -> None:
        if self.dist.is_main:
            print(f"[tellkit train] {msg}", flush=True)

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> Trainer:
        self._open_run_dir()
        self._build()
        self._restore_or_seed()
        self._open_logs()
        return self

    def _open_run_dir(self) -> None:
        run_dir, dist = self.run_dir, self.dist
        if dist.is_main and run_dir.is_dir():  # before anything is read: a second run is refused here
            self.lock = hold_run(run_dir)
        if self.resume:  # the state itself is chosen once the model is built (_restore_or_seed)
            if not self.ckpts.holds_run():
                raise TellkitError(f"--resume: no intact checkpoint under {self.ckpts.dir} (none saved)")
            cfg_file = run_dir / "config.yaml"
            if cfg_file.is_file():
                try:  # the bounds of a recipe: a run folder may come from elsewhere
                    saved = read_yaml_file(cfg_file, "run config")
                except TellkitError as exc:
                    raise TellkitError(f"--resume: {exc}") from None
                if not isinstance(saved, dict):
                    raise TellkitError(f"--resume: {cfg_file} holds no recipe "
                                       f"(a {type(saved).__name__}, not a mapping)")
                if "task" in saved:
                    saved["task"] = task_key(saved["task"], f"{cfg_file}: task:")
                diff = sorted(str(k) for k in set(saved) | set(self.resolved) if saved.get(k) != self.resolved.get(k))
                if diff:
                    raise TellkitError("--resume: the config differs from the run's saved config.yaml "
                                       f"in section(s) {', '.join(diff)}")
        elif self.ckpts.holds_run():
            raise TellkitError(f"{run_dir} already holds a run: pass --resume to continue it, or choose another --out")
        # every section but the model (which config.json holds already) goes to the top level of
        # config.json, so `tellkit evaluate` / `caption` / `serve` rebuild the task from it alone
        self.task.check_training()  # settings that matter to training only, before anything is written
        reserved = set(RESERVED_CHECKPOINT_KEYS) & set(self.resolved)
        if reserved:
            raise TellkitError(f"recipe sections {sorted(reserved)} clash with checkpoint metadata names")
        if dist.is_main:
            if self.ckpts.dir.exists() and not self.ckpts.dir.is_dir():
                raise TellkitError(f"{self.ckpts.dir}: exists and is not a folder (the run's checkpoints go "
                                   "there); move it or choose another --out")
            with _writing(run_dir):
                run_dir.mkdir(parents=True, exist_ok=True)
                if self.lock is None:  # a new folder: two runs started at once race to lock it
                    self.lock = hold_run(run_dir)
                    if not self.resume and self.ckpts.holds_run():
                        raise TellkitError(f"{run_dir} already holds a run: pass --resume to continue it, "
                                           "or choose another --out")
                (run_dir / "config.yaml").write_text(dump_yaml(self.resolved), encoding="utf-8")

    def _build(self) -> None:
        cfg, dist = self.cfg, self.dist
        _seed_all(cfg.seed)  # identical initial weights on every process
        task = self.task
        try:
            model = task.build_model()
        except TellkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - a model section the family cannot build
            raise TellkitError(f"the model does not build from the recipe's model section "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        if cfg.init_from and not self.resume:

            source = load_weights_into(model, cfg.init_from)
            self.log(f"initial weights from {source}")
            report = getattr(model, "init_report", None)
            if report:  # weights of another family (CoMER from BTTR)
                self.log(f"{len(report['copied'])} tensors copied, {len(report['new'])} new: "
                         + ", ".join(report["new"]))
            if task.restore_checkpoint_files(source):
                self.log(f"encoder state from {source} (what the run saved beside its model)")
        self.model = model.to(dist.device)
        task.progress = self.progress and self.dist.is_main
        self.train_set = task.build_dataset("train")
        val_set = task.build_dataset("val")
        if len(self.train_set) == 0:
            raise TellkitError("the training set is empty")
        self.val_set = None if val_set is None or len(val_set) == 0 else val_set
        if self.val_set is None:
            self.log("no validation set: no early stopping, the last state is also the best")
        self.optimizer = build_optimizer(cfg, task.param_groups(model, cfg.lr))
        n_batches = len(epoch_batches(task, self.train_set, cfg, 0, dist.world))
        if n_batches == 0:
            raise TellkitError(f"the training set gives fewer batches than processes ({dist.world})")
        self.steps_per_epoch = math.ceil(n_batches / dist.world / cfg.accumulate)
        self.total_steps = cfg.max_steps or self.steps_per_epoch * cfg.max_epochs
        self.schedule = LRSchedule(cfg, self.optimizer, self.total_steps, task.monitor_mode, self.steps_per_epoch)
        amp = precision.resolve(dist.device, cfg.amp_dtype)
        if amp.note:
            self.log(f"train.amp={cfg.amp}: {amp.note}")
        self.amp_dtype = amp.dtype
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == "float16" else None
        self.extra = {**{k: v for k, v in self.resolved.items() if k != "model"}, "task": task.name}
        self.log(
            f"{type(model).__name__} on {dist.device} x{dist.world}: "
            f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters; "
            f"{len(self.train_set)} train / {len(self.val_set) if self.val_set is not None else 0} val samples; "
            f"{self.steps_per_epoch} steps per epoch, {self.total_steps} in all; "
            f"mixed precision {self.amp_dtype or 'off'}"
        )

    def _restore_or_seed(self) -> None:
        st, dist = self.state, self.dist
        where = None
        if self.resume:
            def epoch_length(epoch: int) -> int:
                return len(epoch_batches(self.task, self.train_set, self.cfg, epoch, dist.world))

            self.saved = self.ckpts.find_resume(dist.rank, dist.world, dist.broadcast,
                                                check=fits_run(self.model, self.optimizer, epoch_length))
            if self.saved.problems:
                self.log(f"warning: {'; '.join(self.saved.problems)}; resuming from {self.saved.directory.name}")
        if self.saved is None:
            _seed_all(self.cfg.seed * 7919 + dist.rank)  # per-process randomness (dropout) from here on
        else:
            where = self.saved.directory
            saved = apply_state(self.saved, self.model, self.optimizer)
            try:
                for f in fields(TrainerState):
                    if saved.get(f.name) is not None or f.name in ("best", "best_step", "last_eval_step"):
                        setattr(st, f.name, saved.get(f.name, getattr(st, f.name)))
                self.schedule.load_state_dict(saved["schedule"])
                if self.scaler is not None and saved.get("scaler"):
                    self.scaler.load_state_dict(saved["scaler"])
            except (KeyError, TypeError, ValueError) as exc:
                raise TellkitError(f"{where}: the trainer state does not fit this run ({exc})") from exc
            if saved.get("world") != dist.world:
                self.log(f"resuming with {dist.world} processes, saved with {saved.get('world')}: "
                         "data order continues, RNG streams do not")
            if saved.get("rng_restored") is False:
                _seed_all(self.cfg.seed * 7919 + dist.rank + st.step)
            st.world = dist.world
            self.saved = None  # free the tensors read from disk
            self.task.restore_checkpoint_files(where)
            self.log(f"resumed from {where} (step {st.step}, epoch {st.epoch}, batch {st.pos})")
        self.ema = None if self.cfg.ema is None else self._start_average(where if self.resume else None)
        self.ddp_model = self.model
        if dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP  # heavy

            ids = [dist.device.index] if dist.device.type == "cuda" else None
            self.ddp_model = DDP(self.model, device_ids=ids,
                                 find_unused_parameters=self.task.ddp_find_unused_parameters)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def _start_average(self, resumed_from: Path | None) -> WeightAverage:
        """``train.ema``: the average of a resumed state, else one that starts from the weights now."""
        ema = WeightAverage(self.model, self.cfg.ema)
        saved = read_average(resumed_from) if resumed_from is not None else None
        if saved is not None:
            ema.load_state_dict(saved, str(resumed_from / EMA_FILE))
        elif resumed_from is not None:
            self.log(f"{resumed_from} holds no averaged weights: the average starts from the resumed weights")
        return ema

    def _open_logs(self) -> None:
        with _writing(self.run_dir):
            self._open_log_files()

    def _open_log_files(self) -> None:
        if self.dist.is_main:
            keep = self.state.step if self.resume else 0  # a fresh start drops rows of a run that saved nothing
            self.train_csv = _CsvLog(self.run_dir / "train_log.csv", TRAIN_COLUMNS, keep)
            self.eval_csv = _CsvLog(self.run_dir / "eval_log.csv", EVAL_COLUMNS, keep)
            self.tb = _tensorboard(self.run_dir, self.log)

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        st, cfg = self.state, self.cfg
        self.t0 = self.last_save = self.window_start = time.time()
        self.seconds_before = st.seconds  # a resumed run's clock goes on from its saved state
        stop = None
        with _StopSignal() as stop_signal:
            while stop is None:
                if st.epoch >= cfg.max_epochs:
                    stop = "max_epochs"
                    break
                if cfg.max_steps is not None and st.step >= cfg.max_steps:
                    stop = "max_steps"
                    break
                stop = self._epoch(stop_signal)
                if stop is not None:
                    break
                st.epoch += 1
                st.pos = 0
                if st.epoch % cfg.eval_every_epochs == 0:
                    if self.evaluate():
                        stop = "early_stopping"
                    self.last_save = time.time()
            if stop not in ("signal", "time") and st.last_eval_step != st.step:
                self.evaluate()  # final state: validate and save
        if self.tb:
            self.tb.close()
        best_dir = self.ckpts.resolve("best")
        last_dir = self.ckpts.resolve("last")
        summary = {
            "stopped": stop, "steps": st.step, "epochs": st.epoch, "monitor": self.task.monitor,
            "best": st.best, "best_step": st.best_step, "run_dir": str(self.run_dir),
            "last_checkpoint": str(last_dir) if last_dir else None,
            "best_checkpoint": str(best_dir) if best_dir else None,
            "elapsed_s": self.elapsed(),
        }
        self.log(f"stopped ({stop}) after {st.step} steps; best {self.task.monitor} {st.best} at step {st.best_step}")
        return summary

    def _epoch(self, stop_signal: _StopSignal) -> str | None:
        """The rest of the current epoch; a stop reason, or None when the epoch is done."""
        st, cfg, dist = self.state, self.cfg, self.dist
        batches = epoch_batches(self.task, self.train_set, cfg, st.epoch, dist.world)
        plan = batch_plan_digest(batches)
        if st.pos and st.plan is not None and st.plan != plan and dist.is_main:
            self.log(f"warning: the batches of epoch {st.epoch} differ from those this run was saved with "
                     f"(the data, its order or the batching changed; {len(batches)} batches now): the epoch "
                     f"goes on from batch {st.pos} of the new order, so this epoch may see some samples "
                     "twice and others not at all; later epochs are whole")
        st.plan = plan
        mine = batches[st.pos + dist.rank :: dist.world]
        loader = make_loader(self.task, self.train_set, mine, cfg.num_workers,
                             cfg.seed * 1_000_003 + st.epoch * 1009 + st.pos, dist.device.type == "cuda")
        it = iter(loader)
        bar = None
        if self.progress and dist.is_main:
            bar = tqdm(total=math.ceil(len(batches) / dist.world / cfg.accumulate),
                       initial=st.pos // dist.world // cfg.accumulate, desc=f"epoch {st.epoch}", dynamic_ncols=True)
        try:
            while True:
                group = list(islice(it, cfg.accumulate))
                if not group:
                    return None
                loss, tokens, gnorm, lr = self.step(group)
                self.log_step(loss, tokens, gnorm, lr, bar)
                if cfg.max_steps is not None and st.step >= cfg.max_steps:
                    return "max_steps"
                # collectives on every rank, every step: all processes must agree to save / stop
                stop_now = dist.any(stop_signal.requested)
                out_of_time = dist.any(self.deadline is not None and time.time() >= self.deadline)
                timed = dist.any(self.save_every_minutes is not None
                                 and time.time() - self.last_save >= 60 * self.save_every_minutes)
                if stop_now or out_of_time or timed or (self.save_every_steps and st.step % self.save_every_steps == 0):
                    self.save()
                    self.last_save = time.time()
                    if stop_now or out_of_time:
                        return "signal" if stop_now else "time"
        finally:
            if bar is not None:
                bar.close()

    def step(self, group: list[dict[str, Any]]) -> tuple[float, float, torch.Tensor, float]:
        """One optimizer step over ``group`` (this process's micro-batches); returns the
        token-weighted loss sum and token count over all processes, the gradient norm, the lr."""
        st, dist, scaler, optimizer = self.state, self.dist, self.scaler, self.optimizer
        lr = self.schedule.apply(st.step, st.epoch)
        self.model.train()
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), dtype=torch.float64, device=dist.device)
        step_tok = torch.zeros((), dtype=torch.float64, device=dist.device)
        for i, batch in enumerate(group):
            batch = self.task.training_batch(self.task.on_device(to_device(batch, dist.device), self.model),
                                             self.model)
            sync = i == len(group) - 1
            with (self.ddp_model.no_sync() if dist.enabled and not sync else nullcontext()):
                with autocast(dist.device, self.amp_dtype):
                    out = self.ddp_model(batch)
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
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        clip = self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        elif torch.isfinite(gnorm):
            optimizer.step()
        else:
            self.log(f"step {st.step}: non-finite gradient norm, step skipped")
        if self.ema is not None:
            self.ema.update(self.model)
        st.step += 1
        st.pos += len(group) * dist.world
        return float(totals[0]), float(totals[1]), gnorm, lr

    def log_step(self, loss: float, tokens: float, gnorm: torch.Tensor, lr: float, bar=None) -> None:
        """Add a step to the logging window; every ``log_every`` steps write a row and reset it."""
        st, cfg = self.state, self.cfg
        st.window_loss += loss
        st.window_tokens += tokens
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss / max(1.0, tokens):.3f}", lr=f"{lr:.2e}")
        if st.step % cfg.log_every:
            return
        if self.dist.is_main:
            dt = max(1e-9, time.time() - self.window_start)
            row = {"step": st.step, "epoch": st.epoch, "loss": st.window_loss / max(1.0, st.window_tokens), "lr": lr,
                   "grad_norm": float(gnorm), "tokens": int(st.window_tokens), "tokens_per_s": st.window_tokens / dt,
                   "elapsed_s": self.elapsed()}
            self.train_csv.write(row)
            extra = self.task.training_stats()
            if self.tb:
                for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
                    self.tb.add_scalar(f"train/{k}", row[k], st.step)
                for k, v in extra.items():
                    self.tb.add_scalar(f"train/{k}", v, st.step)
            if bar is None:
                more = "".join(f" {k} {v:.4g}" for k, v in extra.items())
                self.log(f"step {st.step} epoch {st.epoch}: loss {row['loss']:.4f} lr {lr:.3g} "
                         f"|g| {row['grad_norm']:.3g}{more}")
        st.window_loss = st.window_tokens = 0.0
        self.window_start = time.time()

    # -- validation and checkpoints -----------------------------------------------------------
    def evaluate(self) -> bool:
        """Validate, update best / early stopping, save. True when training should stop."""
        st, task, dist = self.state, self.task, self.dist
        st.last_eval_step = st.step
        if self.val_set is None:
            self.save(best=True)
            return False
        metrics, _ = run_eval(task, self.model, self.val_set, "val", dist, batch_size=self.cfg.batch_size,
                              num_workers=self.cfg.num_workers, amp_dtype=self.amp_dtype,
                              generate=task.monitor != "loss", progress=self.progress)
        key = task.monitor_key(metrics)  # a missing monitor is a one-line error, not a KeyError
        value = metrics[task.monitor]
        # ties on the monitor go to the tie-breakers; a state saved before them holds only ``best``
        best_key = st.best_key or (None if st.best is None else self.schedule.as_key(st.best))
        better = best_key is None or key > tuple(best_key)
        if better:
            st.best, st.best_key, st.best_step, st.bad_evals = value, list(key), st.step, 0
        else:
            st.bad_evals += 1
        self.schedule.on_eval(key)
        if self.ema is not None:  # the averaged weights, validated beside the raw ones (logged, not chosen on)
            with self.ema.applied(self.model):
                averaged, _ = run_eval(task, self.model, self.val_set, "val", dist, batch_size=self.cfg.batch_size,
                                       num_workers=self.cfg.num_workers, amp_dtype=self.amp_dtype,
                                       generate=task.monitor != "loss", progress=self.progress)
            metrics = {**metrics, **{f"ema_{k}": v for k, v in averaged.items()}}
        if dist.is_main:
            for k, v in metrics.items():
                if v is None:  # undefined (an entity ratio of 0/0): not logged
                    continue
                self.eval_csv.write({"step": st.step, "epoch": st.epoch, "split": "val", "metric": k, "value": v})
                if self.tb:
                    self.tb.add_scalar(f"val/{k}", v, st.step)
            shown = ", ".join(f"{k} {v:.4g}" if v is not None else f"{k} -" for k, v in metrics.items())
            self.log(f"step {st.step} epoch {st.epoch}: val {shown}"
                     + ("  (best)" if better else f"  ({st.bad_evals} without improvement)"))
        self.save(best=better)
        return self.cfg.patience is not None and st.bad_evals >= self.cfg.patience

    def elapsed(self) -> float:
        """Wall seconds of training so far, those of the processes this run resumed from included."""
        return self.seconds_before + time.time() - self.t0

    def save(self, best: bool = False) -> Path:
        """A complete state (model, optimizer, RNGs, trainer state) as the new ``last``."""
        self.state.seconds = self.elapsed()
        trainer_state = {**asdict(self.state), "schedule": self.schedule.state_dict(),
                         "scaler": self.scaler.state_dict() if self.scaler else None}
        files = self.task.checkpoint_files() if self.dist.is_main else None
        if self.ema is not None and self.dist.is_main:
            files = {**(files or {}), EMA_FILE: self.ema.state_dict()}
        return self.ckpts.save(self.state.step, self.model, self.optimizer, trainer_state,
                               extra=self.task.checkpoint_meta(self.extra), files=files,
                               rank=self.dist.rank, agree=self.dist.any, best=best)
