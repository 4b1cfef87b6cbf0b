"""Which reduced precision a device can compute in, and the autocast context for it.

Mixed precision keeps the weights (and the optimiser's state) in float32 and runs the matrix
products and convolutions in a 16-bit type:

- CUDA: float16 (training scales the loss) or bfloat16;
- CPU: bfloat16 where the processor has native bf16 arithmetic (AVX512-BF16 or AMX on x86,
  as oneDNN reports it). There it is the fast path: several times the fp32 rate for matrix
  products, about 1.8x for a BTTR training step. float16 is never used on a CPU.

``resolve(device, wanted)`` says what a run gets and, when it gets less than it asked for, why
(one line for the log): a recipe written for a GPU (``amp: true`` = float16) still trains on a
CPU, in float32, and says so.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

#: names a user may give for a compute dtype (CLI ``--dtype``, recipes), and what they mean
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16"}


def cpu_has_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (oneDNN's check: AVX512-BF16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


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
            return Precision(kind, None, "this CPU has no native bfloat16 (AVX512-BF16 or AMX): running in float32")
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
