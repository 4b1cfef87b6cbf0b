"""Putting a written checkpoint in place: :func:`write_checkpoint_folder` writes into a staging
folder beside the target and swaps it in, so an export never leaves a half-written or lost folder."""
from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tellkit.checkpoint import CONFIG_NAME
from tellkit.errors import TellkitError


def write_checkpoint_folder(out: str | Path, write: Callable[[Path], Any], *, replace: bool = False,
                            sources: Sequence[Path] = ()) -> list[str]:
    """Run ``write(folder)`` into a staging folder beside ``out``, then swap it in. An existing
    non-empty ``out`` is refused unless ``replace`` (and it holds a checkpoint); its files that the
    new checkpoint does not write (a README) are carried over, and their names returned. An
    ``out`` that is a symbolic link to a folder has that folder replaced (the link stays); a
    dangling link is refused. A place that cannot be written is refused before any checkpoint is
    read. An interruption or error at any point leaves the old folder whole."""

    given = Path(out)
    out = _link_target(given)
    if out.exists() and not out.is_dir():
        raise TellkitError(f"{given}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not replace:
            raise TellkitError(f"{given}: not empty (use --replace to replace a checkpoint folder)")
        if not (out / CONFIG_NAME).is_file():
            raise TellkitError(f"{given}: not a checkpoint folder (no {CONFIG_NAME}); refusing to replace it")
    target = out.resolve()
    for src in sources:
        src = Path(src).resolve()
        if target == src or src in target.parents:
            raise TellkitError(f"{given}: inside the checkpoint {src} it is made from")
    staging = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    made = [p for p in staging.parents if not p.exists()]  # folders this call creates, deepest first
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        _remove_empty(made)
        raise TellkitError(f"{given}: cannot write there ({_why(exc, staging)})") from None
    kept: list[str] = []
    try:
        write(staging)
        kept = _swap(staging, out)
    except OSError as exc:
        raise TellkitError(f"{given}: writing the checkpoint failed ({_why(exc, staging)})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if not out.exists():
            _remove_empty(made)
    return kept


def _link_target(out: Path) -> Path:
    """``out`` made absolute, with a symbolic link at ``out`` followed to the folder it names."""
    if not out.is_symlink():
        return out.absolute()
    target = out.resolve()
    if not target.exists():
        raise TellkitError(f"{out}: a symbolic link to {target}, which does not exist "
                           "(give the folder itself, or remove the link)")
    return target


def _swap(staging: Path, out: Path) -> list[str]:
    """Put ``staging`` at ``out``; an existing ``out`` is renamed aside first and restored on error."""
    if not out.is_dir():
        staging.rename(out)
        return []
    kept = []
    for f in sorted(out.iterdir()):
        if not (staging / f.name).exists():
            (shutil.copytree if f.is_dir() else shutil.copy2)(f, staging / f.name)
            kept.append(f.name)
    old = out.with_name(out.name + ".export-old")
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return kept


def _remove_empty(folders: Sequence[Path]) -> None:
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            return


def _why(exc: OSError, staging: Path) -> str:
    """An OSError in a few words, naming the file unless it is the staging folder's own."""
    what = exc.strerror or type(exc).__name__
    name = exc.filename and Path(exc.filename)
    if name and name != staging and staging not in name.parents:
        return f"{what}: {name}"
    return what
