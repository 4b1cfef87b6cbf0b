"""Read pickled image files (TAMER / ICAL's ``images.pkl``) without running anything they hold.

A pickle is a small program: loading one with :func:`pickle.load` may import and call any
function the file names. :func:`load_arrays` loads it with a restricted unpickler that knows
only how to rebuild numpy arrays, numpy numbers and dtypes (the functions numpy's own pickles
name, ``numpy._core.multiarray._reconstruct`` and its siblings, each replaced by a checking
function of ours) and the plain values pickle builds without naming anything (dicts, lists,
tuples, strings, bytes, numbers). Any other name in the file is refused before anything of it
is imported or called, with a one-line :class:`TellkitError` that says what it named; arrays of
Python objects are refused too. This reader accepts numpy arrays only; the PyTorch checkpoint
reader (``tellkit.convert.read_state_dict``) is the one for tensors.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from tellkit.errors import TellkitError

# an array's shape as numpy's pickles first declare it: (0,) before its state fills it
_MAX_EMPTY = 16


class _NdarrayName:
    """What the file gets for ``numpy.ndarray``: only a marker that :func:`_reconstruct`
    accepts (calling the real class from a pickle could allocate any size)."""

    def __call__(self, *args: Any, **kwargs: Any):
        raise pickle.UnpicklingError("numpy.ndarray may only be named to rebuild an array")


_NDARRAY = _NdarrayName()


def _plain_dtype(d: Any) -> np.dtype:
    if not isinstance(d, np.dtype):
        raise pickle.UnpicklingError(f"expected a numpy dtype, got {type(d).__name__}")
    if d.hasobject:
        raise pickle.UnpicklingError("an array of Python objects")
    return d


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> np.ndarray:
    if cls is not _NDARRAY:
        raise pickle.UnpicklingError("only numpy.ndarray arrays are rebuilt")
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and 0 <= n <= _MAX_EMPTY for n in shape)):
        raise pickle.UnpicklingError(f"unexpected initial array shape {shape!r}")
    return np.empty(shape, dtype=np.uint8)  # the BUILD step that follows sets its real shape and data


def _dtype(spec: Any, align: Any = False, copy: Any = False) -> np.dtype:
    if not isinstance(spec, str):
        raise pickle.UnpicklingError(f"unexpected dtype {spec!r}")
    d = np.dtype(spec, align=bool(align), copy=bool(copy))
    if d.hasobject:
        raise pickle.UnpicklingError("an array of Python objects")
    return d


def _scalar(dtype: Any, data: Any = b"") -> np.generic:
    d = _plain_dtype(dtype)
    if not isinstance(data, (bytes, bytearray)) or len(data) != d.itemsize:
        raise pickle.UnpicklingError("a numpy number whose bytes do not match its type")
    return np.frombuffer(bytes(data), dtype=d, count=1)[0]


def _frombuffer(buf: Any, dtype: Any, shape: Any, order: Any = "C") -> np.ndarray:
    d = _plain_dtype(dtype)
    if isinstance(buf, pickle.PickleBuffer):
        buf = bytes(buf.raw())
    if not isinstance(buf, (bytes, bytearray)):
        raise pickle.UnpicklingError("array data must be bytes")
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise pickle.UnpicklingError(f"bad array shape {shape!r}")
    if int(np.prod(shape, dtype=np.int64)) * d.itemsize != len(buf):
        raise pickle.UnpicklingError("array data does not match its shape")
    return np.frombuffer(bytes(buf), dtype=d).reshape(shape, order="F" if order == "F" else "C").copy()


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    """``_codecs.encode``: protocol-2 pickles write bytes as a latin-1 string."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is accepted only for latin-1 text")
    return text.encode("latin1")


_ALLOWED: dict[tuple[str, str], Any] = {("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _dtype,
                                        ("_codecs", "encode"): _latin1}
for _mod in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_mod}.multiarray", "_reconstruct")] = _reconstruct
    _ALLOWED[(f"{_mod}.multiarray", "scalar")] = _scalar
    _ALLOWED[(f"{_mod}.numeric", "_frombuffer")] = _frombuffer


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        fn = _ALLOWED.get((module, name))
        if fn is None:
            raise _Refused(f"{module}.{name}")
        return fn

    def persistent_load(self, pid):
        raise _Refused(f"a persistent id ({type(pid).__name__})")


class _Refused(pickle.UnpicklingError):
    pass


_PLAIN = (str, bytes, int, float, complex, bool, type(None), np.generic)


def _check(obj: Any, depth: int = 0) -> None:
    """Refuse anything but plain values, numbers and numeric arrays (after loading)."""
    if depth > 100:
        raise pickle.UnpicklingError("values nested more than 100 deep")
    if isinstance(obj, np.ndarray):
        _plain_dtype(obj.dtype)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check(k, depth + 1)
            _check(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check(v, depth + 1)
    elif not isinstance(obj, _PLAIN) or (isinstance(obj, np.generic) and obj.dtype.hasobject):
        raise pickle.UnpicklingError(f"a {type(obj).__name__}")


def loads_arrays(data: bytes, where: str = "<pickle>") -> Any:
    """The value a pickle of numpy arrays, numbers and strings holds (see the module's docstring)."""
    try:
        obj = _ArrayUnpickler(io.BytesIO(data)).load()
        _check(obj)
    except _Refused as exc:
        raise TellkitError(f"{where}: refused: the pickle names {exc}, and only numpy arrays, numbers and "
                           "strings are read from pickles (nothing in the file was run)") from None
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError, IndexError, KeyError, AttributeError,
            MemoryError, OverflowError, RecursionError) as exc:
        raise TellkitError(f"{where}: not a pickle of numpy arrays, numbers and strings ({exc})") from None
    return obj


def load_arrays(path: str | os.PathLike) -> Any:
    """:func:`loads_arrays` of a file."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"pickle file not found: {p}")
    return loads_arrays(p.read_bytes(), str(p))
