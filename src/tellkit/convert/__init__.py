"""Import checkpoints written by the reference implementations into tellkit checkpoint folders.

Each model family that can be imported has a module here (``tellkit.convert.<family>``) with::

    FAMILY = "bttr"                                  # the registered tellkit family
    def matches(state: dict[str, Tensor]) -> bool    # does this state dict look like ours?
    def convert(state, **options) -> tuple[dict, dict[str, Tensor]]
        # -> (model config fields, tellkit state dict); raise TellkitError on a mismatch

and optionally, to go back::

    def to_reference(config: dict, state: dict[str, Tensor]) -> dict   # the reference's checkpoint

Reference checkpoints are PyTorch pickles (a Lightning ``.ckpt``, an AllenNLP ``best.th``).
They are read with ``torch.load(weights_only=True)``, or, when the file also names other classes
(Lightning's ``AttributeDict``, callback states), by a restricted unpickler that rebuilds tensors
itself and replaces every other class by an inert stand-in: reading an untrusted file never
executes its code.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tellkit.checkpoint import atomic_write_bytes, load_model, save_model
from tellkit.errors import TellkitError
from tellkit.registry import create_model

CONVERTERS = ("bttr", "transform_and_tell")


class _Inert(dict):
    """Stand-in for any class named inside a reference pickle: keeps its state as a dict and
    runs nothing (optimizer states, Lightning's ``AttributeDict``, callbacks...)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        if args and isinstance(args[0], dict):
            self.update(args[0])

    def __setstate__(self, state: Any) -> None:
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.update(part)


def _rebuild_tensor(flat: torch.Tensor, offset: int, size, stride, *_: Any) -> torch.Tensor:
    return flat.as_strided(tuple(size), tuple(stride), int(offset))


def _rebuild_parameter(data: torch.Tensor, *_: Any) -> torch.Tensor:
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class _SafeUnpickler(pickle.Unpickler):
    """Rebuilds tensors from a PyTorch zip checkpoint with tellkit's own functions; every other
    class becomes an inert stand-in, so nothing the file names is ever imported or called."""

    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str):
        super().__init__(fh)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name.endswith("Storage"):
            dtype = _STORAGE_DTYPES.get(name)
            if dtype is None:
                raise pickle.UnpicklingError(f"unknown storage type torch.{name}")
            return dtype
        if module == "torch" and hasattr(torch, name) and isinstance(getattr(torch, name), torch.dtype):
            return getattr(torch, name)
        return type(name, (_Inert,), {"__module__": "tellkit.convert.stand_in"})

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, dtype, key, _location, numel = pid[:5]
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("unsupported storage")
        raw = self.archive.read(f"{self.prefix}/data/{key}")
        flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat[: int(numel)] if int(numel) <= flat.numel() else flat


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


def _load_zip_checkpoint(p: Path) -> Any:
    try:
        archive = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise TellkitError(f"{p}: not a readable PyTorch checkpoint (an old-style pickle that holds classes "
                           "other than tensors; re-save it as a plain state dict)") from None
    with archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not names:
            raise TellkitError(f"{p}: a zip file, but not a PyTorch checkpoint (no data.pkl)")
        prefix = names[0].rsplit("/", 1)[0] if "/" in names[0] else ""
        with archive.open(names[0]) as fh:
            try:
                return _SafeUnpickler(fh, archive, prefix).load()
            except Exception as exc:  # noqa: BLE001 - any failure means an unreadable file
                raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({exc})") from None


def read_pickled_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a reference ``.ckpt`` / ``.th`` / ``.pt`` file without executing any of its code:
    ``torch.load(weights_only=True)`` first; a file that also holds other classes (a Lightning
    checkpoint) is read by :class:`_SafeUnpickler`, which replaces them by inert stand-ins."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"{p}: no such file")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        obj = _load_zip_checkpoint(p)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise TellkitError(f"{p}: expected a dict of tensors, found {type(obj).__name__}")
    return obj


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a reference checkpoint: a Lightning ``state_dict`` entry, a bare state
    dict, or a safetensors file."""
    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file  # heavy

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


def export_checkpoint(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the tellkit checkpoint folder ``src`` as the reference implementation's checkpoint
    file ``out`` (a PyTorch pickle of tensors and plain values, as the reference loads it)."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise TellkitError(f"{out}: exists (nothing was written)")
    if not out.parent.is_dir():
        raise TellkitError(f"{out.parent}: no such folder")
    model = load_model(src)
    mod = converter(model.family)
    if not hasattr(mod, "to_reference"):
        raise TellkitError(f"no export to the reference format for {model.family!r}")
    ckpt = mod.to_reference(asdict(model.config), model.state_dict())
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    atomic_write_bytes(out, buf.getvalue())
    return out
