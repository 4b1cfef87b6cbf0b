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
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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
        """The weight matrix [out, in] the layer applies."""
        if not self.weight_norm:
            return self.weight
        v = self.weight_v
        return v * (self.weight_g / v.norm(dim=1, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight_norm={self.weight_norm}")
