"""One training process per run folder, and readers that never see a state pruned under them.

    with hold_run(run_dir):            # tellkit train: the whole run (a second one is refused)
        ...
    with reading_states(run_dir):      # export / average / evaluate: no state pruned meanwhile
        ...
    with pruning(run_dir) as free:     # the trainer: prune only when ``free`` (no reader holds a state)
        ...

Two advisory locks (``fcntl.flock``, released by the kernel when the process ends, so a killed
run leaves nothing to clean up):

- ``RUN/train.lock``: held exclusively by the training process for its whole life. The holder
  writes its pid, host and start time into the file; a second ``tellkit train --out RUN`` (with
  or without ``--resume``) reads them and stops with one line naming them.
- ``RUN/checkpoints/.readers.lock``: a reader holds it shared while it resolves and reads a saved
  state; the trainer prunes old states only when it can take it exclusively without waiting, and
  otherwise keeps them until a later save. So training never waits for a reader, and a reader's
  state is never deleted under it.

Where locking is not available (a file system without ``flock``, a read-only run folder without
a lock file yet), readers go on without it: :func:`pruned_while_reading` then tells a state that
vanished during the read apart from a damaged one.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tellkit.errors import TellkitError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]

OWNER_LOCK = "train.lock"
READERS_LOCK = ".readers.lock"
READER_WAIT_S = 30.0  # the trainer holds the readers' lock exclusively only while it deletes folders


class RunInUse(TellkitError):
    """The run folder is owned by another training process; the message names it."""


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file ("pid 123 on host, started ..."), read from ``fd``."""
    for _ in range(20):  # the holder writes right after locking: give it a moment
        try:
            raw = os.pread(fd, 4096, 0)
            info = json.loads(raw.decode("utf-8")) if raw else None
        except (OSError, ValueError, UnicodeDecodeError):
            info = None
        if isinstance(info, dict) and "pid" in info:
            where = f" on {info['host']}" if info.get("host") and info["host"] != socket.gethostname() else ""
            return f"pid {info['pid']}{where}, started {info.get('started', '?')}"
        time.sleep(0.05)
    return "pid unknown"


class RunLock:
    """The exclusive ownership of one run folder (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / OWNER_LOCK
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        if fcntl is None or self.fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise TellkitError(f"cannot write the run folder {self.run_dir} ({self.path.name}: "
                               f"{exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)  # no flock on this file system: nothing to enforce
                return self
            holder = _holder(fd)
            os.close(fd)
            raise RunInUse(f"{self.run_dir} is in use by another tellkit train ({holder}); wait for it to end "
                           "or choose another --out") from None
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode("utf-8"), 0)
        except OSError:
            pass  # the lock holds without the note; a refused run then says "pid unknown"
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def hold_run(run_dir: str | os.PathLike) -> RunLock:
    """Own ``run_dir`` (which must exist) until :meth:`RunLock.release` or the process ends;
    :class:`RunInUse` naming the holder when another process owns it."""
    return RunLock(run_dir).acquire()


def check_not_running(run_dir: str | os.PathLike) -> None:
    """:class:`RunInUse` when a training process owns ``run_dir`` now (before deleting it, say)."""
    if (Path(run_dir) / OWNER_LOCK).is_file():
        RunLock(run_dir).acquire().release()


def run_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run folder a checkpoint path belongs to (``RUN`` itself, ``RUN/checkpoints/NAME``), else None."""
    p = Path(checkpoint)
    if (p / "checkpoints").is_dir():
        return p
    if p.parent.name == "checkpoints":
        return p.parent.parent
    return None


def _open_readers_lock(checkpoints: Path) -> int | None:
    path = checkpoints / READERS_LOCK
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            continue
    return None  # a read-only folder with no lock file: nobody there prunes under this version


@contextlib.contextmanager
def reading_states(checkpoint: str | os.PathLike | None, wait_s: float = READER_WAIT_S) -> Iterator[bool]:
    """Hold the run's readers' lock shared while the body reads states of the run that
    ``checkpoint`` belongs to (nothing for a checkpoint outside a run folder). Yields whether the
    lock is held (False: no locking here; see :func:`pruned_while_reading`)."""
    run = run_of(checkpoint) if checkpoint is not None else None
    fd = _open_readers_lock(run / "checkpoints") if run is not None and fcntl is not None else None
    held = False
    try:
        if fd is not None:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    held = True
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        break  # no flock here
                    if time.monotonic() > deadline:
                        raise TellkitError(f"{run}: the training run there kept its states locked for "
                                           f"{wait_s:.0f} s; try again") from None
                    time.sleep(0.05)
        yield held
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def pruning(checkpoints: str | os.PathLike) -> Iterator[bool]:
    """The trainer's side: yields True when no reader holds a state of ``checkpoints`` (the
    folder), and keeps readers out until the body ends; False when one does (prune later)."""
    if fcntl is None:
        yield True
        return
    try:
        fd = os.open(Path(checkpoints) / READERS_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        yield True  # cannot make the lock file: prune as before
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except OSError as exc:
            free = exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
        yield free
    finally:
        os.close(fd)


def pruned_while_reading(state: str | os.PathLike, exc: BaseException) -> TellkitError | None:
    """The error to raise when reading ``state`` failed with ``exc`` because the state was
    deleted meanwhile (its folder is gone now), else None (a real damage: raise ``exc``)."""
    p = Path(state)
    if p.exists():
        return None
    return TellkitError(f"{p.name} was pruned while reading (the run saved newer states meanwhile); "
                        "run the command again")
