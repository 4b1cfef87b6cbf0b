"""Object features as the Transform and Tell reference stored them (``annotate_yolo3.py``): YOLOv3
boxes (:mod:`tellkit.encoders.yolov3`: input 416, confidence 0.3, NMS IoU 0.6, by decreasing
score, at most 64), each box cropped from the image (integer box clipped to the image, no
margin), resized to 224 x 224 (bicubic), normalised with the ImageNet mean / std and passed
through ResNet-152; the last block's 7 x 7 grid averaged gives one 2048-d vector per object.

    enc = ObjectEncoder.from_files("yolov3.weights", "resnet152-394f9c45.pth")
    feats, det = enc.encode(pil_image)     # float[K, 2048], Detections (boxes in image pixels)

The detector's weights are darknet's ``yolov3.weights`` (the official release); the ResNet is a
torchvision ResNet-152 state dict (the image encoder's, when that is ResNet-152). ``"random"``
for either builds an untrained network (tests, dry runs).
"""
from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from tellkit.encoders import weights as W
from tellkit.encoders.preprocess import to_tensor
from tellkit.encoders.resnet import ResNet, resnet
from tellkit.encoders.yolov3 import (
    CONF_THRES,
    IMG_SIZE,
    IOU_THRES,
    MAX_OBJECTS,
    Detections,
    YOLOv3,
    detect,
    load_darknet_weights,
    parse_cfg,
)
from tellkit.errors import TellkitError

CROP_SIZE = 224
OBJECT_FEATURE_DIM = 2048
WEIGHTS_HELP = ("encoders.object_weights=PATH to darknet's yolov3.weights "
                "(https://pjreddie.com/media/files/yolov3.weights)")


def crop_box(image: Image.Image, box, size: int = CROP_SIZE) -> Image.Image:
    """The reference's crop of one xyxy box: integer coordinates clipped to the image (a box that
    clipping left empty keeps one pixel), resized to ``size`` x ``size`` with bicubic filtering."""
    w, h = image.size
    x1, y1 = int(max(float(box[0]), 0)), int(max(float(box[1]), 0))
    x2, y2 = int(min(float(box[2]), w)), int(min(float(box[3]), h))
    x1, y1 = min(x1, w - 1), min(y1, h - 1)
    x2, y2 = max(x2, x1 + 1), max(y2, y1 + 1)
    return image.crop((x1, y1, x2, y2)).resize((size, size), Image.Resampling.BICUBIC)


class ObjectEncoder:
    """YOLOv3 boxes -> ResNet-152 vectors of their crops (module docstring)."""

    def __init__(self, detector: YOLOv3, backbone: ResNet, *, conf_thres: float = CONF_THRES,
                 iou_thres: float = IOU_THRES, max_objects: int = MAX_OBJECTS, img_size: int = IMG_SIZE,
                 batch_size: int = 16):
        self.detector = detector.eval().requires_grad_(False)
        self.backbone = backbone.eval().requires_grad_(False)
        self.conf_thres, self.iou_thres, self.max_objects = conf_thres, iou_thres, int(max_objects)
        self.img_size, self.batch_size = int(img_size), int(batch_size)
        self.out_dim = backbone.out_dim

    @classmethod
    def from_files(cls, yolo_weights: str | Path | None, resnet_weights, *, cfg: str | Path | None = None,
                   **kwargs) -> ObjectEncoder:
        """``yolo_weights``: darknet ``.weights`` or ``"random"``; ``resnet_weights``: a torchvision
        ResNet-152 state dict file, a loaded state dict, a ResNet-152 module, or ``"random"``."""
        if not yolo_weights:
            raise TellkitError(f"the objects encoder (YOLOv3) needs its weights: {WEIGHTS_HELP}")
        layers = None
        if cfg:
            path = Path(cfg)
            if not path.is_file():
                raise TellkitError(f"YOLOv3 cfg: {cfg} is not a file")
            layers = parse_cfg(path.read_text(encoding="utf-8"))
        detector = YOLOv3(layers)
        if str(yolo_weights) != "random":
            load_darknet_weights(detector, yolo_weights)
        return cls(detector, _resnet152(resnet_weights), **kwargs)

    def to(self, device) -> ObjectEncoder:
        self.detector.to(device)
        self.backbone.to(device)
        return self

    @torch.no_grad()
    def features(self, image: Image.Image, det: Detections) -> torch.Tensor:
        """float[K, 2048]: the crops of ``det``'s boxes through ResNet-152, grid averaged."""
        if not len(det):
            return torch.zeros(0, self.out_dim)
        device = next(self.backbone.parameters()).device
        rgb = image.convert("RGB")
        out = []
        for start in range(0, len(det), self.batch_size):
            crops = [to_tensor(crop_box(rgb, b)) for b in det.boxes[start:start + self.batch_size]]
            grid = self.backbone.forward_features(torch.stack(crops).to(device))
            out.append(grid.mean(dim=(2, 3)).float().cpu())
        return torch.cat(out)

    @torch.no_grad()
    def encode(self, image: Image.Image) -> tuple[torch.Tensor, Detections]:
        """One PIL image -> (object vectors float[K, 2048], the kept detections), K <= max_objects."""
        det = detect(self.detector, image.convert("RGB"), img_size=self.img_size, conf_thres=self.conf_thres,
                     iou_thres=self.iou_thres, max_det=self.max_objects)
        return self.features(image, det), det


def _resnet152(weights) -> ResNet:
    if isinstance(weights, ResNet):
        return weights
    if weights is None:
        raise TellkitError("the objects encoder needs ResNet-152 weights (a torchvision resnet152-*.pth state "
                           "dict: encoders.image_weights with encoders.image=resnet152, or "
                           "encoders.object_resnet_weights)")
    net = resnet("resnet152")
    if isinstance(weights, str) and weights == "random":
        return net
    what = "objects encoder ResNet-152"
    state = weights if isinstance(weights, dict) else W.read_weights_file(weights, what)
    W.load_strict(net, state, what, source="" if isinstance(weights, dict) else str(weights))
    return net
