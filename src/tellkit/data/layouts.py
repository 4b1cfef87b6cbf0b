"""Every on-disk layout a recognition recipe's ``data.layout`` names, behind one function.

``inkml``, ``tsv`` and ``caption`` are CROHME's (:mod:`tellkit.data.crohme`); ``caption`` also
reads BTTR/CoMER's ``data.zip`` in place and TAMER/ICAL's ``images.pkl`` folders
(:mod:`tellkit.data.released`); ``mathwriting``, ``hme100k`` and ``crohme2019`` are the
releases of :mod:`tellkit.data.mathwriting`, :mod:`tellkit.data.hme100k` and
:mod:`tellkit.data.crohme2019`. ``INK_LAYOUTS`` are read as pen strokes and rendered.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from tellkit.data import crohme, crohme2019, hme100k, mathwriting, released
from tellkit.data.crohme import Expression
from tellkit.errors import TellkitError

LAYOUTS = ("inkml", "tsv", "caption", "mathwriting", "hme100k", "crohme2019")
INK_LAYOUTS = ("inkml", "mathwriting", "crohme2019")
# a release's split for each of the task's roles, read when the configured name is not one of
# the release's (a CROHME model's stored data.test "2014" on MathWriting reads test/)
_ROLES = {"mathwriting": mathwriting.ROLES, "hme100k": hme100k.ROLES, "crohme2019": crohme2019.ROLES}


def _exists(root: Path, layout: str, split: str) -> bool:
    if layout == "mathwriting":
        return all((root / s.strip()).is_dir() for s in split.split("+"))
    if layout == "hme100k":
        return (root / f"{split}_images").is_dir()
    return (root / split).is_dir() or (root / "test" / split).is_dir()


def split_name(root: Path, layout: str, split: str, role: str | None) -> str:
    """``split``, or the release's own split for ``role`` when ``split`` is none of its (said on stderr)."""
    roles = _ROLES.get(layout)
    if roles is None or role not in roles or _exists(root, layout, split) or split == roles[role]:
        return split
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"data.{role}: '{split}' is not a {layout} split; reading '{roles[role]}'", file=sys.stderr)
    return roles[role]


def load_split(root: str | os.PathLike, split: str, layout: str = "tsv", skipped: dict[str, int] | None = None,
               role: str | None = None) -> list[Expression]:
    """The expressions of ``split`` in the data at ``root`` (a folder, or a ``.zip`` for the
    ``caption`` layout), laid out as ``layout`` says. ``role``: the task's split (``train``,
    ``val``, ``test``), for the releases' own split names. ``skipped``: reason -> files skipped."""
    r = Path(root)
    if layout not in LAYOUTS:
        raise TellkitError(f"unknown data layout '{layout}' ({'|'.join(LAYOUTS)})")
    if r.is_file():
        if layout != "caption" or r.suffix.lower() != ".zip":
            raise TellkitError(f"{r}: a file; only the caption layout reads an archive (a BTTR/CoMER data.zip)")
        return released.load_zip_split(r, split)
    split = split_name(r, layout, split, role)
    if layout == "mathwriting":
        return mathwriting.load_split(r, split, skipped)
    if layout == "hme100k":
        return hme100k.load_split(r, split, skipped)
    if layout == "crohme2019":
        return crohme2019.load_split(r, split, skipped)
    if layout == "caption":
        d = r / split if (r / split).is_dir() else r
        if (d / "images.pkl").is_file():
            return released.load_pickle_dir(d)
    return crohme.load_split(r, split, layout, skipped)
