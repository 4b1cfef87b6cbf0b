"""Learned, softmax-normalised weighted sum over an encoder's hidden states.

Transform and Tell (Tran et al. 2020) embeds article token i as sum_l alpha_l g_{l,i} over the
25 hidden states of RoBERTa-large (embedding output + 24 layers); the reference code keeps one
free weight per layer, initialised uniform(0, 1) as the reference does, and normalises them with
a softmax (``init="zeros"`` starts from an exactly uniform mix).
"""
from __future__ import annotations

import math

import torch
from torch import nn


class LayerMix(nn.Module):
    def __init__(self, num_layers: int, init: str = "uniform"):
        super().__init__()
        if init not in ("uniform", "zeros"):
            raise ValueError(f"LayerMix init must be 'uniform' or 'zeros', got {init!r}")
        self.num_layers = num_layers
        self.weights = nn.Parameter(torch.zeros(num_layers))
        if init == "uniform":
            nn.init.uniform_(self.weights, 0.0, 1.0)

    def forward(self, hidden: torch.Tensor, layer_dim: int = 1) -> torch.Tensor:
        """``hidden``: [..., num_layers (at ``layer_dim``), ...] -> same without that dim."""
        if hidden.size(layer_dim) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} hidden states, got {hidden.size(layer_dim)}")
        layer_dim = layer_dim % hidden.dim()
        before, after = hidden.shape[:layer_dim], hidden.shape[layer_dim + 1:]
        # one pass over the hidden states: a batched vector-matrix product (no [..., L, ...]
        # temporary as large as the input), in the input's dtype: it is bound by memory, and
        # autocast would first copy the input into 16 bits
        with torch.autocast(hidden.device.type, enabled=False):
            alpha = torch.softmax(self.weights.float(), dim=0).to(hidden.dtype)
            h = hidden.reshape(math.prod(before), self.num_layers, math.prod(after))
            out = torch.matmul(alpha.view(1, 1, -1), h)  # [P, 1, A]
        return out.reshape(*before, *after)
