"""The device a computation runs on, which reduced precision it can compute in, and the autocast
context for it: the one resolver every entry point (training, evaluation, the pipelines, the
server, the commands) goes through.

``resolve_device(spec)``: ``cpu``, ``cuda``, ``cuda:N`` (or ``mps``) as a usable device, else a
one-line error. ONE default when no device is named (``None``): the first CUDA GPU when there
is one, else the CPU (:func:`default_device`). The ONNX runtime computes on the CPU, so a
pipeline on ``runtime="onnx"`` with no device named runs there.

``resolve_precision(device, dtype)``: the precision ``device`` grants for a user's dtype name
('bf16', 'fp32', ... or None), with a note when it grants less.

Mixed precision keeps the weights (and the optimiser's state) in float32 and runs the matrix
products and convolutions in a 16-bit type:

- CUDA: float16 (training scales the loss) or bfloat16;
- CPU: bfloat16 where the processor has native bf16 arithmetic (AVX512-BF16 or AMX-BF16 on
  x86; BF16 on Arm). There it is the fast path: several times the fp32 rate for matrix products,
  about 1.8x for a BTTR training step. float16 is never used on a CPU.

:func:`bf16_support` is the one capability check every bf16 path reads (``--dtype bf16``,
``train.amp: bf16``, the benchmarks' bf16 rows, the packed products of
:mod:`tellkit.layers.rows`). It tells two things apart:

- ``native``: the CPU computes bf16 in hardware; only then is bf16 granted to a run.
- ``packed``: oneDNN's pre-packed bf16 linear product can run at all (it needs AVX-512 BW, VL
  and DQ, or AVX-NE-CONVERT; it raises on an AVX2-only CPU). A product that cannot be packed is
  the plain autocast call, which runs on any CPU.

``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) and ``ATEN_CPU_CAPABILITY`` hold the check to
the instruction set they name, so a machine with AVX-512 can run the AVX2 paths (the suite does,
for its precision tests).

``resolve(device, wanted)`` says what a run gets and, when it gets less than it asked for, why
(one line for the log): a recipe written for a GPU (``amp: true`` = float16) still trains on a
CPU, in float32, and says so.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
from dataclasses import dataclass

import torch

from tellkit.errors import TellkitError

#: names a user may give for a compute dtype (CLI ``--dtype``, recipes), and what they mean
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA values) under which it may still use native bf16 / AVX-512
_ONEDNN_BF16_ISAS = {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                     "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
                     "AVX10_2_512_AMX_2", "ALL", "DEFAULT"}
_ONEDNN_PACKED_ISAS = _ONEDNN_BF16_ISAS | {"AVX512_CORE", "AVX512_CORE_VNNI", "AVX2_VNNI_2"}
# ATEN_CPU_CAPABILITY values that keep ATen's AVX-512 kernels
_ATEN_AVX512 = {"avx512", "avx512_vnni", "avx512_bf16", "amx", "avx512_fp16"}


@dataclass(frozen=True)
class Bf16Support:
    """What this CPU can do in bfloat16. ``native``: bf16 arithmetic in hardware (the fast path;
    what ``--dtype bf16`` and ``train.amp: bf16`` need); ``packed``: oneDNN's packed bf16 linear
    product can run; ``reason``: why not native ('' when it is); ``isa``: the instruction set
    that decided it, as named by the CPU or by an environment cap."""

    native: bool
    packed: bool
    reason: str
    isa: str

    def as_dict(self) -> dict:
        return {"native_bf16": self.native, "packed_bf16_products": self.packed, "isa": self.isa,
                **({"note": self.reason} if self.reason else {})}


def _env_cap() -> tuple[str, bool, bool] | None:
    """(the cap as written, native allowed, packed allowed) from the environment, or None."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(var, "").strip().upper()
        if value:
            return f"{var}={value}", value in _ONEDNN_BF16_ISAS, value in _ONEDNN_PACKED_ISAS
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten:
        avx512 = aten in _ATEN_AVX512
        return f"ATEN_CPU_CAPABILITY={aten}", avx512, avx512
    return None


def _probe(name: str) -> bool:
    """One of torch's CPU feature probes (False where this build lacks it)."""
    try:
        return bool(getattr(torch.cpu, name)())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def bf16_support() -> Bf16Support:
    """This CPU's bf16 capability (see the module's docstring); computed once per process."""
    try:
        packed = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # ATen's own precondition
    except (AttributeError, RuntimeError):  # a build without oneDNN
        packed = False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        native = packed and (_probe("_is_avx512_bf16_supported") or _probe("_is_amx_tile_supported"))
        isa = ("AMX" if _probe("_is_amx_tile_supported") else "AVX512-BF16" if native
               else "AVX-512" if _probe("_is_avx512_supported") else "AVX2" if _probe("_is_avx2_supported")
               else "no AVX2")
    else:  # Arm: oneDNN's check is the BF16 extension itself
        native, isa = packed, ("BF16" if packed else "no BF16")
    cap = _env_cap()
    if cap is not None:
        name, cap_native, cap_packed = cap
        native, packed = native and cap_native, packed and cap_packed
        if not cap_native:
            return Bf16Support(False, packed, f"this CPU has no native bfloat16: held to {name}", name)
    if native:
        return Bf16Support(True, packed, "", isa)
    return Bf16Support(False, packed, f"this CPU has no native bfloat16 (AVX512-BF16 or AMX; it has {isa})", isa)


def cpu_has_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (:func:`bf16_support`)."""
    return bf16_support().native


@dataclass(frozen=True)
class Precision:
    """What a device computes in: ``dtype`` is None for plain float32; ``note`` says why a
    requested dtype was not granted ('' when it was, or when none was asked for)."""

    device_type: str
    dtype: str | None
    note: str = ""

    @property
    def name(self) -> str:
        return self.dtype or "float32"

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=getattr(torch, self.dtype))


def resolve(device: torch.device | str, wanted: str | None) -> Precision:
    """The mixed precision ``device`` gets for ``wanted`` ('float16', 'bfloat16', None or
    'float32'); where the device cannot, float32 with a note."""
    kind = torch.device(device).type
    if wanted in (None, "float32"):
        return Precision(kind, None)
    if kind == "cuda":
        if wanted == "bfloat16" and not torch.cuda.is_bf16_supported():
            return Precision(kind, None, "this GPU has no bfloat16: running in float32")
        return Precision(kind, wanted)
    if kind == "cpu":
        if wanted == "bfloat16":
            if cpu_has_bf16():
                return Precision(kind, "bfloat16")
            return Precision(kind, None, f"{bf16_support().reason}: running in float32")
        return Precision(kind, None, "float16 mixed precision is for GPUs: running in float32 on the CPU")
    return Precision(kind, None, f"no mixed precision on {kind}: running in float32")


def dtype_name(value: str) -> str:
    """'bf16' / 'bfloat16' -> 'bfloat16', ... ; ValueError for anything else."""
    try:
        return DTYPE_NAMES[str(value).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}: use one of fp32, bf16, fp16") from None


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the products of an autocast region take it: a float32 tensor is cast to the
    autocast dtype when autocast is on for its device; anything else comes back unchanged.
    Autocast casts an activation again at every product that reads it (it caches only the casts
    of weights); a tensor that many products read (a context every decoder layer projects) is
    better cast once, to the same values."""
    kind = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(kind):
        return x
    return x.to(torch.get_autocast_dtype(kind))


def default_device() -> torch.device:
    """The device used when none is named: the first CUDA GPU when there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` (or ``mps``) as a usable device, else a one-line error;
    None: :func:`default_device`."""
    if spec is None:
        return default_device()
    if isinstance(spec, torch.device):
        dev = spec
    else:
        try:
            dev = torch.device(str(spec))
        except (RuntimeError, ValueError) as exc:
            raise TellkitError(f"unknown device {spec!r} (use cpu, cuda or cuda:N)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TellkitError(f"device {spec!s}: no CUDA GPU is available here (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TellkitError(f"device {spec!s}: only {torch.cuda.device_count()} CUDA GPU(s) here")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise TellkitError(f"device {spec!s}: MPS is not available here")
    elif dev.type == "meta":  # shapes without data: nothing could be computed or written
        raise TellkitError(f"device {spec!s}: the meta device holds no data (use cpu, cuda or cuda:N)")
    elif dev.type != "cpu":
        raise TellkitError(f"unsupported device {spec!s} (use cpu, cuda or cuda:N)")
    return dev


def resolve_precision(device: torch.device | str, dtype: str | None) -> Precision:
    """The compute precision ``device`` grants for the user's ``dtype`` ('bf16' / 'fp32' /
    'fp16' or their long names; None: float32): where it cannot, float32 with a ``note`` (the
    caller logs or records it); an unknown name is a one-line error."""
    try:
        wanted = None if dtype is None else dtype_name(dtype)
    except ValueError as exc:
        raise TellkitError(f"dtype: {exc}") from None
    return resolve(device, wanted)
