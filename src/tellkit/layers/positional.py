"""Sinusoidal position encodings (Vaswani et al. 2017), as a table and as a module.

Layout follows fairseq (which Transform and Tell builds on): the first half of the channels
are sines, the second half cosines, with frequencies 10000^(-i/(half-1)). Row p of the table
encodes position p; the caller chooses the number of the first token (fairseq and Transform and
Tell's reference number it padding_idx + 1 = 2, and give padding the zero row 1). There are no
parameters.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_table(num_positions: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[num_positions, dim] table; row p encodes position p. Odd ``dim`` gets a zero last column."""
    half = dim // 2
    scale = math.log(10000.0) / max(half - 1, 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -scale)
    angles = torch.arange(num_positions, dtype=torch.float64)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1, dtype=table.dtype)], dim=1)
    return table.to(dtype)


class SinusoidalPositions(nn.Module):
    """Adds nothing learnable: ``forward(length, start=0)`` -> [length, dim] encodings of
    positions ``start .. start+length-1``. The table grows on demand (no max length)."""

    def __init__(self, dim: int, init_size: int = 1024):
        super().__init__()
        self.dim = dim
        self.register_buffer("table", sinusoidal_table(init_size, dim), persistent=False)

    def forward(self, length: int, start: int = 0) -> torch.Tensor:
        end = start + length
        if end > self.table.size(0):
            size = max(end, 2 * self.table.size(0))
            self.table = sinusoidal_table(size, self.dim).to(self.table.device)
        return self.table[start:end]
