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
import inspect
import io
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tellkit.checkpoint import atomic_write_bytes, load_model, max_model_bytes, save_model, write_tensor_files
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
    class becomes an inert stand-in, so nothing the file names is ever imported or called.
    ``scan``: read no tensor data; each storage entry's declared size must be its element count
    times its element size (a small file whose entry inflates to gigabytes is refused), and
    ``self.total`` adds them up."""

    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str, scan: bool = False):
        super().__init__(fh)
        self.archive, self.prefix, self.scan = archive, prefix, scan
        self.total, self.seen = 0, set()

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
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError("unsupported storage")
        name = f"{self.prefix}/data/{key}" if self.prefix else f"data/{key}"
        expected = numel * torch.empty(0, dtype=dtype).element_size()
        try:
            declared = self.archive.getinfo(name).file_size
        except KeyError:
            raise pickle.UnpicklingError(f"storage {key} is missing") from None
        info = self.archive.getinfo(name)
        if declared > _MAX_PLAIN and declared > _MAX_INFLATION * info.compress_size:
            raise TellkitError(f"storage entry {key} inflates {info.compress_size:,} bytes to {declared:,} (PyTorch "
                               "stores tensors uncompressed)")
        if declared != expected:
            raise TellkitError(f"storage entry {key} declares {declared:,} bytes, but its {numel:,} elements of "
                               f"{dtype} take {expected:,}")
        if self.scan:
            if name not in self.seen:
                self.seen.add(name)
                self.total += expected
            return torch.empty(numel, dtype=dtype, device="meta")
        with self.archive.open(name) as f:
            raw = f.read(expected + 1)  # never more than declared, whatever the entry inflates to
        if len(raw) != expected:
            raise pickle.UnpicklingError(f"storage {key} holds {len(raw):,} bytes, not {expected:,}")
        return torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)


# a storage entry over 16 MiB that inflates more than 100-fold is refused: PyTorch writes tensors
# uncompressed, and a re-zipped checkpoint of real weights shrinks far less
_MAX_PLAIN, _MAX_INFLATION = 16 << 20, 100

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


MAX_PICKLE_BYTES = 256 << 20  # a checkpoint's data.pkl (the tensors' bytes are other entries)


def _load_zip_checkpoint(p: Path, scan: bool = False) -> Any:
    """The object a PyTorch zip checkpoint holds, read by :class:`_SafeUnpickler`; ``scan``:
    only check the storage sizes (see :func:`check_zip_sizes`) and return the unpickler."""
    try:
        archive = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise TellkitError(f"{p}: not a readable PyTorch checkpoint (an old-style pickle that holds classes "
                           "other than tensors; re-save it as a plain state dict)") from None
    with archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not names:
            raise TellkitError(f"{p}: a zip file, but not a PyTorch checkpoint (no data.pkl)")
        if archive.getinfo(names[0]).file_size > MAX_PICKLE_BYTES:
            raise TellkitError(f"{p}: its data.pkl declares {archive.getinfo(names[0]).file_size:,} bytes, over "
                               f"the limit of {MAX_PICKLE_BYTES:,}")
        prefix = names[0].rsplit("/", 1)[0] if "/" in names[0] else ""
        with archive.open(names[0]) as fh:
            unpickler = _SafeUnpickler(fh, archive, prefix, scan=scan)
            try:
                obj = unpickler.load()
            except TellkitError as exc:
                raise TellkitError(f"{p}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - any failure means an unreadable file
                raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({exc})") from None
        return unpickler if scan else obj


def check_zip_sizes(p: Path) -> None:
    """Before any tensor of a PyTorch zip checkpoint is read (by ``torch.load`` or by
    :class:`_SafeUnpickler`): every storage entry must declare exactly its tensor's size, and
    they must add up to at most ``max_model_bytes()``."""
    total, limit = _load_zip_checkpoint(p, scan=True).total, max_model_bytes()
    if total > limit:
        raise TellkitError(f"{p}: its tensors take {total / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB "
                           "limit (TELLKIT_MAX_MODEL_BYTES)")


def read_pickled_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a reference ``.ckpt`` / ``.th`` / ``.pt`` file without executing any of its code:
    ``torch.load(weights_only=True)`` first; a file that also holds other classes (a Lightning
    checkpoint) is read by :class:`_SafeUnpickler`, which replaces them by inert stand-ins."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"{p}: no such file" if not p.exists() else f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise TellkitError(f"{p}: the file is empty")
    if zipfile.is_zipfile(p):
        check_zip_sizes(p)
    elif p.stat().st_size > max_model_bytes():
        raise TellkitError(f"{p}: {p.stat().st_size / 2**30:.1f} GiB, over the limit (TELLKIT_MAX_MODEL_BYTES)")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        obj = _load_zip_checkpoint(p)
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError) as exc:
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
    options = _checked_options(converter(family).convert, options)
    config, new_state = converter(family).convert(state, **options)
    try:
        model = create_model({"name": family, **config})
    except TellkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a config the model cannot be built from
        raise TellkitError(f"{src}: the converted {family} model does not build "
                           f"({type(exc).__name__}: {exc})") from None
    _check_weights(src, model, new_state)
    result = model.load_state_dict(new_state, strict=False)
    missing = [k for k in result.missing_keys if not _is_buffer(model, k)]
    if missing or result.unexpected_keys:
        raise TellkitError(f"{src}: converted weights do not fit the {family} model "
                           f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    extra: dict[str, Any] = {"converted_from": Path(src).name}
    if hasattr(converter(family), "encoder_files"):  # encoder weights the checkpoint carries
        section, files = converter(family).encoder_files(state)
        write_tensor_files(out, files)
        if section:
            extra["encoders"] = section
    save_model(model, out, extra=extra)
    return out


def _checked_options(fn, options: dict[str, Any]) -> dict[str, Any]:
    """The ``-o KEY=VALUE`` options of a converter, each of the kind its default has (a number
    for ``nhead``, true/false for a flag); an unknown one is refused."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in options.items():
        if key not in params or key == "state":
            if takes_any:
                continue
            known = ", ".join(k for k in params if k != "state")
            raise TellkitError(f"-o {key}: not an option of this converter (known: {known})")
        default = params[key].default
        kinds = {bool: (bool,), int: (int,), float: (int, float)}.get(type(default))
        ok = kinds is None or (isinstance(value, kinds) and (kinds == (bool,) or not isinstance(value, bool)))
        if not ok:
            what = {bool: "true or false", int: "a whole number", float: "a number"}[type(default)]
            raise TellkitError(f"-o {key}={value!r}: expected {what}")
    return options


def _check_weights(src, model: torch.nn.Module, new_state: dict[str, torch.Tensor]) -> None:
    """Converted tensors are refused unless each fits its parameter's kind (no integer tensor for a
    float parameter) and is finite: ``load_model`` would refuse the checkpoint written from them."""
    own = model.state_dict()
    for key, t in new_state.items():
        target = own.get(key)
        if target is None or not target.is_floating_point():
            continue
        if not t.is_floating_point():
            raise TellkitError(f"{src}: tensor {key} is {t.dtype}, not floating point like the model's {target.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise TellkitError(f"{src}: tensor {key} holds NaN or infinite values")


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
