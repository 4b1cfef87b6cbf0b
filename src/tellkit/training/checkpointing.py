"""Full training-state checkpoints that survive crashes, and resume from them.

A run keeps its checkpoints under ``RUN/checkpoints/``::

    step_00001200/            one complete state (a loadable tellkit model checkpoint, plus:)
        config.json model.safetensors      the model (``tellkit.checkpoint.save_model``)
        optimizer.safetensors optimizer.json   optimizer tensors / everything else
        rng_rank<R>.safetensors rng_rank<R>.json   torch/CUDA/numpy/python RNG of each process
        trainer_state.json                 step, epoch, data position, schedule, loss scaler, best
    last -> step_00001200     symbolic links, each replaced atomically
    best -> step_00001000

Atomicity: a state is written into ``step_N.tmp/``, every file is fsynced, the folder is renamed
to ``step_N`` and only then is the ``last`` link replaced (``os.replace`` of a link is atomic).
A crash at any moment leaves ``last`` pointing at the previous complete state; leftover
``*.tmp`` folders are removed by the next save. Older states not pointed at are deleted.

Nothing here unpickles: tensors are read with safetensors, everything else is JSON.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tellkit.checkpoint import atomic_write_bytes, atomic_write_json, save_model
from tellkit.errors import TellkitError

STATE_NAME = "trainer_state.json"
FORMAT_VERSION = 1


# --- optimizer state: tensors -> safetensors, the rest -> JSON --------------------------------
def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    from safetensors.torch import save

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


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    from safetensors.torch import load_file

    meta = json.loads((directory / "optimizer.json").read_text(encoding="utf-8"))
    tensors = load_file(str(directory / "optimizer.safetensors"))
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        pid, name = key.split("/", 1)
        state.setdefault(int(pid), {})[name] = t
    for pid, st in meta["state"].items():
        state.setdefault(int(pid), {}).update(st)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# --- random number generators -----------------------------------------------------------------
def save_rng(directory: Path, rank: int) -> None:
    from safetensors.torch import save

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


def load_rng(directory: Path, rank: int) -> bool:
    """Restore this process's RNG state; False when the checkpoint has none for ``rank``."""
    from safetensors.torch import load_file

    path = directory / f"rng_rank{rank}.safetensors"
    if not path.is_file():
        return False
    tensors = load_file(str(path))
    meta = json.loads((directory / f"rng_rank{rank}.json").read_text(encoding="utf-8"))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda")), key=lambda k: int(k[4:]))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    return True


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


class CheckpointManager:
    """Writes, points at, prunes and finds the full-state checkpoints of one run."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir) / "checkpoints"

    # -- finding ---------------------------------------------------------------------------
    def resolve(self, name: str = "last") -> Path | None:
        link = self.dir / name
        if not link.is_symlink() and not link.exists():
            return None
        target = link.resolve()
        if not (target / STATE_NAME).is_file():
            raise TellkitError(f"{link}: points at {target}, which is not a complete checkpoint")
        return target

    # -- writing (called on every rank; rank 0 owns the folder) -----------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        *,
        extra: dict[str, Any] | None = None,
        rank: int = 0,
        barrier=lambda: None,
        best: bool = False,
    ) -> Path:
        name = f"step_{step:08d}"
        final = self.dir / name
        tmp = self.dir / (name + ".tmp")
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # same step saved twice (e.g. end of epoch == max_steps): rewrite
                shutil.rmtree(final)
            tmp.mkdir()
        barrier()
        save_rng(tmp, rank)
        if rank == 0:
            save_model(model, tmp, extra)
            save_optimizer(optimizer, tmp)
            atomic_write_json(tmp / STATE_NAME, {"format_version": FORMAT_VERSION, **trainer_state})
        barrier()
        if rank == 0:
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            _point(self.dir / "last", name)
            if best:
                _point(self.dir / "best", name)
            _fsync_dir(self.dir)
            self._prune()
        barrier()
        return final

    def _prune(self) -> None:
        keep = {p.name for p in (self.resolve("last"), self.resolve("best")) if p is not None}
        for d in self.dir.glob("step_*"):
            if d.is_dir() and not d.name.endswith(".tmp") and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------
    @staticmethod
    def load(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int = 0) -> dict[str, Any]:
        """Load weights (+ optimizer, + this rank's RNG) from ``directory``; return trainer state."""
        from safetensors.torch import load_file

        from tellkit.checkpoint import WEIGHTS_NAME

        state = json.loads((directory / STATE_NAME).read_text(encoding="utf-8"))
        weights = load_file(str(directory / WEIGHTS_NAME))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # tied weights are stored once: a missing name must share storage with a loaded one
        own = model.state_dict()
        ptrs = {own[k].data_ptr() for k in weights if k in own}
        really_missing = [k for k in missing if own[k].data_ptr() not in ptrs]
        if really_missing or unexpected:
            raise TellkitError(f"{directory}: weights do not match the model (missing {really_missing[:5]}, unexpected {unexpected[:5]})")
        if optimizer is not None:
            load_optimizer(optimizer, directory)
        if not load_rng(directory, rank):
            state["rng_restored"] = False
        return state
