"""``tellkit export DIR --format reference --out model.ckpt``: a tellkit checkpoint as the
reference implementation's checkpoint file (a PyTorch pickle of tensors and plain values, as
the reference code loads it), through its family's ``to_reference`` in :mod:`tellkit.convert`
(BTTR)."""
from __future__ import annotations

import io
import os
from dataclasses import asdict
from pathlib import Path

import torch

from tellkit.checkpoint import load_model
from tellkit.convert import converter
from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_bytes


def export_reference(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the tellkit checkpoint folder ``src`` as the reference implementation's checkpoint
    file ``out`` (a new file in an existing folder)."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise TellkitError(f"{out}: exists (nothing was written)")
    if not out.parent.is_dir():
        raise TellkitError(f"{out.parent}: no such folder")
    model = load_model(src)
    try:
        mod = converter(model.family)
    except TellkitError:
        mod = None
    if not hasattr(mod, "to_reference"):
        raise TellkitError(f"no export to the reference format for {model.family!r}")
    ckpt = mod.to_reference(asdict(model.config), model.state_dict())
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    try:
        atomic_write_bytes(out, buf.getvalue())
    except OSError as exc:  # a read-only folder, a full disk
        raise TellkitError(f"{out}: cannot write there ({exc.strerror or exc})") from None
    return out
