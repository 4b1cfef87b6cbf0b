"""Reading a file a person named, and checking a path a command will write, without hanging.

    read_text(path, "--article", max_bytes=8 << 20)   # str, or a one-line TellkitError
    read_bytes(path, "recipe", max_bytes=1 << 20)
    check_regular_file(path, "--article")              # the checks alone, nothing opened
    check_output_path(path, "--out")                   # before a command starts its work
    atomic_write_bytes(path, data), atomic_write_json(path, obj)   # never a half-written file

A path may name something that is not a file: ``/dev/zero`` reads without end, a FIFO blocks
the reader until someone writes, a terminal or a socket waits for input, ``/proc`` files claim a
size of 0 and may be endless. Every reader here refuses anything but a regular file from its
``stat`` (taken before the file is opened, so a device is never opened), opens without blocking
and checks the opened file again (the path may have changed in between), and stops reading at
``max_bytes`` (one byte more means "too large", whatever the file said its size was).

Writes go to a temporary file beside the target, are fsynced and renamed over it, so a crash
never leaves a half-written file under the final name. ``TELLKIT_FAULT`` names a phase of a save
at which the process kills itself (:func:`fault_point`): the crash-safety tests use it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
# kernel file systems: their files are not data a person saved (sizes of 0, endless or blocking reads)
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def _kind(mode: int) -> str | None:
    """None for a regular file, else what it is ("a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def _under_pseudo(p: Path) -> str | None:
    try:
        real = os.path.realpath(p)
    except (OSError, RuntimeError, ValueError):
        return None
    return next((r for r in PSEUDO_ROOTS if real == r or real.startswith(r + "/")), None)


def _stat(p: Path, what: str) -> os.stat_result:
    try:
        return os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        raise TellkitError(f"{what}: {p}: not found") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TellkitError(f"{what}: {p}: a symbolic link that loops") from None
        raise TellkitError(f"{what}: {p}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:  # a NUL in the path
        raise TellkitError(f"{what}: {p!r}: not a usable path ({exc})") from None


def check_regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` names an existing regular file (not a folder, device, FIFO, socket, nor a file
    under /proc, /sys or /dev); -> the path. Nothing is opened."""
    p = Path(path)
    kind = _kind(_stat(p, what).st_mode)
    if kind is not None:
        raise TellkitError(f"{what}: {p} is {kind}, not a regular file")
    root = _under_pseudo(p)
    if root is not None:
        raise TellkitError(f"{what}: {p} is under {root}, not a regular file")
    return p


def read_bytes(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The whole content of the regular file ``path``, at most ``max_bytes`` bytes; a one-line
    :class:`TellkitError` for anything else (see the module docstring)."""
    p = check_regular_file(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise TellkitError(f"{what}: {p}: cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        kind = _kind(os.fstat(fd).st_mode)
        if kind is not None:  # swapped for something else since the check
            raise TellkitError(f"{what}: {p} is {kind}, not a regular file")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise TellkitError(f"{what}: {p}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise TellkitError(f"{what}: {p} is larger than the {max_bytes:,} bytes accepted")
    return data


def read_text(path: str | os.PathLike, what: str, max_bytes: int, encoding: str = "utf-8") -> str:
    """:func:`read_bytes` decoded (UTF-8 by default); undecodable bytes are a one-line error."""
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise TellkitError(f"{what}: {path} is not {encoding.upper()} text (byte 0x{data[exc.start]:02x} at "
                           f"offset {exc.start:,})") from None


def check_output_path(path: str | os.PathLike, what: str, folder: bool = False) -> Path:
    """Before a command does its work: ``path`` can be written. Refused in one line: a symbolic
    link that loops or dangles, a path under /proc, /sys or /dev, an existing special file, an
    existing folder where a file is written (or a file where a folder is, ``folder=True``), and a
    parent that is a file. -> the path (not resolved)."""
    p = Path(path)
    if str(p).strip() == "" or "\x00" in str(p):
        raise TellkitError(f"{what}: {str(p)!r} is not a usable path")
    if p.is_symlink() and not os.path.exists(p):
        try:
            os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise TellkitError(f"{what}: {p}: cannot write there (a symbolic link that loops)") from None
            raise TellkitError(f"{what}: {p} is a symbolic link to {os.readlink(p)}, which does not exist") from None
    root = _under_pseudo(p)
    if root is not None:
        raise TellkitError(f"{what}: {p}: cannot write there (it is under {root})")
    for parent in p.parents:
        try:
            st = os.stat(parent)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            raise TellkitError(f"{what}: {p}: cannot write there ({parent}: {exc.strerror or exc})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise TellkitError(f"{what}: {p}: cannot write there ({parent} is not a folder)")
        break
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p
    except OSError as exc:
        raise TellkitError(f"{what}: {p}: cannot be used ({exc.strerror or exc})") from None
    if folder and not stat.S_ISDIR(st.st_mode):
        raise TellkitError(f"{what}: {p} exists and is {_kind(st.st_mode) or 'a file'}, not a folder")
    if not folder and _kind(st.st_mode) is not None:
        raise TellkitError(f"{what}: {p} is {_kind(st.st_mode)}, not a file to write")
    return p


# --- fault injection (tests kill a real process at a named phase of a save) ------------------
FAULT_ENV = "TELLKIT_FAULT"  # "<save number>:<phase>", e.g. "3:renamed" or "2:write:model.safetensors"
_save_number = 0


def begin_save() -> None:
    """Count saves (checkpoint phases are named per save in ``TELLKIT_FAULT``)."""
    global _save_number
    _save_number += 1


def fault_point(phase: str) -> None:
    """SIGKILL this process when ``TELLKIT_FAULT`` names this phase of the current save."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{_save_number}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            fault_point(f"write:{path.name}")  # a kill here leaves half a file under the temporary name
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # an error (not a kill) leaves no temporary file: a folder at ``path``, a full disk
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
