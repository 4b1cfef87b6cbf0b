"""Several processes extracting one feature folder (``tellkit features --shard I/N``, torchrun,
a cluster job array): which shards a process takes, and the lock that claims each one.

- Process I of N takes the shards k with ``k % N == I``; :func:`shard_spec` reads ``I/N`` from
  ``--shard``, or from the launcher's environment (torchrun: ``RANK`` / ``WORLD_SIZE``; a Slurm
  job array: ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT`` / ``SLURM_ARRAY_TASK_MIN``).
- Before computing shard k a process creates ``shard-0000k.lock`` with ``O_CREAT | O_EXCL`` (atomic
  on a local disk and on NFS v3+): only the process that created it computes the shard, so two
  processes on one folder never compute the same shard, whatever shards they were given. The lock
  names its host and process; it is removed once the shard is written. A lock left by a process
  that died on the same host is taken over; one left by another host stays until removed by hand
  (``rm OUT/*.lock`` once no process runs).
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from tellkit.errors import TellkitError


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    index, sep, count = str(text).partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        i = n = -1
    if not sep or n < 1 or not 0 <= i < n:
        raise TellkitError(f"--shard expects I/N with 0 <= I < N (e.g. 0/8), got '{text}'")
    return i, n


def shard_spec(given: str | None, env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """This process's (I, N): ``given`` (``I/N``), else the launcher's environment (torchrun's
    ``RANK`` / ``WORLD_SIZE``, a Slurm job array's task id and count); None: one process, all
    shards."""
    if given:
        return parse_shard(given)
    env = os.environ if env is None else env
    try:
        if int(env.get("WORLD_SIZE", "1")) > 1:
            return parse_shard(f"{env['RANK']}/{env['WORLD_SIZE']}")
        if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
            first = int(env.get("SLURM_ARRAY_TASK_MIN", "0"))
            return parse_shard(f"{int(env['SLURM_ARRAY_TASK_ID']) - first}/{env['SLURM_ARRAY_TASK_COUNT']}")
    except (KeyError, ValueError):
        raise TellkitError("RANK / WORLD_SIZE or SLURM_ARRAY_TASK_* are set but not whole numbers") from None
    return None


def lock_path(shard: Path) -> Path:
    return shard.with_suffix(".lock")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def claim(shard: Path) -> bool:
    """Create ``shard``'s lock; False when another process holds it. A lock whose process died
    on this host is taken over."""
    lock = lock_path(shard)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text(encoding="utf-8") or "{}")
            except (OSError, ValueError):
                return False  # being written, or unreadable: someone else's
            if held.get("host") == me["host"] and isinstance(held.get("pid"), int) and not _alive(held["pid"]):
                lock.unlink(missing_ok=True)  # its process died: take the shard over
                continue
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
        return True
    return False


def release(shard: Path) -> None:
    lock_path(shard).unlink(missing_ok=True)
