"""Reading pickles from untrusted files without running any code they name.

    restricted_load(fileobj, allowed=NUMPY_ARRAYS, what="images.pkl")  # a data pickle: plain values
    read_pickled_checkpoint(path, max_bytes)   # a PyTorch .ckpt / .th / .pt: its dict of tensors
    check_zip_sizes(path, max_bytes)           # a PyTorch zip checkpoint's sizes, before any read

A pickle is a program: unpickling calls whatever classes and functions the file names. Both
readers here decide themselves what a name resolves to, so nothing the file names is imported
or called unless it is on a list:

- :func:`restricted_load` (data files: lists, dicts, numbers, strings, numpy arrays) resolves
  only the names in ``allowed`` and refuses the file, in one line, at the first other name.
- :func:`read_pickled_checkpoint` (reference checkpoints) tries ``torch.load(weights_only=True)``
  first; a file that also names other classes (Lightning's ``AttributeDict``, callback states)
  is read by an unpickler that rebuilds tensors with its own functions and turns every other
  class into an inert dict (the state is kept, nothing is run). The storage entries' declared
  sizes are checked before any tensor byte is read, so a small file cannot inflate to gigabytes.

Importing this module does not import torch (a data reader needs only :func:`restricted_load`).
"""
from __future__ import annotations

import importlib
import os
import pickle
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from tellkit.errors import TellkitError

#: the names a pickle of numpy arrays and numpy scalars uses (numpy 1 and numpy 2 spellings)
NUMPY_ARRAYS = frozenset({
    "numpy.ndarray", "numpy.dtype",
    "numpy.core.multiarray._reconstruct", "numpy.core.multiarray.scalar",
    "numpy._core.multiarray._reconstruct", "numpy._core.multiarray.scalar",
})
#: plain Python containers a pickle names by class (lists, dicts, tuples, numbers and strings
#: need no name at all)
PLAIN_CONTAINERS = frozenset({"builtins.set", "builtins.frozenset", "builtins.complex",
                              "collections.OrderedDict"})


class _Restricted(pickle.Unpickler):
    def __init__(self, fileobj: IO[bytes], allowed: frozenset[str], what: str):
        super().__init__(fileobj)
        self.allowed, self.what = allowed, what

    def find_class(self, module: str, name: str):
        if f"{module}.{name}" not in self.allowed:
            raise TellkitError(f"{self.what}: the pickle names {module}.{name}, which a data file may not "
                               "(refused: unpickling it could run code)")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid):
        raise TellkitError(f"{self.what}: the pickle refers to outside objects ({str(pid)[:40]}), which a "
                           "data file may not")


def restricted_load(fileobj: IO[bytes], allowed: Iterable[str] = PLAIN_CONTAINERS, what: str = "pickle") -> Any:
    """The object the pickle in ``fileobj`` holds, where every class or function it names must be
    in ``allowed`` (dotted names, e.g. ``NUMPY_ARRAYS | PLAIN_CONTAINERS``); any other name, an
    outside reference, or a damaged stream is a one-line :class:`TellkitError` naming ``what``.
    Lists, dicts, tuples, numbers, strings and bytes need no name and are always read."""
    try:
        return _Restricted(fileobj, frozenset(allowed), what).load()
    except TellkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        raise TellkitError(f"{what}: not a readable pickle ({type(exc).__name__}: {exc})") from None


class _Inert(dict):
    """Stand-in for any class named inside a reference checkpoint: keeps its state as a dict and
    runs nothing (optimizer states, Lightning's ``AttributeDict``, callbacks...)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        if args and isinstance(args[0], dict):
            self.update(args[0])

    def __setstate__(self, state: Any) -> None:
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.update(part)


def _rebuild_tensor(flat, offset: int, size, stride, *_: Any):
    return flat.as_strided(tuple(size), tuple(stride), int(offset))


def _rebuild_parameter(data, *_: Any):
    return data


_CHECKPOINT_NAMES = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}

_STORAGE_DTYPES = {  # storage class -> torch dtype name
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
}

# a storage entry over 16 MiB that inflates more than 100-fold is refused: PyTorch writes tensors
# uncompressed, and a re-zipped checkpoint of real weights shrinks far less
_MAX_PLAIN, _MAX_INFLATION = 16 << 20, 100

MAX_PICKLE_BYTES = 256 << 20  # a checkpoint's data.pkl (the tensors' bytes are other entries)


class _CheckpointUnpickler(pickle.Unpickler):
    """Rebuilds tensors from a PyTorch zip checkpoint with this module's own functions; every
    other class becomes an inert stand-in, so nothing the file names is ever imported or called.
    ``scan``: read no tensor data; each storage entry's declared size must be its element count
    times its element size (a small file whose entry inflates to gigabytes is refused), and
    ``self.total`` adds them up."""

    def __init__(self, fh, archive: zipfile.ZipFile, prefix: str, scan: bool = False):
        super().__init__(fh)
        self.archive, self.prefix, self.scan = archive, prefix, scan
        self.total, self.seen = 0, set()

    def find_class(self, module: str, name: str):
        import torch  # heavy

        if (module, name) in _CHECKPOINT_NAMES:
            return _CHECKPOINT_NAMES[(module, name)]
        if module == "torch" and name.endswith("Storage"):
            dtype = _STORAGE_DTYPES.get(name)
            if dtype is None:
                raise pickle.UnpicklingError(f"unknown storage type torch.{name}")
            return getattr(torch, dtype)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return type(name, (_Inert,), {"__module__": f"{__name__}.stand_in"})

    def persistent_load(self, pid):
        import torch  # heavy

        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, dtype, key, _location, numel = pid[:5]
        if not isinstance(dtype, torch.dtype) or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError("unsupported storage")
        name = f"{self.prefix}/data/{key}" if self.prefix else f"data/{key}"
        expected = numel * torch.empty(0, dtype=dtype).element_size()
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise pickle.UnpicklingError(f"storage {key} is missing") from None
        declared = info.file_size
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


def _load_zip_checkpoint(p: Path, scan: bool = False) -> Any:
    """The object a PyTorch zip checkpoint holds, read by :class:`_CheckpointUnpickler`; ``scan``:
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
            unpickler = _CheckpointUnpickler(fh, archive, prefix, scan=scan)
            try:
                obj = unpickler.load()
            except TellkitError as exc:
                raise TellkitError(f"{p}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - any failure means an unreadable file
                raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({exc})") from None
        return unpickler if scan else obj


def check_zip_sizes(p: str | os.PathLike, max_bytes: int) -> None:
    """Before any tensor of a PyTorch zip checkpoint is read (by ``torch.load`` or by this
    module's unpickler): every storage entry must declare exactly its tensor's size, and they
    must add up to at most ``max_bytes``."""
    p = Path(p)
    total = _load_zip_checkpoint(p, scan=True).total
    if total > max_bytes:
        raise TellkitError(f"{p}: its tensors take {total / 2**30:.1f} GiB, more than the "
                           f"{max_bytes / 2**30:.1f} GiB limit (TELLKIT_MAX_MODEL_BYTES)")


def _is_torchscript(p: Path) -> bool:
    try:
        with zipfile.ZipFile(p) as archive:
            return any(n == "constants.pkl" or n.endswith("/constants.pkl") for n in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def read_pickled_checkpoint(path: str | os.PathLike, max_bytes: int) -> dict[str, Any]:
    """Read a reference ``.ckpt`` / ``.th`` / ``.pt`` file without executing any of its code:
    ``torch.load(weights_only=True)`` first; a file that also holds other classes (a Lightning
    checkpoint) is read by this module's unpickler, which replaces them by inert stand-ins.
    Tensors over ``max_bytes`` in all are refused before they are read."""
    import torch  # heavy

    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"{p}: no such file" if not p.exists() else f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise TellkitError(f"{p}: the file is empty")
    if zipfile.is_zipfile(p):
        check_zip_sizes(p, max_bytes)
    elif p.stat().st_size > max_bytes:
        raise TellkitError(f"{p}: {p.stat().st_size / 2**30:.1f} GiB, over the limit (TELLKIT_MAX_MODEL_BYTES)")
    if zipfile.is_zipfile(p) and _is_torchscript(p):
        raise TellkitError(f"{p}: a TorchScript archive (compiled code), not a checkpoint of tensors; "
                           "save the model's state dict instead")
    try:
        with warnings.catch_warnings():  # torch's warnings about a file name its own install path
            warnings.simplefilter("ignore")
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        obj = _load_zip_checkpoint(p)
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError) as exc:
        raise TellkitError(f"{p}: not a readable PyTorch checkpoint ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise TellkitError(f"{p}: expected a dict of tensors, found {type(obj).__name__}")
    return obj
