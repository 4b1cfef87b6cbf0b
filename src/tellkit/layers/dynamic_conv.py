"""Dynamic convolution (Wu et al., "Pay Less Attention with Lightweight and Dynamic
Convolutions", ICLR 2019), the past-token mixer of Transform and Tell's decoder.

For each position t and head h, a kernel of K weights is predicted from the current input
x_t by a linear map, softmax-normalised over the window, dropped out (DropConnect on the
normalised weights), and used to mix the inputs x_{t-K+1} .. x_t of that head's channels.
It is strictly causal: no position sees the future.

:class:`DynamicConv1d` is the bare operation; :class:`DynamicConvLayer` is the decoder
sub-layer around it (input dropout, Linear d->2d + GLU, conv, Linear d->d; the two linears are
weight-normalised ``GehringLinear`` layers with ``gehring_linear=True``, as in the reference).
Residual and LayerNorm belong to the block that uses it.

Incremental decoding: pass a ``state`` dict; the layer keeps only the last K-1 inputs of the
convolution (per head) and processes new positions against them. A full forward pass is the same
computation with an all-zero history, so both paths agree to float rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.layers import rows
from tellkit.layers.linear import GehringLinear


class DynamicConv1d(nn.Module):
    def __init__(self, channels: int, kernel_size: int, num_heads: int, weight_dropout: float = 0.0,
                 weight_softmax: bool = True, bias: bool = False, conv_bias: bool = False):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"channels {channels} not divisible by num_heads {num_heads}")
        self.channels, self.kernel_size, self.num_heads = channels, kernel_size, num_heads
        self.weight_dropout, self.weight_softmax = weight_dropout, weight_softmax
        self.weight_linear = nn.Linear(channels, num_heads * kernel_size, bias=bias)
        self.conv_bias = nn.Parameter(torch.zeros(channels)) if conv_bias else None
        nn.init.xavier_uniform_(self.weight_linear.weight)
        if bias:
            nn.init.zeros_(self.weight_linear.bias)

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> normalised, dropped-out kernels [B, T, H, K]."""
        B, T, _ = x.shape
        w = rows.linear(self.weight_linear, x).view(B, T, self.num_heads, self.kernel_size)
        if self.weight_softmax:
            w = torch.softmax(w.float(), dim=-1).to(x.dtype)
        return F.dropout(w, p=self.weight_dropout, training=self.training)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        """``x`` [B, T, C] -> [B, T, C]. With ``state``, continues from the saved history (the
        last K-1 inputs, kept per head: ``state["history"]`` [B, H, K-1, C/H])."""
        B, T, C = x.shape
        K, H = self.kernel_size, self.num_heads
        hd = C // H
        hist = None if state is None else state.get("history")
        if hist is None:
            hist = x.new_zeros(B, H, K - 1, hd)
        # per head, the extended input [B, H, T+K-1, hd]: slot t + k is window slot k of position t
        # (head-major, so a decoding step's weighted sum is one batched product, with no copy
        # that regroups the window by head)
        ext = torch.cat([hist, x.view(B, T, H, hd).transpose(1, 2)], dim=2)
        if state is not None:
            state["history"] = ext[:, :, ext.size(2) - (K - 1):]
        w = self.kernels(x)  # [B, T, H, K]
        if T == 1:  # one decoding step: a K-term weighted sum per head
            out = torch.matmul(w.transpose(1, 2), ext)  # [B, H, 1, hd]
        else:  # band matrix: row t holds w[t, :] in columns t .. t+K-1 of the extended input
            band = w.new_zeros(B, H, T, T + K - 1)
            band.as_strided((B, H, T, K), (H * T * (T + K - 1), T * (T + K - 1), T + K, 1)).copy_(
                w.permute(0, 2, 1, 3))
            out = torch.matmul(band, ext)
        out = out.transpose(1, 2).reshape(B, T, C)
        if self.conv_bias is not None:
            out = out + self.conv_bias
        return out


class DynamicConvLayer(nn.Module):
    """Input dropout -> Linear(d, 2d) -> GLU -> DynamicConv1d -> Linear(d, d)."""

    def __init__(self, dim: int, kernel_size: int, num_heads: int, weight_dropout: float = 0.1,
                 input_dropout: float = 0.1, glu: bool = True, weight_softmax: bool = True,
                 gehring_linear: bool = False):
        super().__init__()
        self.input_dropout = input_dropout
        self.glu = glu
        if gehring_linear:  # the reference: N(0, 1/fan_in) + weight normalisation
            self.linear1 = GehringLinear(dim, 2 * dim if glu else dim)
            self.linear2 = GehringLinear(dim, dim)
        else:
            self.linear1 = nn.Linear(dim, 2 * dim if glu else dim)
            self.linear2 = nn.Linear(dim, dim)
            for lin in (self.linear1, self.linear2):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)
        self.conv = DynamicConv1d(dim, kernel_size, num_heads, weight_dropout, weight_softmax)

    def forward(self, x: torch.Tensor, state: dict | None = None) -> torch.Tensor:
        x = F.dropout(x, p=self.input_dropout, training=self.training)
        x = rows.linear(self.linear1, x)
        if self.glu:
            x = F.glu(x, dim=-1)
        return rows.linear(self.linear2, self.conv(x, state))
