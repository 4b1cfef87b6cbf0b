"""Dropout with cheaper random numbers on CPU.

On CPU, ``torch.nn.functional.dropout`` draws one Bernoulli sample per element
(``bernoulli_``), which measured as about a quarter of a BTTR training step on a 2-core machine
(the DenseNet drops out after every convolution). :func:`fast_dropout` draws 64 random bits per
four elements instead (``random_`` on int64, viewed as four 16-bit words; the top bit of each word
is cleared, so every element gets 15 uniform bits) and keeps an element when its 15-bit value is
at least ``round(p * 32768)``. The result has the distribution of ordinary dropout with ``p``
rounded to a multiple of 1/32768 (p = 0.2 becomes 0.20001), surviving elements scaled by
``1 / (1 - p)`` as usual. Random numbers come from the default CPU generator, so
``torch.manual_seed`` and checkpointed RNG states make it reproducible.

Elsewhere (CUDA, which has fused dropout kernels; inside ``torch.compile``; tensors that are
neither contiguous nor channels-last) it is ``F.dropout``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_BITS = 15
_LEVELS = 1 << _BITS


def _keep_mask(x: torch.Tensor, threshold: int) -> torch.Tensor:
    """A bool tensor shaped and laid out like ``x``: True with probability 1 - threshold/32768."""
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_().view(torch.int16)[:n]
    words = words.as_strided(x.shape, x.stride())  # x is dense (checked by the caller)
    return words.bitwise_and_(_LEVELS - 1) >= threshold


def fast_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    dense = x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
    # compiled graphs draw their own fused random numbers
    if x.device.type != "cpu" or not dense or p == 1.0 or torch.compiler.is_compiling():
        return F.dropout(x, p, True)
    threshold = round(p * _LEVELS)
    keep = _keep_mask(x, threshold)
    return x * keep.to(x.dtype).mul_(_LEVELS / (_LEVELS - threshold))


class FastDropout(nn.Module):
    """``nn.Dropout`` drawing its masks with :func:`fast_dropout`; ``fast = False`` makes it
    plain ``F.dropout`` (for comparisons). No parameters: checkpoints are unaffected."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = p
        self.fast = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast:
            return fast_dropout(x, self.p, self.training)
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
