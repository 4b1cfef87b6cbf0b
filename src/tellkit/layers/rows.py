"""Matrix products of linear layers on a CPU: rows padded to a few counts for bfloat16, and an
opt-in pre-packed weight for float32 and bfloat16 autocast.

bfloat16. On a CPU, PyTorch computes a bfloat16 matrix product (and a convolution) with oneDNN,
which builds a kernel for every distinct shape and keeps the last 1,024 in a cache. A search
calls its linear layers with a different number of rows at almost every step (hypotheses finish
and leave, images end), and an encoder sees a different pixel count for every image size: each
new shape costs a kernel build (about half a millisecond), and thousands of shapes also push
each other out of the cache. :func:`bucket` rounds a row count up to one of a few values (eight
per power of two, so at most 12.5% more rows); :func:`linear` and :func:`dense` run the product
on rows padded to that count when it will be bfloat16 on a CPU. The padded rows are zeros and
are dropped from the result: the values are those of the plain call.

float32, pre-packed (opt-in). A float32 product goes through ``F.linear`` (MKL), which reads the
weight in its stored layout at every call. oneDNN can instead reorder the weight once into the
blocked layout its kernels read; on one thread, products of 4 to 16 rows with Transform and
Tell's weight shapes (1024 x 1024 up to 30,265 x 1024) then ran 1.6 to 3 times as fast.
Inside ``with prepacked():`` every product of
:func:`dense` / :func:`linear` that is float32 (input, weight and bias), on the CPU, with
autograd off and no autocast uses such a packed copy of its weight, made at the first call and
kept for the weight tensor while it lives, its storage and version unchanged (an in-place update
through the tensor, as optimisers and ``load_state_dict`` do, makes the next call pack it again;
writes through ``.data`` are not seen: call :func:`clear_prepacked`). A product of one row (a
matrix-vector product, bound by reading the weight) stays with ``F.linear``. Above 16 rows, rows are
padded to :func:`bucket` counts there too, since oneDNN builds a kernel per row count (padding
fewer rows to 16 would multiply a one-row product's work by 16). The packed copy
takes as much memory as the float32 weight it packs, for as long as that weight is alive or
until :func:`clear_prepacked`; a weight tensor made afresh at every call (a transposed view, say)
is not packed. Results match ``F.linear``'s to float32 rounding (the sums run in another order),
not bit for bit. Any other product (autograd on, autocast, another device or dtype, oneDNN
unavailable or switched off, tracing) is the plain ``F.linear`` call, except under CPU bfloat16
autocast: there the packed copy is a bfloat16 one (the weight cast once, as autocast casts it at
every call), the input and bias are cast as autocast casts them and the result is bfloat16; on one
thread this ran Transform and Tell's products 2 to 5 times as fast as autocast's ``F.linear``, with
the same values. That packed bfloat16 product needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
(:func:`tellkit.utils.precision.bf16_support`); on other CPUs (AVX2 only) a product under bfloat16
autocast is the plain autocast call. The switch is per thread
and per asyncio task (a context variable): a server thread's setting does not leak into another.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.utils.precision import bf16_support

_PREPACKED = contextvars.ContextVar("tellkit_prepacked", default=False)
# id(weight) -> (weakref to it, version, data_ptr, shape, packed copy); an entry leaves with its weight
_packs: dict[int, tuple] = {}
_packs_lock = threading.Lock()
# the row count oneDNN is told to expect when packing (it serves any row count afterwards)
_PACK_ROWS = 32


def bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 1/8 of the power of two at or below it (at least 16)."""
    if n <= 16:
        return 16
    step = (1 << (n.bit_length() - 1)) // 8
    return -(-n // step) * step


def cpu_bf16(x: torch.Tensor) -> bool:
    """Whether a product taking ``x`` runs in bfloat16 on a CPU (its dtype, or autocast's)."""
    if x.device.type != "cpu":
        return False
    if x.dtype == torch.bfloat16:
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@contextlib.contextmanager
def prepacked(enabled: bool = True) -> Iterator[None]:
    """Within it, float32 CPU products of :func:`dense` / :func:`linear` with autograd off use
    pre-packed weights (``enabled=False``: the plain products, e.g. inside an enabled block)."""
    token = _PREPACKED.set(bool(enabled))
    try:
        yield
    finally:
        _PREPACKED.reset(token)


def prepacking() -> bool:
    """Whether products here would use pre-packed weights where they can (see :func:`prepacked`)."""
    return _PREPACKED.get()


def clear_prepacked() -> None:
    """Forget every packed weight copy (the next packed product packs its weight again)."""
    with _packs_lock:
        _packs.clear()


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype | None:
    """The dtype of the packed product (float32, or bfloat16 under CPU bfloat16 autocast), or
    None for the plain call."""
    if not _PREPACKED.get() or torch.is_grad_enabled():
        return None
    if x.device.type != "cpu" or weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 1:
        return None
    if torch.is_autocast_enabled("cpu"):
        if torch.get_autocast_dtype("cpu") != torch.bfloat16 or not bf16_support().packed:
            return None  # oneDNN's packed bf16 product raises on a CPU without AVX-512 / AVX-NE-CONVERT
        dtype, allowed = torch.bfloat16, (torch.float32, torch.bfloat16)
    else:
        dtype, allowed = torch.float32, (torch.float32,)
    if x.dtype not in allowed or weight.dtype not in allowed:
        return None
    if x.layout != torch.strided or weight.layout != torch.strided or not weight.is_contiguous():
        return None
    if bias is not None and (bias.dtype not in allowed or bias.device.type != "cpu" or bias.dim() != 1):
        return None
    if x.numel() < 2 * x.shape[-1] or not weight.numel() or x.shape[-1] != weight.shape[1]:
        # one row is a matrix-vector product, as fast or faster through F.linear; empty products
        # and shape errors: F.linear's own result or message
        return None
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    return None if torch.jit.is_tracing() or torch.compiler.is_compiling() else dtype


def _drop(key: int, ref: weakref.ref) -> None:
    with _packs_lock:
        entry = _packs.get(key)
        if entry is not None and entry[0] is ref:
            del _packs[key]


def _packed_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    key = (id(weight), dtype)
    # inference tensors have no version counter (and can change only inside inference mode)
    version = None if weight.is_inference() else weight._version
    entry = _packs.get(key)
    if (entry is not None and entry[0]() is weight and entry[1] == version
            and entry[2] == weight.data_ptr() and entry[3] == weight.shape):
        return entry[4]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), _PACK_ROWS)
    ref = weakref.ref(weight, lambda r, k=key: _drop(k, r))
    with _packs_lock:
        _packs[key] = (ref, version, weight.data_ptr(), weight.shape, packed)
    return packed


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    packed = _packed_weight(weight, dtype)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1]).to(dtype)
    padded = rows if rows <= 16 else bucket(rows)  # one kernel per count: at most 16 below 16
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    bias = None if bias is None else bias.to(dtype).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed, bias, "none", [], "")
    return y[:rows].reshape(*x.shape[:-1], weight.shape[0])


def _on_padded_rows(x: torch.Tensor, product) -> torch.Tensor:
    """``product(x)`` on ``x`` [..., in], its rows padded with zeros to :func:`bucket` rows where
    the product is bfloat16 on a CPU (the padded rows are dropped from the result)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if not rows or not cpu_bf16(x) or bucket(rows) == rows:
        return product(x)
    flat = x.new_zeros(bucket(rows), x.shape[-1])
    flat[:rows] = x.reshape(rows, -1)
    return product(flat)[:rows].reshape(*x.shape[:-1], -1)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: on a pre-packed weight inside :func:`prepacked` where the
    product is float32 (or bfloat16 autocast) on the CPU with autograd off, on rows padded to
    :func:`bucket` rows where it is bfloat16 on a CPU, and the plain call otherwise."""
    dtype = _packable(x, weight, bias)
    if dtype is not None:
        return _packed_product(x, weight, bias, dtype)
    return _on_padded_rows(x, lambda t: F.linear(t, weight, bias))


def _bare_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose call is exactly ``F.linear(x, weight, bias)`` (no own forward, no hooks)."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and not module._forward_hooks and not module._forward_pre_hooks)


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer on ``x`` [..., in]: :func:`dense` for a plain ``nn.Linear``
    (its pre-packed weight inside :func:`prepacked`; a weight-normalised ``GehringLinear`` does the
    same in its own call); another ``nn.Linear`` (own forward or hooks) is called on rows padded to
    :func:`bucket` rows where the product is bfloat16 on a CPU; anything else is called as it is."""
    if _bare_linear(module):
        return dense(x, module.weight, module.bias)
    if not isinstance(module, nn.Linear):
        return module(x)
    return _on_padded_rows(x, module)
