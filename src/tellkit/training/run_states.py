"""Full training-state checkpoints that survive crashes, and resume from them.

A run keeps its checkpoints under ``RUN/checkpoints/``::

    step_00001200/            one complete state (a loadable tellkit model checkpoint, plus:)
        config.json model.safetensors      the model (``tellkit.checkpoint.save_model``)
        optimizer.safetensors optimizer.json   optimizer tensors / everything else
        rng_rank<R>.safetensors rng_rank<R>.json   torch/CUDA/numpy/python RNG of each process
        trainer_state.json                 step, epoch, data position, schedule, loss scaler,
                                           best, the open loss-logging window
    step_00001200-1/          the same step saved again (end of epoch after a periodic save)
    last -> step_00001200-1   symbolic links, each replaced atomically
    best -> step_00001000

Crash safety: a state is written into ``step_N.tmp/``, every file is fsynced, the folder is
renamed to a name that does not exist yet (``step_N``, else ``step_N-1``, ``-2`` ...), and only
then do ``last`` (and ``best``) move (``os.replace`` of a link is atomic). A folder is deleted
only once no link points at it. So a kill at any instant leaves ``last`` pointing at a complete
state; leftover ``*.tmp`` folders are removed by the next save. Besides ``last`` and ``best``, the
states of the ``keep`` newest steps stay (``tellkit train --keep-checkpoints N``, for weight averaging with
``tellkit average``); older ones are deleted, but never while a reader (``tellkit export``,
``average``, ``evaluate``) holds the run's states (:mod:`tellkit.utils.runlock`): then they stay
until a later save. A failed write (disk full)
removes the temporary folder and raises a one-line error; the previous state is untouched.

Resume (:meth:`CheckpointManager.find_resume`) reads ``last``; when it is missing, dangling or
damaged (unreadable JSON, truncated tensors, missing optimizer or RNG files, non-finite values,
numbers out of range: a step or epoch no run reaches, an epoch past its steps, a learning rate
that is not a finite number >= 0, a world of 0 processes) it falls back to the newest intact
state, naming what was wrong, or stops with one line.

Nothing here unpickles: tensors are read with safetensors, everything else is JSON.
"""
from __future__ import annotations

import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tellkit.checkpoint import (
    WEIGHTS_NAME,
    check_state_dict,
    read_checkpoint_config,
    read_json_file,
    save_model,
    write_tensor_files,
)
from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_bytes, atomic_write_json, begin_save, fault_point
from tellkit.utils.runlock import pruning

STATE_NAME = "trainer_state.json"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{8})(?:-(\d+))?$")
_MAX_STATE_JSON = 256 << 20  # optimizer.json lists every parameter id: larger than a model config


class DamagedCheckpoint(TellkitError):
    """A checkpoint folder that cannot be resumed from; the message says what is wrong."""


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError  # heavy
    from safetensors.torch import load_file  # heavy

    if not path.is_file():
        raise DamagedCheckpoint(f"{path.name} missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DamagedCheckpoint(f"{path.name} unreadable ({first})") from exc


def _read_json(path: Path) -> Any:
    try:
        return read_json_file(path, path.name, _MAX_STATE_JSON)
    except TellkitError as exc:
        raise DamagedCheckpoint(str(exc).replace(str(path.parent) + os.sep, "")) from exc


# a saved count past these is damage, not progress (2**40 steps would take a thousand years at 30 steps/s)
MAX_SAVED_STEP = 2**40
MAX_SAVED_EPOCH = 10**6


def _check_numbers(obj: Any, file: str, where: str = "") -> None:
    """Every number in ``obj`` (nested JSON) finite; a :class:`DamagedCheckpoint` naming the first
    that is not (NaN, infinity, or an integer too large for a float)."""
    stack: list[tuple[str, Any]] = [(where, obj)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{key}.{k}" if key else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{key}[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                ok = math.isfinite(v)
            except OverflowError:
                ok = False
            if not ok:
                raise DamagedCheckpoint(f"{file}: '{key}' is {v!r}, not a finite number")


def _check_finite(tensors: dict[str, torch.Tensor], file: str) -> None:
    for k, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise DamagedCheckpoint(f"{file}: tensor {k} holds NaN or infinite values")


# --- optimizer state: tensors -> safetensors, the rest -> JSON --------------------------------
def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    from safetensors.torch import save  # heavy

    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}/{name}"] = v.detach().cpu().contiguous()
            else:
                plain.setdefault(str(pid), {})[name] = v
    atomic_write_bytes(directory / "optimizer.safetensors", save(tensors))
    atomic_write_json(directory / "optimizer.json", {"state": plain, "param_groups": sd["param_groups"]})


def read_optimizer(directory: Path) -> dict[str, Any]:
    """The optimizer's state dict as saved, checked for readability (not yet applied)."""
    meta = _read_json(directory / "optimizer.json")
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict) \
            or not isinstance(meta.get("param_groups"), list):
        raise DamagedCheckpoint("optimizer.json: not an optimizer state")
    _check_numbers(meta, "optimizer.json")
    for i, group in enumerate(meta["param_groups"]):
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise DamagedCheckpoint(f"optimizer.json: parameter group {i} has learning rate {lr!r}")
    tensors = _load_tensors(directory / "optimizer.safetensors")
    _check_finite(tensors, "optimizer.safetensors")
    state: dict[int, dict[str, Any]] = {}
    try:
        for key, t in tensors.items():
            pid, name = key.split("/", 1)
            state.setdefault(int(pid), {})[name] = t
        for pid, st in meta["state"].items():
            state.setdefault(int(pid), {}).update(st)
    except (ValueError, TypeError, AttributeError) as exc:
        raise DamagedCheckpoint(f"optimizer state: malformed ({exc})") from exc
    return {"state": state, "param_groups": meta["param_groups"]}


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    _apply_optimizer(optimizer, read_optimizer(directory), directory)


def _apply_optimizer(optimizer: torch.optim.Optimizer, sd: dict[str, Any], directory: Path) -> None:
    try:
        optimizer.load_state_dict(sd)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise TellkitError(f"{directory}: the optimizer state does not fit this run ({exc})") from exc


# --- random number generators -----------------------------------------------------------------
def save_rng(directory: Path, rank: int) -> None:
    from safetensors.torch import save  # heavy

    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64))
    py_version, py_state, py_gauss = random.getstate()
    atomic_write_bytes(directory / f"rng_rank{rank}.safetensors", save(tensors))
    atomic_write_json(
        directory / f"rng_rank{rank}.json",
        {"numpy": [kind, int(pos), int(has_gauss), float(cached)], "python": [py_version, list(py_state), py_gauss]},
    )


def read_rng(directory: Path, rank: int, saved_world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Process ``rank``'s saved RNG state; None when the run was saved with fewer processes."""
    names = (f"rng_rank{rank}.safetensors", f"rng_rank{rank}.json")
    present = [(directory / n).is_file() for n in names]
    if not any(present) and rank >= saved_world:
        return None
    for n, ok in zip(names, present):
        if not ok:
            raise DamagedCheckpoint(f"{n} missing")
    tensors = _load_tensors(directory / names[0])
    meta = _read_json(directory / names[1])
    try:
        kind, pos, has_gauss, cached = meta["numpy"]
        version, state, gauss = meta["python"]
        if "torch" not in tensors or "numpy_keys" not in tensors or not isinstance(state, list):
            raise KeyError("torch / numpy_keys / python state")
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedCheckpoint(f"{names[1]}: not an RNG state ({exc})") from exc
    return tensors, meta


def _apply_rng(rng: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    tensors, meta = rng
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda")), key=lambda k: int(k[4:]))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))


def load_rng(directory: Path, rank: int) -> bool:
    """Restore this process's RNG state; False when the checkpoint has none for ``rank``."""
    rng = read_rng(directory, rank, saved_world=rank)
    if rng is None:
        return False
    _apply_rng(rng)
    return True


# --- one saved state, read and checked before anything is changed ----------------------------
@dataclass
class SavedState:
    directory: Path
    trainer: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    problems: list[str] = field(default_factory=list)  # damaged newer states skipped on the way


def read_state(directory: Path, rank: int = 0, world: int = 1) -> SavedState:
    """Read every file of a state (``rank``'s RNG; on rank 0 also check that the RNG files of
    every other process of a ``world``-process run are there). :class:`DamagedCheckpoint` when
    anything is missing, unreadable or non-finite."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DamagedCheckpoint(f"{directory.name} does not exist")
    trainer = _read_json(directory / STATE_NAME)
    if not isinstance(trainer, dict):
        raise DamagedCheckpoint(f"{STATE_NAME}: not a mapping")
    for key, high in (("step", MAX_SAVED_STEP), ("epoch", MAX_SAVED_EPOCH), ("pos", MAX_SAVED_STEP)):
        v = trainer.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= high:
            raise DamagedCheckpoint(f"{STATE_NAME}: '{key}' is {v!r}, not a count (0 to {high:,})")
    if trainer["epoch"] > trainer["step"]:  # every epoch takes at least one optimizer step
        raise DamagedCheckpoint(f"{STATE_NAME}: epoch {trainer['epoch']} after only {trainer['step']} steps")
    if not isinstance(trainer.get("schedule"), dict):
        raise DamagedCheckpoint(f"{STATE_NAME}: no schedule state")
    _check_numbers(trainer, STATE_NAME)
    saved_world = trainer.get("world", 1)
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or not 1 <= saved_world <= 65_536:
        raise DamagedCheckpoint(f"{STATE_NAME}: 'world' is {saved_world!r}, not a number of processes")
    try:
        read_checkpoint_config(directory)
    except TellkitError as exc:
        msg = str(exc).replace(str(directory) + os.sep, "").replace(str(directory), directory.name)
        raise DamagedCheckpoint(msg) from exc
    weights = _load_tensors(directory / WEIGHTS_NAME)
    _check_finite(weights, WEIGHTS_NAME)
    optimizer = read_optimizer(directory)
    rng = read_rng(directory, rank, saved_world)
    if rank == 0:
        for r in range(1, min(world, saved_world)):
            read_rng(directory, r, saved_world)
    return SavedState(directory, trainer, weights, optimizer, rng)


def apply_state(saved: SavedState, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Put a read state into ``model`` / ``optimizer`` / this process's RNGs; the trainer state."""
    check_state_dict(model, saved.weights, str(saved.directory), finite=False)
    model.load_state_dict(saved.weights, strict=False)
    if optimizer is not None:
        _apply_optimizer(optimizer, saved.optimizer, saved.directory)
    state = dict(saved.trainer)
    if saved.rng is None:
        state["rng_restored"] = False
    else:
        _apply_rng(saved.rng)
    return state


def fits_run(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             epoch_length: Callable[[int], int]) -> Callable[[SavedState], None]:
    """A ``check`` for :meth:`CheckpointManager.find_resume`: every saved weight has its model
    tensor's shape, every per-parameter optimizer tensor its parameter's shape, and the data
    position is within its epoch (``epoch_length(epoch)``: the batches of that epoch)."""
    own = model.state_dict()

    def check(saved: SavedState) -> None:
        for k, t in saved.weights.items():
            if k in own and tuple(t.shape) != tuple(own[k].shape):
                raise DamagedCheckpoint(f"{WEIGHTS_NAME}: tensor {k} has shape {list(t.shape)}, "
                                        f"the model's is {list(own[k].shape)}")
        if optimizer is not None:
            _check_optimizer_shapes(optimizer, saved.optimizer)
        step, epoch, pos = saved.trainer["step"], saved.trainer["epoch"], saved.trainer["pos"]
        n = epoch_length(epoch)
        if pos > n:
            raise DamagedCheckpoint(f"{STATE_NAME}: data position {pos} is past the {n} batches of epoch {epoch}")
        if step > (epoch + 1) * max(n, epoch_length(0)) * 2:  # an optimizer step takes at least one batch
            raise DamagedCheckpoint(f"{STATE_NAME}: step {step:,} is more than epoch {epoch} and batch {pos} "
                                    "could have taken")

    return check


def _check_optimizer_shapes(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    groups = sd.get("param_groups") or []
    if len(groups) != len(optimizer.param_groups):
        raise DamagedCheckpoint(f"optimizer.json: {len(groups)} parameter groups, the run has "
                                f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(groups, optimizer.param_groups):
        ids = saved_group.get("params") if isinstance(saved_group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            raise DamagedCheckpoint("optimizer.json: the parameter groups do not fit the run")
        for pid, param in zip(ids, group["params"]):
            for name, t in sd["state"].get(pid, {}).items():
                if isinstance(t, torch.Tensor) and t.dim() and tuple(t.shape) != tuple(param.shape):
                    raise DamagedCheckpoint(f"optimizer.safetensors: {pid}/{name} has shape {list(t.shape)}, "
                                            f"its parameter's is {list(param.shape)}")


# --- the folder of states ---------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(link: Path, target_name: str) -> None:
    """Atomically make ``link`` a relative symlink to ``target_name`` (a sibling folder)."""
    tmp = link.with_name(link.name + f".tmp{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


def _order(path: Path) -> tuple[int, int]:
    m = STEP_DIR.match(path.name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (-1, -1)


class CheckpointManager:
    """Writes, points at, prunes and finds the full-state checkpoints of one run."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 0):
        self.dir = Path(run_dir) / "checkpoints"
        self.keep = int(keep)

    # -- finding ---------------------------------------------------------------------------
    def _link_name(self, name: str) -> str | None:
        link = self.dir / name
        if link.is_symlink():
            return Path(os.readlink(link)).name
        return name if link.is_dir() else None

    def resolve(self, name: str = "last") -> Path | None:
        """The state ``name`` points at, when it looks complete (else None)."""
        target = self._link_name(name)
        if target is None:
            return None
        path = self.dir / target
        return path.resolve() if (path / STATE_NAME).is_file() else None

    def states(self) -> list[Path]:
        """Every saved state folder, newest first (half-written ``*.tmp`` folders excluded)."""
        if not self.dir.is_dir():
            return []
        found = (p for p in self.dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir())
        return sorted(found, key=_order, reverse=True)

    def newest_steps(self, n: int) -> list[Path]:
        """The states of the ``n`` newest steps, newest first, one per step (a step saved twice,
        periodically and at an evaluation, holds the same weights)."""
        found: dict[int, Path] = {}
        for d in self.states():
            if len(found) >= n:
                break
            found.setdefault(_order(d)[0], d)
        return list(found.values())

    def holds_run(self) -> bool:
        return bool(self.states()) or (self.dir / "last").is_symlink()

    def find_resume(self, rank: int = 0, world: int = 1, broadcast: Callable[[Any], Any] = lambda x: x,
                    check: Callable[[SavedState], None] | None = None) -> SavedState:
        """The state to resume from: ``last``, else (damaged) the newest intact one. Rank 0
        decides and tells the others; ``problems`` lists what was wrong with those skipped.
        ``check`` (see :func:`fits_run`) raises :class:`DamagedCheckpoint` for a state that was
        read whole but does not fit the run (a tensor's shape, a data position)."""
        chosen, problems, mine = None, [], None
        if rank == 0:
            candidates: list[Path] = []
            target = self._link_name("last")
            if target is not None:
                if (self.dir / target).is_dir():
                    candidates.append(self.dir / target)
                else:
                    problems.append(f"checkpoints/last points at {target}, which does not exist")
            candidates += [p for p in self.states() if p not in candidates]
            for d in candidates:
                try:
                    mine = read_state(d, 0, world)
                    if check is not None:
                        check(mine)
                    chosen = str(d)
                    break
                except DamagedCheckpoint as exc:
                    problems.append(f"{d.name}: {exc}")
        chosen, problems = broadcast((chosen, problems))
        if chosen is None:
            why = "; ".join(problems) if problems else "none saved"
            raise TellkitError(f"--resume: no intact checkpoint under {self.dir} ({why})")
        saved = mine if mine is not None else read_state(Path(chosen), rank, world)
        saved.problems = problems
        return saved

    # -- writing (called on every rank; rank 0 owns the folder) -----------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        *,
        extra: dict[str, Any] | None = None,
        files: dict[str, dict[str, torch.Tensor]] | None = None,
        rank: int = 0,
        agree: Callable[[bool], bool] = lambda failed: failed,
        best: bool = False,
    ) -> Path:
        """Write a complete state, then move ``last`` (and ``best``) to it. ``files``: tensors
        kept beside the model (:meth:`Task.checkpoint_files`). ``agree`` is a
        collective (True on every rank when any rank's flag is True) that doubles as the
        barrier between the phases. A failed write raises a one-line :class:`TellkitError`."""
        begin_save()
        tmp = self.dir / f"step_{step:08d}.tmp"
        error: OSError | None = None
        final = self.dir / "last"
        if rank == 0:
            try:
                fault_point("begin")
                self.dir.mkdir(parents=True, exist_ok=True)
                for stale in self.dir.glob("*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
                fault_point("tmp_created")
            except OSError as exc:
                error = exc
        if not agree(error is not None):
            try:
                save_rng(tmp, rank)
                fault_point("rng")
                if rank == 0:
                    save_model(model, tmp, extra)
                    if files:
                        write_tensor_files(tmp, files)
                    fault_point("model")
                    save_optimizer(optimizer, tmp)
                    fault_point("optimizer")
                    atomic_write_json(tmp / STATE_NAME, {"format_version": FORMAT_VERSION, **trainer_state})
                    fault_point("state")
            except OSError as exc:
                error = exc
            if not agree(error is not None) and rank == 0:
                try:
                    _fsync_dir(tmp)
                    final = self._fresh(step)
                    os.replace(tmp, final)  # never onto an existing folder: the old state stays whole
                    _fsync_dir(self.dir)
                    fault_point("renamed")
                    _point(self.dir / "last", final.name)
                    fault_point("last")
                    if best:
                        _point(self.dir / "best", final.name)
                        fault_point("best")
                    _fsync_dir(self.dir)
                    self._prune()
                    fault_point("pruned")
                except OSError as exc:
                    error = exc
        if agree(error is not None):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            good = self.resolve("last")
            kept = f"the last good state {good.name} is intact" if good is not None else "there is no earlier state"
            why = f"{type(error).__name__}: {error}" if error is not None else "failed on another process"
            raise TellkitError(f"checkpoint of step {step} not saved ({why}); {kept}")
        return final if rank == 0 else self.dir / "last"

    def _fresh(self, step: int) -> Path:
        base = self.dir / f"step_{step:08d}"
        path, k = base, 0
        while path.exists() or path.is_symlink():
            k += 1
            path = base.with_name(f"{base.name}-{k}")
        return path

    def _prune(self) -> None:
        with pruning(self.dir) as free:
            if not free:  # a reader (export, average, evaluate) holds the states: prune at a later save
                return
            keep = {self._link_name("last"), self._link_name("best")}
            keep.update(d.name for d in self.newest_steps(self.keep))
            for d in self.states():
                if d.name not in keep:
                    shutil.rmtree(d, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------
    @staticmethod
    def load(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             rank: int = 0) -> dict[str, Any]:
        """Load weights (+ optimizer, + this rank's RNG) from ``directory``; return trainer state."""
        return apply_state(read_state(Path(directory), rank), model, optimizer)
