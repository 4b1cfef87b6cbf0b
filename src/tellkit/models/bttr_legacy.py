"""BTTR in tellkit 0.1's own layout (family ``bttr_legacy``): the model checkpoints written by
tellkit 0.1 hold, kept so that they still load and give the outputs they gave.

It is :class:`tellkit.models.bttr.BTTR` (same decoder layers, loss and search) with three parts
of its own, none of which a change of weights can turn into the reference's layout:

* a pre-activation DenseNet: each layer is BN-ReLU-1x1 conv (4k)-BN-ReLU-3x3 conv (k), then
  dropout, so every layer normalises the whole concatenation it reads with its own statistics
  (the reference's layers read it as it is and normalise their own outputs); a transition is
  BN-ReLU-1x1 conv-2x2 average pool; the last BatchNorm is followed by a ReLU;
* image positions: per axis a block of sines then a block of cosines at d/4 frequencies
  10000^(-2j/(d/2)) (the reference's cosines use the odd frequencies in between);
* word positions: :class:`tellkit.layers.positional.SinusoidalPositions`.

A checkpoint whose config says ``variant: tellkit-0.1``, or a BTTR config.json that tellkit 0.1
wrote (no ``variant``), is read as this family (:func:`tellkit.checkpoint.upgrade_checkpoint_meta`).
``configs/bttr/cpu.yaml`` trains it as tellkit 0.1 did. There is no export of it to the
reference's format or to ONNX (its layers are not the reference's). 6,409,481 parameters at
``configs/bttr/crohme.yaml``'s sizes (the reference's layout: 6,375,425).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.layers.dropout import FastDropout
from tellkit.layers.positional import SinusoidalPositions
from tellkit.models.bttr import BTTR, BTTRConfig, Decoder, DenseNetB, Encoder, _masked
from tellkit.registry import register_model


@dataclass
class BTTRLegacyConfig(BTTRConfig):
    """:class:`tellkit.models.bttr.BTTRConfig`'s fields, for tellkit 0.1's layout."""


class PreactBottleneck(nn.Module):
    """BN-ReLU-1x1 conv (4k) - BN-ReLU-3x3 conv (k), dropout; concatenated to the input."""

    def __init__(self, cin: int, growth: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.drop = FastDropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.conv1(F.relu(self.bn1(x)))
        h = self.conv2(_masked(F.relu(self.bn2(h)), mask))
        return torch.cat([x, _masked(self.drop(h), mask)], 1)


class PreactTransition(nn.Module):
    """BN-ReLU-1x1 conv (compression) - 2x2 average pool."""

    def __init__(self, cin: int, cout: int, dropout: float):
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.avg_pool2d(_masked(self.conv(F.relu(self.bn(x))), mask), 2, ceil_mode=True)


class PreactDenseNet(DenseNetB):
    """BTTR's DenseNet with pre-activation layers and a ReLU after the last BatchNorm; always
    computed layer by layer (the folded inference path assumes conv-BN order)."""

    layer_class, transition_class = PreactBottleneck, PreactTransition

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = None if mask is None or bool(mask.all()) else mask
        x, mask = self.run_layers(x, mask, m)
        return F.relu(x), mask


def _sin_cos_blocks(pos: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    ang = pos.float()[..., None] * freqs
    return torch.cat([ang.sin(), ang.cos()], -1)


def legacy_image_positions(mask: torch.Tensor, d_model: int) -> torch.Tensor:
    """[B, H, W, d]: per axis (x, then y) a sin block | cos block at d/4 frequencies, over the
    coordinates of real pixels normalised to (0, 2 pi]."""
    m = mask.float()
    y = m.cumsum(1)
    x = m.cumsum(2)
    y = y / (y[:, -1:, :] + 1e-6) * 2 * math.pi
    x = x / (x[:, :, -1:] + 1e-6) * 2 * math.pi
    return torch.cat([_sin_cos_blocks(x, d_model // 2), _sin_cos_blocks(y, d_model // 2)], -1)


class LegacyEncoder(Encoder):
    densenet_class = PreactDenseNet
    positions = staticmethod(legacy_image_positions)


class LegacyDecoder(Decoder):
    def __init__(self, c: BTTRLegacyConfig):
        super().__init__(c)
        self.word_positions = SinusoidalPositions(c.d_model)

    def positions(self, length: int, start: int, device) -> torch.Tensor:
        return self.word_positions(length, start).to(device)


@register_model("bttr_legacy", BTTRLegacyConfig)
class BTTRLegacy(BTTR):
    encoder_class, decoder_class = LegacyEncoder, LegacyDecoder
