"""A weight-normalised linear layer with Gehring et al.'s initialisation, as Transform and Tell's
reference decoder uses for its dynamic-convolution projections, context projection and FFN.

- Initialisation (Gehring et al. 2017, "Convolutional Sequence to Sequence Learning", A.3):
  weights ~ N(0, (1 - dropout) / fan_in), bias 0, so each output starts with unit variance.
- Weight normalisation (Salimans & Kingma 2016): the weight is stored as a direction ``weight_v``
  [out, in] and a magnitude ``weight_g`` [out, 1]; the layer uses W = g * v / ||v|| (row norms).
  This adds one trainable number per output unit, which is why the reference counts
  171,068,441 / 200,461,337 parameters where plain linears would give 36,864 fewer.

The parameter names (``weight_g``, ``weight_v``, ``bias``) are those PyTorch's ``weight_norm``
gives, so weights of the reference port without renaming. ``weight_norm=False`` gives a plain
linear layer with the same initialisation.

Folding for inference: computing g * v / ||v|| at every call reads each weight twice per decoding
step. When no gradient can flow into the layer (eval mode, and autograd off or the parameters
frozen) the folded weight is kept and reused, but only while both parameters are the very tensors
it was folded from, unchanged: the same storage and the same autograd version counter, which every
in-place update of a parameter bumps (optimiser steps, ``load_state_dict``, ``reset_parameters``,
``copy_`` / ``mul_`` under ``no_grad``, ``swa_utils``). Training mode, ``train()`` / ``eval()``
and moving the module (``to``, ``half``) drop it; nothing of it is saved (``state_dict`` holds
only ``weight_g`` / ``weight_v``). Writes through ``param.data``, which PyTorch hides from the
version counter on purpose, are the one path it cannot see: update parameters in place through
the parameter itself (as ``torch.optim`` does), or call ``clear_folded()``.

The product is :func:`tellkit.layers.rows.dense` on the applied weight: ``F.linear``, on rows
padded to a few counts where it is bfloat16 on a CPU, and inside ``rows.prepacked()`` (float32 or
bfloat16 autocast, CPU, autograd off) on a oneDNN-packed copy of the weight, made once per fold.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tellkit.layers import rows


class GehringLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, dropout: float = 0.0,
                 weight_norm: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dropout, self.weight_norm = dropout, weight_norm
        if weight_norm:
            self.weight_v = nn.Parameter(torch.empty(out_features, in_features))
            self.weight_g = nn.Parameter(torch.empty(out_features, 1))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._folded: tuple | None = None  # (weight, v, g, v version, g version)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt((1.0 - self.dropout) / self.in_features)
        with torch.no_grad():
            if self.weight_norm:
                self.weight_v.normal_(0.0, std)
                self.weight_g.copy_(self.weight_v.norm(dim=1, keepdim=True))  # W = v at init
            else:
                self.weight.normal_(0.0, std)
            if self.bias is not None:
                self.bias.zero_()

    def effective_weight(self) -> torch.Tensor:
        """The weight matrix [out, in] the layer applies (folded once for inference, see above)."""
        if not self.weight_norm:
            return self.weight
        v, g = self.weight_v, self.weight_g
        needs_grad = torch.is_grad_enabled() and (v.requires_grad or g.requires_grad)
        if self.training or needs_grad:
            self._folded = None  # no stale copy outlives a training step
            return v * (g / v.norm(dim=1, keepdim=True))
        cached = self._folded
        if cached is not None and self._fold_is_current(cached, v, g):
            return cached[0]
        with torch.no_grad():
            w = v * (g / v.norm(dim=1, keepdim=True))
            # the stored v / g are detached aliases: they keep the folded-from storage alive, so a
            # new parameter tensor can never sit at the same address with the same version
            self._folded = (w, v.detach(), g.detach(), v._version, g._version)
        return w

    @staticmethod
    def _fold_is_current(cached: tuple, v: torch.Tensor, g: torch.Tensor) -> bool:
        w, v0, g0, v_version, g_version = cached
        if w.is_inference() and not torch.is_inference_mode_enabled():
            return False  # folded under inference_mode: not usable outside it
        return (v._version == v_version and g._version == g_version
                and v.data_ptr() == v0.data_ptr() and g.data_ptr() == g0.data_ptr()
                and v.dtype == w.dtype and v.device == w.device and v.shape == v0.shape)

    def train(self, mode: bool = True):
        self.clear_folded()
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self.clear_folded()
        return super()._apply(fn, *args, **kwargs)

    def clear_folded(self) -> None:
        """Forget the folded inference weight (the next call folds again)."""
        self._folded = None
        self.__dict__.pop("_folded_low", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.effective_weight()
        kind = x.device.type
        if self._folded is not None and w is self._folded[0] and torch.is_autocast_enabled(kind):
            # autocast would cast the folded weight (not a parameter, so not in its cache) at every
            # call: keep its 16-bit copy with the fold
            w = self._low_precision(w, torch.get_autocast_dtype(kind))
        return rows.dense(x, w, self.bias)

    def _low_precision(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        low = self.__dict__.setdefault("_folded_low", {})
        if low.get("of") is not w:  # a new fold: the copies of the old one are stale
            low.clear()
            low["of"] = w
        if dtype not in low:
            low[dtype] = w.to(dtype)
        return low[dtype]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight_norm={self.weight_norm}")
