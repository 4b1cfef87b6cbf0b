"""YOLOv3 (Redmon and Farhadi 2018), the object detector behind Transform and Tell's objects
context: the darknet network, its ``yolov3.weights`` file, box decoding and non-maximum
suppression, as the reference's ``annotate_yolo3.py`` ran them.

    net = YOLOv3.from_darknet("yolov3.weights")            # the official COCO model (80 classes)
    boxes = detect(net, pil_image)                          # Detections: xyxy (image pixels), score, cls

The network is the layer list of darknet's ``yolov3.cfg`` (:func:`yolov3_layers`, built in
code; :func:`parse_cfg` reads any cfg of the same layer types, e.g. ``yolov3-spp.cfg``):
Darknet-53 (75 convolutions with batch norm and leaky ReLU 0.1, residual ``shortcut`` layers)
and three ``yolo`` heads at strides 32, 16, 8 with anchors (10,13) ... (373,326). 62,001,757
parameters for 80 classes.

Weights file (darknet's own binary format, little-endian): a header of int32 major, minor,
revision and ``seen`` (int64 when major * 10 + minor >= 2, else int32), then for every
convolution in cfg order: with batch norm, its beta (bias), gamma (scale), running mean and
running variance, else the convolution's bias; then the convolution's weights [out, in, k, k];
all float32. The official ``yolov3.weights`` (248,007,048 bytes) is the darknet release's.

Inference, as the reference's detector (ultralytics' YOLOv3 port of early 2020):

- letterbox: the long side resized to ``img_size`` (416), the short side to the nearest size
  whose padding to a multiple of 32 is split on both sides, grey (128) padding, RGB / 255;
- decoding of each head's [B, A * (5 + C), H, W] output: x, y = (sigmoid(tx, ty) + cell) *
  stride; w, h = exp(tw, th) * anchor (input pixels); objectness and class scores sigmoid;
- :func:`non_max_suppression`: rows whose objectness > ``conf_thres`` (0.3) and whose width and
  height lie in (2, 4096) pixels; class scores times objectness; every (box, class) pair whose
  score > ``conf_thres`` is a candidate; greedy NMS per class at IoU ``iou_thres`` (0.6); the
  kept boxes by decreasing score; the reference then keeps the first 64;
- boxes mapped back to the image (padding removed, divided by the resize gain, clipped, rounded).

Each kept box's crop then goes through ResNet-152 (:mod:`tellkit.encoders.objects`).
"""
from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from tellkit.errors import TellkitError

ANCHORS = ((10, 13), (16, 30), (33, 23), (30, 61), (62, 45), (59, 119), (116, 90), (156, 198), (373, 326))
COCO_CLASSES = 80
CONF_THRES, IOU_THRES, MAX_OBJECTS, IMG_SIZE = 0.3, 0.6, 64, 416
MIN_WH, MAX_WH = 2.0, 4096.0
LAYER_TYPES = ("convolutional", "shortcut", "route", "upsample", "maxpool", "yolo")


def _conv(filters: int, size: int, stride: int = 1, bn: bool = True, activation: str = "leaky") -> dict:
    return {"type": "convolutional", "batch_normalize": int(bn), "filters": filters, "size": size,
            "stride": stride, "pad": 1, "activation": activation}


def _head(filters: int, mask: Sequence[int], num_classes: int, spp: bool = False) -> list[dict]:
    layers = [_conv(filters, 1), _conv(filters * 2, 3), _conv(filters, 1)]
    if spp:  # yolov3-spp.cfg: max pools of 5, 9, 13 concatenated before the fourth convolution
        layers += [{"type": "maxpool", "size": 5, "stride": 1}, {"type": "route", "layers": [-2]},
                   {"type": "maxpool", "size": 9, "stride": 1}, {"type": "route", "layers": [-4]},
                   {"type": "maxpool", "size": 13, "stride": 1}, {"type": "route", "layers": [-1, -3, -5, -6]},
                   _conv(filters, 1)]
    layers += [_conv(filters * 2, 3), _conv(filters, 1), _conv(filters * 2, 3),
               _conv(len(mask) * (5 + num_classes), 1, bn=False, activation="linear"),
               {"type": "yolo", "mask": list(mask), "anchors": [list(a) for a in ANCHORS], "classes": num_classes}]
    return layers


def yolov3_layers(num_classes: int = COCO_CLASSES, spp: bool = False) -> list[dict]:
    """The layer list of darknet's ``yolov3.cfg`` (``spp=True``: ``yolov3-spp.cfg``), each layer a
    dict of its cfg keys; ``route`` layers as lists of relative or absolute indices."""
    layers = [_conv(32, 3)]
    routes = {}
    for filters, repeats in ((64, 1), (128, 2), (256, 8), (512, 8), (1024, 4)):
        layers.append(_conv(filters, 3, stride=2))
        for _ in range(repeats):
            layers += [_conv(filters // 2, 1), _conv(filters, 3), {"type": "shortcut", "from": -3,
                                                                  "activation": "linear"}]
        routes[filters] = len(layers) - 1  # 36 (256), 61 (512), 74 (1024)
    layers += _head(512, (6, 7, 8), num_classes, spp)
    for filters, skip in ((256, routes[512]), (128, routes[256])):
        layers += [{"type": "route", "layers": [-4]}, _conv(filters, 1), {"type": "upsample", "stride": 2},
                   {"type": "route", "layers": [-1, skip]}]
        layers += _head(filters, (3, 4, 5) if filters == 256 else (0, 1, 2), num_classes)
    return layers


def _value(text: str) -> Any:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    nums = []
    for p in parts:
        try:
            nums.append(int(p))
        except ValueError:
            try:
                nums.append(float(p))
            except ValueError:
                return text.strip()
    return nums if len(nums) != 1 or "," in text else nums[0]


def parse_cfg(text: str) -> list[dict]:
    """A darknet ``.cfg`` (``[section]`` headers, ``key=value`` lines, ``#`` comments) as the layer
    list of :func:`yolov3_layers` (the ``[net]`` section dropped; ``anchors`` as pairs)."""
    sections: list[dict] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise TellkitError(f"cfg line {n}: unclosed section header {line!r}")
            sections.append({"type": line[1:-1].strip()})
        elif "=" in line and sections:
            key, val = line.split("=", 1)
            sections[-1][key.strip()] = _value(val)
        else:
            raise TellkitError(f"cfg line {n}: expected [section] or key=value, got {line!r}")
    layers = [s for s in sections if s["type"] != "net"]
    for i, layer in enumerate(layers):
        if layer["type"] not in LAYER_TYPES:
            raise TellkitError(f"cfg layer {i}: type [{layer['type']}] is not supported ({', '.join(LAYER_TYPES)})")
        if layer["type"] == "route":
            layer["layers"] = [layer["layers"]] if isinstance(layer["layers"], int) else list(layer["layers"])
        if layer["type"] == "yolo":
            flat = layer.get("anchors", [])
            layer["anchors"] = [flat[j:j + 2] for j in range(0, len(flat), 2)]
            layer["mask"] = [layer["mask"]] if isinstance(layer["mask"], int) else list(layer["mask"])
            layer["classes"] = int(layer.get("classes", COCO_CLASSES))
    return layers


class ConvBNLeaky(nn.Module):
    """A darknet ``convolutional`` layer: conv (padding (k - 1) // 2; no bias with batch norm),
    batch norm, leaky ReLU 0.1 (or linear)."""

    def __init__(self, cin: int, spec: dict):
        super().__init__()
        k, bn = int(spec["size"]), bool(spec.get("batch_normalize", 0))
        pad = (k - 1) // 2 if int(spec.get("pad", 0)) else int(spec.get("padding", 0))
        self.conv = nn.Conv2d(cin, int(spec["filters"]), k, int(spec.get("stride", 1)), pad, bias=not bn)
        self.bn = nn.BatchNorm2d(int(spec["filters"]), momentum=0.01, eps=1e-5) if bn else None
        act = spec.get("activation", "linear")
        if act not in ("leaky", "linear"):
            raise TellkitError(f"cfg: convolutional activation {act!r} is not supported (leaky, linear)")
        self.leaky = act == "leaky"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        return nn.functional.leaky_relu(x, 0.1) if self.leaky else x


def decode_head(p: torch.Tensor, anchors: torch.Tensor, stride: float) -> torch.Tensor:
    """One yolo head's raw output float[B, A * (5 + C), H, W] -> float[B, A * H * W, 5 + C]:
    centre x, y and width, height in input pixels, objectness and class probabilities."""
    b, _, h, w = p.shape
    a = anchors.shape[0]
    p = p.view(b, a, -1, h, w).permute(0, 1, 3, 4, 2).float()
    gy, gx = torch.meshgrid(torch.arange(h, device=p.device), torch.arange(w, device=p.device), indexing="ij")
    grid = torch.stack((gx, gy), -1).view(1, 1, h, w, 2).to(p.dtype)
    xy = (torch.sigmoid(p[..., :2]) + grid) * stride
    wh = torch.exp(p[..., 2:4]) * anchors.view(1, a, 1, 1, 2).to(p)
    return torch.cat((xy, wh, torch.sigmoid(p[..., 4:])), -1).view(b, -1, p.shape[-1])


class YOLOv3(nn.Module):
    """The darknet network of a layer list (:func:`yolov3_layers` or :func:`parse_cfg`). In eval
    mode ``forward`` gives the decoded predictions of all heads, float[B, N, 5 + C] (x, y, w, h in
    input pixels, objectness, class probabilities); ``raw=True`` gives the heads' outputs."""

    def __init__(self, layers: list[dict] | None = None):
        super().__init__()
        self.layers_spec = layers if layers is not None else yolov3_layers()
        self.blocks = nn.ModuleList()
        self.heads: list[tuple[int, list[tuple[float, float]]]] = []
        channels: list[int] = []
        cin = 3
        for i, spec in enumerate(self.layers_spec):
            kind = spec["type"]
            block: nn.Module = nn.Identity()
            if kind == "convolutional":
                block = ConvBNLeaky(cin, spec)
                cin = int(spec["filters"])
            elif kind == "route":
                cin = sum(channels[j if j >= 0 else i + j] for j in spec["layers"])
            elif kind == "maxpool":
                size, stride = int(spec["size"]), int(spec.get("stride", 1))
                block = nn.MaxPool2d(size, stride, (size - 1) // 2)
            elif kind == "yolo":
                self.heads.append((i, [tuple(spec["anchors"][m]) for m in spec["mask"]]))
                self.num_classes = int(spec["classes"])
            channels.append(cin)
            self.blocks.append(block)
        if not self.heads:
            raise TellkitError("cfg: the network has no [yolo] layer")

    def forward(self, x: torch.Tensor, raw: bool = False):
        outs: list[torch.Tensor] = []
        heads = []
        size = x.shape[-2:]
        for i, (spec, block) in enumerate(zip(self.layers_spec, self.blocks)):
            kind = spec["type"]
            if kind == "shortcut":
                x = x + outs[i + int(spec["from"])]
            elif kind == "route":
                x = torch.cat([outs[j if j >= 0 else i + j] for j in spec["layers"]], 1)
            elif kind == "upsample":
                x = nn.functional.interpolate(x, scale_factor=int(spec["stride"]), mode="nearest")
            elif kind == "yolo":
                heads.append(x)
            else:
                x = block(x)
            outs.append(x)
        if raw:
            return heads
        decoded = []
        for (_, anchors), p in zip(self.heads, heads):
            stride = size[0] / p.shape[-2]
            decoded.append(decode_head(p, torch.tensor(anchors, dtype=torch.float32), stride))
        return torch.cat(decoded, 1)

    def convolutions(self) -> list[ConvBNLeaky]:
        """The convolutional layers in cfg order (the order of the weights file)."""
        return [b for b in self.blocks if isinstance(b, ConvBNLeaky)]

    @classmethod
    def from_darknet(cls, path: str | Path, cfg: str | Path | None = None) -> YOLOv3:
        """The network of ``cfg`` (default: yolov3.cfg, 80 classes) with the weights of a darknet
        ``.weights`` file, in eval mode."""
        layers = parse_cfg(Path(cfg).read_text(encoding="utf-8")) if cfg else None
        net = cls(layers)
        load_darknet_weights(net, path)
        return net.eval()


HEADER = struct.Struct("<iii")


def _tensors(conv: ConvBNLeaky) -> list[torch.Tensor]:
    """The tensors of one convolutional layer in the weights file's order."""
    out = []
    if conv.bn is not None:
        out += [conv.bn.bias, conv.bn.weight, conv.bn.running_mean, conv.bn.running_var]
    else:
        out.append(conv.conv.bias)
    out.append(conv.conv.weight)
    return out


def expected_floats(net: YOLOv3) -> int:
    return sum(t.numel() for c in net.convolutions() for t in _tensors(c))


def load_darknet_weights(net: YOLOv3, path: str | Path) -> tuple[int, int, int, int]:
    """Fill ``net`` from a darknet ``.weights`` file; the header (major, minor, revision, seen).
    A file whose size does not match the network is refused in one line before anything is read
    into it."""
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"YOLOv3 weights: {path} is not a file (yolov3.weights comes from the darknet "
                           "release, https://pjreddie.com/media/files/yolov3.weights)")
    data = p.read_bytes()
    if len(data) < HEADER.size + 4:
        raise TellkitError(f"YOLOv3 weights: {path} is too short for a darknet weights file")
    major, minor, revision = HEADER.unpack_from(data, 0)
    wide = major * 10 + minor >= 2 and major < 1000 and minor < 1000
    seen = struct.unpack_from("<q" if wide else "<i", data, HEADER.size)[0]
    offset = HEADER.size + (8 if wide else 4)
    need = expected_floats(net)
    have = (len(data) - offset) // 4
    if have != need or (len(data) - offset) % 4:
        raise TellkitError(f"YOLOv3 weights: {path} holds {have:,} floats after its header, the network needs "
                           f"{need:,} (a different cfg or number of classes?)")
    values = torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=offset).astype(np.float32))
    pos = 0
    with torch.no_grad():
        for conv in net.convolutions():
            for t in _tensors(conv):
                t.copy_(values[pos:pos + t.numel()].view_as(t))
                pos += t.numel()
    return major, minor, revision, seen


def save_darknet_weights(net: YOLOv3, path: str | Path, version: tuple[int, int, int] = (0, 2, 0),
                         seen: int = 0) -> None:
    """Write ``net`` as a darknet ``.weights`` file (the format :func:`load_darknet_weights` reads)."""
    major, minor, _ = version
    buf = io.BytesIO()
    buf.write(HEADER.pack(*version))
    buf.write(struct.pack("<q" if major * 10 + minor >= 2 else "<i", seen))
    for conv in net.convolutions():
        for t in _tensors(conv):
            buf.write(t.detach().cpu().float().numpy().astype("<f4").tobytes())
    Path(path).write_bytes(buf.getvalue())


# --- detections ---------------------------------------------------------------------------------
@dataclass
class Detections:
    """Kept boxes of one image, by decreasing score: ``boxes`` float[K, 4] (x1, y1, x2, y2),
    ``scores`` float[K] (objectness x class probability), ``classes`` long[K]."""

    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor

    def __len__(self) -> int:
        return int(self.boxes.shape[0])

    def __getitem__(self, index) -> Detections:
        return Detections(self.boxes[index], self.scores[index], self.classes[index])


def xywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    return torch.cat((b[:, :2] - b[:, 2:4] / 2, b[:, :2] + b[:, 2:4] / 2), 1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU matrix [N, M] of xyxy boxes."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    inter = (torch.min(a[:, None, 2:], b[:, 2:]) - torch.max(a[:, None, :2], b[:, :2])).clamp(min=0).prod(2)
    return inter / (area_a[:, None] + area_b - inter)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_thres: float) -> torch.Tensor:
    """Greedy NMS: the indices kept, by decreasing score (a box is dropped when its IoU with a
    kept, higher-scoring box exceeds ``iou_thres``)."""
    order = torch.argsort(scores, descending=True, stable=True)
    keep: list[torch.Tensor] = []
    while order.numel():
        best = order[0]
        keep.append(best)
        rest = order[1:]
        order = rest[box_iou(boxes[best].view(1, 4), boxes[rest])[0] <= iou_thres]
    return torch.stack(keep) if keep else torch.zeros(0, dtype=torch.long)


def non_max_suppression(pred: torch.Tensor, conf_thres: float = CONF_THRES, iou_thres: float = IOU_THRES,
                        max_det: int | None = None) -> Detections:
    """One image's decoded predictions float[N, 5 + C] -> the kept detections (module docstring)."""
    pred = pred[pred[:, 4] > conf_thres]
    pred = pred[((pred[:, 2:4] > MIN_WH) & (pred[:, 2:4] < MAX_WH)).all(1)]
    scores = pred[:, 5:] * pred[:, 4:5]
    rows, cls = (scores > conf_thres).nonzero(as_tuple=True)
    boxes, conf = xywh_to_xyxy(pred[:, :4])[rows], scores[rows, cls]
    finite = torch.isfinite(boxes).all(1) & torch.isfinite(conf)
    boxes, conf, cls = boxes[finite], conf[finite], cls[finite]
    if not len(conf):
        return Detections(boxes.new_zeros((0, 4)), conf.new_zeros(0), cls.new_zeros(0))
    # per-class NMS in one pass: boxes of different classes are moved apart so they never overlap
    keep = nms(boxes + cls[:, None].to(boxes) * MAX_WH, conf, iou_thres)
    if max_det is not None:
        keep = keep[:max_det]
    return Detections(boxes[keep], conf[keep], cls[keep])


def letterbox(image, img_size: int = IMG_SIZE) -> tuple[torch.Tensor, float, tuple[float, float]]:
    """A PIL image -> (float[3, H, W] RGB in [0, 1], gain, (pad x, pad y)): the long side to
    ``img_size``, padding to a multiple of 32 split on both sides, grey 128."""
    w0, h0 = image.size
    gain = img_size / max(w0, h0)
    nw, nh = int(round(w0 * gain)), int(round(h0 * gain))
    dw, dh = (img_size - nw) % 32 / 2, (img_size - nh) % 32 / 2
    resized = image.convert("RGB").resize((nw, nh), Image.Resampling.BOX) if (nw, nh) != (w0, h0) \
        else image.convert("RGB")
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    canvas = Image.new("RGB", (nw + left + right, nh + top + bottom), (128, 128, 128))
    canvas.paste(resized, (left, top))
    arr = torch.from_numpy(np.asarray(canvas, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
    return arr, gain, (dw, dh)


def scale_boxes(boxes: torch.Tensor, input_hw: tuple[int, int], image_wh: tuple[int, int]) -> torch.Tensor:
    """xyxy boxes on the letterboxed input -> the original image's pixels (clipped, rounded)."""
    h1, w1 = input_hw
    w0, h0 = image_wh
    gain = max(h1, w1) / max(h0, w0)
    out = boxes.clone()
    out[:, [0, 2]] -= (w1 - w0 * gain) / 2
    out[:, [1, 3]] -= (h1 - h0 * gain) / 2
    out /= gain
    out[:, [0, 2]] = out[:, [0, 2]].clamp(0, w0)
    out[:, [1, 3]] = out[:, [1, 3]].clamp(0, h0)
    return out.round()


@torch.no_grad()
def detect(net: YOLOv3, image, *, img_size: int = IMG_SIZE, conf_thres: float = CONF_THRES,
           iou_thres: float = IOU_THRES, max_det: int | None = MAX_OBJECTS) -> Detections:
    """The kept objects of one PIL image, boxes in the image's pixels (module docstring)."""
    x, _, _ = letterbox(image, img_size)
    device = next(net.parameters()).device
    pred = net(x.unsqueeze(0).to(device))[0].float().cpu()
    det = non_max_suppression(pred, conf_thres, iou_thres, max_det)
    det.boxes = scale_boxes(det.boxes, tuple(x.shape[-2:]), image.size)
    return det
