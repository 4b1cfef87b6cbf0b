"""Import checkpoints written by the reference implementations into tellkit checkpoint folders.

Each model family that can be imported has a module here (``tellkit.convert.<family>``) with::

    FAMILY = "bttr"                                  # the registered tellkit family
    def matches(state: dict[str, Tensor]) -> bool    # does this state dict look like ours?
    def convert(state, **options) -> tuple[dict, dict[str, Tensor]]
        # -> (model config fields, tellkit state dict); raise TellkitError on a mismatch

Reference checkpoints are PyTorch pickles (a Lightning ``.ckpt``, an AllenNLP ``best.th``).
They are read with ``torch.load(weights_only=True)``: only tensors and plain containers are
rebuilt, and classes the file names (Lightning's ``AttributeDict``, optimizer state classes)
are replaced by inert stand-ins, so reading an untrusted file never executes its code.
"""
from __future__ import annotations

import importlib
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from tellkit.errors import TellkitError

CONVERTERS = ("bttr", "transform_and_tell")


class _Inert(dict):
    """Stand-in for a class named inside a reference pickle: keeps its state as a dict."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        if args and isinstance(args[0], dict):
            self.update(args[0])

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.update(state)
        elif isinstance(state, tuple):
            for part in state:
                if isinstance(part, dict):
                    self.update(part)


_UNSUPPORTED = re.compile(r"(?:Unsupported global: GLOBAL|global) ([\w.]+)")


def read_pickled_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a reference ``.ckpt`` / ``.th`` / ``.pt`` file without executing any of its code."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"{p}: no such file")
    stand_ins: list[tuple[type, str]] = []
    for _ in range(64):  # each round allows one more class name, as an inert stand-in
        try:
            with torch.serialization.safe_globals(stand_ins):
                obj = torch.load(p, map_location="cpu", weights_only=True)
            break
        except pickle.UnpicklingError as exc:
            m = _UNSUPPORTED.search(str(exc))
            if not m or any(name == m.group(1) for _, name in stand_ins):
                raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({str(exc).splitlines()[0]})") from None
            stand_ins.append((type(m.group(1).rsplit(".", 1)[-1], (_Inert,), {}), m.group(1)))
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({str(exc).splitlines()[0]})") from None
    else:
        raise TellkitError(f"{p}: too many unknown classes inside the checkpoint")
    if not isinstance(obj, dict):
        raise TellkitError(f"{p}: expected a dict of tensors, found {type(obj).__name__}")
    return obj


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a reference checkpoint: a Lightning ``state_dict`` entry, a bare state
    dict, or a safetensors file."""
    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
            raise TellkitError(f"{p}: not a readable safetensors file ({exc})") from None
    obj = read_pickled_checkpoint(p)
    state = obj.get("state_dict", obj.get("model", obj))
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise TellkitError(f"{p}: holds no tensors")
    return tensors


def converter(family: str):
    if family not in CONVERTERS:
        raise TellkitError(f"no converter for {family!r} (known: {', '.join(CONVERTERS)})")
    return importlib.import_module(f"tellkit.convert.{family}")


def detect_family(state: dict[str, torch.Tensor]) -> str:
    found = []
    for fam in CONVERTERS:
        try:
            mod = converter(fam)
        except ImportError:
            continue
        if mod.matches(state):
            found.append(fam)
    if len(found) != 1:
        what = "no known layout" if not found else f"several layouts ({', '.join(found)})"
        raise TellkitError(f"cannot tell which model this checkpoint holds ({what}); pass --family")
    return found[0]


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, family: str | None = None,
                       **options: Any) -> Path:
    """Convert ``src`` into a tellkit checkpoint folder ``out`` (config.json + safetensors).

    The converted weights are loaded strictly into a freshly built tellkit model, so a missing,
    unexpected or mis-shaped tensor is an error, never a silently random layer."""
    from tellkit.checkpoint import save_model
    from tellkit.registry import create_model

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TellkitError(f"{out}: exists and is not an empty folder (nothing was written)")
    state = read_state_dict(src)
    family = family or detect_family(state)
    config, new_state = converter(family).convert(state, **options)
    model = create_model({"name": family, **config})
    result = model.load_state_dict(new_state, strict=False)
    missing = [k for k in result.missing_keys if not _is_buffer(model, k)]
    if missing or result.unexpected_keys:
        raise TellkitError(f"{src}: converted weights do not fit the {family} model "
                           f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    save_model(model, out, extra={"converted_from": Path(src).name})
    return out


def _is_buffer(model: torch.nn.Module, key: str) -> bool:
    return key in dict(model.named_buffers())
