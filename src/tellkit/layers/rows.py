"""Matrix products whose row count varies from call to call, on CPUs computing in bfloat16.

On a CPU, PyTorch computes a bfloat16 matrix product (and a convolution) with oneDNN, which
builds a kernel for every distinct shape and keeps the last 1,024 in a cache. A search calls its
linear layers with a different number of rows at almost every step (hypotheses finish and leave,
images end), and an encoder sees a different pixel count for every image size: each new shape
costs a kernel build (about half a millisecond), and thousands of shapes also push each other
out of the cache. Float32 products (MKL) have no such cost.

:func:`bucket` rounds a row count up to one of a few values (eight per power of two, so at
most 12.5% more rows); :func:`linear` runs a linear layer on rows padded to that count when
the product will be bfloat16 on a CPU, and on the rows as they are otherwise. The padded rows
are zeros and are dropped from the result: the values are those of the plain call.
"""
from __future__ import annotations

import torch
from torch import nn


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


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for a linear layer on ``x`` [..., in]; the rows (all leading dimensions)
    padded to :func:`bucket` rows where the product is bfloat16 on a CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not rows or not cpu_bf16(x) or not isinstance(module, nn.Linear):
        return module(x)
    padded = bucket(rows)
    if padded == rows:
        return module(x)
    flat = x.new_zeros(padded, x.shape[-1])
    flat[:rows] = x.reshape(rows, -1)
    return module(flat)[:rows].reshape(*x.shape[:-1], -1)
