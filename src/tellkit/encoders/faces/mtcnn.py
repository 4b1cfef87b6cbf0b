"""MTCNN face detection (Zhang et al., "Joint Face Detection and Alignment using Multi-task
Cascaded Convolutional Networks", IEEE SPL 2016), in plain PyTorch (no torchvision, no OpenCV).

Three cascaded networks; parameter names follow facenet-pytorch's ``pnet.pt`` / ``rnet.pt`` /
``onet.pt``, which ship offline in the ``facenet-pytorch`` wheel and are loaded as data only:

1. P-Net, fully convolutional over an image pyramid (scale factor 0.709, smallest face 20 px):
   each 12 x 12 window (stride 2) gets a face probability and a box regression; windows over
   the threshold are kept, non-maximum suppression per scale (IoU 0.5) and across scales (0.7).
2. R-Net on 24 x 24 crops of the squared, regressed candidates: re-score, NMS 0.7, regress.
3. O-Net on 48 x 48 crops: final score, box regression and five landmarks (eyes, nose, mouth
   corners); NMS 0.7 measured on the smaller box ("min" overlap).

Crops that stick out of the image are zero-padded (as in the original MATLAB code) and
resized with area averaging. Pixel input is RGB 0..255, normalised as (x - 127.5) / 128.
The weights' fully connected layers expect the conv features flattened in (W, H, C) order
(they were converted from Caffe), hence the permute before ``dense4`` / ``dense5``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from tellkit.encoders import weights as W


class PNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 10, 3), nn.PReLU(10)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(10, 16, 3), nn.PReLU(16)
        self.conv3, self.prelu3 = nn.Conv2d(16, 32, 3), nn.PReLU(32)
        self.conv4_1 = nn.Conv2d(32, 2, 1)  # face / not face
        self.conv4_2 = nn.Conv2d(32, 4, 1)  # box regression

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return self.conv4_2(x), F.softmax(self.conv4_1(x), dim=1)


def _flatten_whc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 3, 2, 1).reshape(x.shape[0], -1)


class RNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 28, 3), nn.PReLU(28)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(28, 48, 3), nn.PReLU(48)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(48, 64, 2), nn.PReLU(64)
        self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu4(self.dense4(_flatten_whc(self.prelu3(self.conv3(x)))))
        return self.dense5_2(x), F.softmax(self.dense5_1(x), dim=1)


class ONet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)  # landmarks: 5 x, then 5 y (relative to the box)

    def forward(self, x):
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu5(self.dense5(_flatten_whc(self.prelu4(self.conv4(x)))))
        return self.dense6_2(x), F.softmax(self.dense6_1(x), dim=1), self.dense6_3(x)


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, mode: str = "union") -> np.ndarray:
    """Greedy non-maximum suppression; boxes [N, 4] as inclusive pixel corners. Returns the
    kept indices, best first. ``mode="min"``: overlap over the smaller box's area."""
    if len(boxes) == 0:
        return np.zeros(0, dtype=np.int64)
    x1, y1, x2, y2 = boxes.T
    area = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]) + 1)
        inter = w * h
        denom = np.minimum(area[i], area[rest]) if mode == "min" else area[i] + area[rest] - inter
        order = rest[inter / denom <= threshold]
    return np.asarray(keep, dtype=np.int64)


def _square(boxes: np.ndarray) -> np.ndarray:
    """Grow each box to a square around its centre (side = the longer side)."""
    out = boxes.copy()
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    side = np.maximum(w, h)
    out[:, 0] = boxes[:, 0] + (w - side) / 2
    out[:, 1] = boxes[:, 1] + (h - side) / 2
    out[:, 2:4] = out[:, 0:2] + side[:, None]
    return out


def _regress(boxes: np.ndarray, reg: np.ndarray, plus_one: bool = True) -> np.ndarray:
    """Apply the networks' box regression (offsets relative to the box's width/height)."""
    extra = 1.0 if plus_one else 0.0
    w = boxes[:, 2] - boxes[:, 0] + extra
    h = boxes[:, 3] - boxes[:, 1] + extra
    return boxes[:, :4] + reg * np.stack([w, h, w, h], axis=1)


def _crops(img: torch.Tensor, boxes: np.ndarray, size: int) -> torch.Tensor:
    """Crop each (inclusive, possibly out-of-image) box, zero-padding outside the image, and
    resize to size x size with area averaging. img: float[3, H, W] in 0..255."""
    _, H, W_ = img.shape
    out = []
    for x1, y1, x2, y2 in np.trunc(boxes[:, :4]).astype(np.int64):
        bw, bh = max(int(x2 - x1 + 1), 1), max(int(y2 - y1 + 1), 1)
        patch = img.new_zeros(3, bh, bw)
        sx1, sy1, sx2, sy2 = max(x1, 0), max(y1, 0), min(x2 + 1, W_), min(y2 + 1, H)
        if sx2 > sx1 and sy2 > sy1:
            patch[:, sy1 - y1: sy2 - y1, sx1 - x1: sx2 - x1] = img[:, sy1:sy2, sx1:sx2]
        out.append(F.interpolate(patch[None], size=(size, size), mode="area"))
    return torch.cat(out) if out else img.new_zeros(0, 3, size, size)


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return (x - 127.5) * 0.0078125


@dataclass
class Detections:
    boxes: np.ndarray      # float[F, 4] x1, y1, x2, y2 in pixels
    probs: np.ndarray      # float[F]
    landmarks: np.ndarray  # float[F, 5, 2] (x, y): left eye, right eye, nose, mouth left, right

    def __len__(self) -> int:
        return len(self.boxes)


class MTCNN(nn.Module):
    """The three-stage detector; ``detect(PIL image) -> Detections`` (any number of faces)."""

    def __init__(self, min_face_size: int = 20, thresholds=(0.6, 0.7, 0.7), factor: float = 0.709,
                 pretrained: bool = True):
        super().__init__()
        self.pnet, self.rnet, self.onet = PNet(), RNet(), ONet()
        self.min_face_size, self.thresholds, self.factor = min_face_size, tuple(thresholds), factor
        if pretrained:
            for name in ("pnet", "rnet", "onet"):
                sd = W.read_weights_file(W.mtcnn_weights(name), f"MTCNN {name}")
                W.load_strict(getattr(self, name), sd, f"MTCNN {name}", source="facenet-pytorch")
        self.eval().requires_grad_(False)

    def train(self, mode: bool = True) -> MTCNN:
        return super().train(False)

    def _scales(self, h: int, w: int) -> list[float]:
        m = 12.0 / self.min_face_size
        side, scales = min(h, w) * m, []
        while side >= 12:
            scales.append(m * self.factor ** len(scales))
            side *= self.factor
        return scales

    def _stage1(self, img: torch.Tensor) -> np.ndarray:
        _, H, W_ = img.shape
        found = []
        for s in self._scales(H, W_):
            small = F.interpolate(img[None], size=(int(H * s + 1), int(W_ * s + 1)), mode="area")
            reg, prob = self.pnet(_normalise(small))
            reg, p = reg.cpu(), prob[0, 1].cpu().numpy()
            ys, xs = np.nonzero(p >= self.thresholds[0])
            if len(ys) == 0:
                continue
            # window (stride 2, 12 x 12 in the scaled image) -> inclusive corners in the image
            x1, y1 = np.floor((2 * xs + 1) / s), np.floor((2 * ys + 1) / s)
            x2, y2 = np.floor((2 * xs + 12) / s), np.floor((2 * ys + 12) / s)
            r = reg[0].numpy()[:, ys, xs].T
            cand = np.column_stack([x1, y1, x2, y2, p[ys, xs], r])
            found.append(cand[nms(cand[:, :4], cand[:, 4], 0.5)])
        if not found:
            return np.zeros((0, 5))
        cand = np.concatenate(found)
        cand = cand[nms(cand[:, :4], cand[:, 4], 0.7)]
        boxes = _square(_regress(cand[:, :4], cand[:, 5:9], plus_one=False))
        return np.column_stack([boxes, cand[:, 4]])

    def _refine(self, img: torch.Tensor, cand: np.ndarray, net: nn.Module, size: int, threshold: float):
        out = [o.cpu().numpy() for o in net(_normalise(_crops(img, cand, size)))]
        reg, prob = out[0], out[1][:, 1]
        keep = prob >= threshold
        return cand[keep, :4], prob[keep], reg[keep], (out[2][keep] if len(out) > 2 else None)

    @torch.no_grad()
    def detect(self, image: Image.Image) -> Detections:
        device = self.pnet.conv1.weight.device
        img = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32).copy()).permute(2, 0, 1).to(device)
        empty = Detections(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros((0, 5, 2), np.float32))
        cand = self._stage1(img)
        if len(cand) == 0:
            return empty
        boxes, probs, reg, _ = self._refine(img, cand, self.rnet, 24, self.thresholds[1])
        if len(boxes) == 0:
            return empty
        keep = nms(boxes, probs, 0.7)
        boxes = _square(_regress(boxes[keep], reg[keep]))
        boxes, probs, reg, marks = self._refine(img, boxes, self.onet, 48, self.thresholds[2])
        if len(boxes) == 0:
            return empty
        w = (boxes[:, 2] - boxes[:, 0] + 1)[:, None]
        h = (boxes[:, 3] - boxes[:, 1] + 1)[:, None]
        lm = np.stack([boxes[:, :1] + w * marks[:, :5] - 1, boxes[:, 1:2] + h * marks[:, 5:] - 1], axis=-1)
        boxes = _regress(boxes, reg)
        keep = nms(boxes, probs, 0.7, mode="min")
        return Detections(boxes[keep].astype(np.float32), probs[keep].astype(np.float32), lm[keep].astype(np.float32))
