"""ResNet-50/101/152 (He et al., CVPR 2016), bottleneck version "1.5" (stride on the 3x3 conv),
with torchvision's parameter names so that a user's torchvision state dict loads strictly.

Transform and Tell uses ResNet-152's last block before pooling on a 224 x 224 input:
``layer4`` gives 2048 x 7 x 7 = 49 vectors of 2048-d. No ResNet weights can be had offline
here: users bring a file (e.g. torchvision's ``resnet152-394f9c45.pth``).

Parameter counts (with the 1000-way ``fc``): ResNet-50 25,557,032; ResNet-101 44,549,160;
ResNet-152 60,192,808.
"""
from __future__ import annotations

import torch
from torch import nn

BLOCKS = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3), "resnet152": (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride here) -> 1x1 expand (x4), plus identity or projection skip."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class ResNet(nn.Module):
    out_dim = 2048

    def __init__(self, layers: tuple[int, int, int, int], num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, width, stride if j == 0 else 1))
                cin = width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(self.out_dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """float[B, 3, H, W] -> float[B, 2048, H/32, W/32] (output of layer4, before pooling)."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))

    def forward_head(self, grid: torch.Tensor) -> torch.Tensor:
        return self.fc(grid.mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def resnet(name: str, **kwargs) -> ResNet:
    return ResNet(BLOCKS[name], **kwargs)
