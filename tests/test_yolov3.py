"""YOLOv3 objects: the darknet network and its weights file, a layer and the box decoding against
re-statements of darknet's formulas, the reference's NMS on hand-made boxes, and the objects
encoder (crops through ResNet) with random weights."""
from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from tellkit.encoders.objects import ObjectEncoder, crop_box
from tellkit.encoders.resnet import ResNet
from tellkit.encoders.yolov3 import (
    ConvBNLeaky,
    Detections,
    YOLOv3,
    decode_head,
    expected_floats,
    letterbox,
    load_darknet_weights,
    non_max_suppression,
    parse_cfg,
    save_darknet_weights,
    scale_boxes,
    yolov3_layers,
)
from tellkit.errors import TellkitError

# every layer type of yolov3(-spp).cfg, small: 2 classes, 1 anchor per head
TINY_CFG = """
[net]
width=64
height=64

[convolutional]
batch_normalize=1
filters=4
size=3
stride=1
pad=1
activation=leaky

[convolutional]
batch_normalize=1
filters=8
size=3
stride=2
pad=1
activation=leaky

[convolutional]
batch_normalize=1
filters=8
size=1
stride=1
pad=1
activation=leaky

[shortcut]
from=-2
activation=linear

[maxpool]
size=3
stride=1

[route]
layers=-1,-3

[convolutional]
size=1
stride=1
pad=1
filters=7
activation=linear

[yolo]
mask = 0
anchors = 8,8, 16,16
classes=2
num=2

[route]
layers = -3

[upsample]
stride=2

[route]
layers = -1, 0

[convolutional]
size=1
stride=1
pad=1
filters=7
activation=linear

[yolo]
mask = 1
anchors = 8,8, 16,16
classes=2
num=2
"""


def _randomised(net: YOLOv3, seed: int = 0) -> YOLOv3:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            if t.dtype.is_floating_point:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
    return net.eval()


def test_the_yolov3_cfg_layout():
    net = YOLOv3(yolov3_layers())
    assert len(net.layers_spec) == 107 and len(net.convolutions()) == 75
    assert [i for i, _ in net.heads] == [82, 94, 106]  # the three [yolo] layers of yolov3.cfg
    assert [a for _, a in net.heads][0] == [(116, 90), (156, 198), (373, 326)]
    # the official yolov3.weights is 248,007,048 bytes: a 20-byte header and these float32s
    assert expected_floats(net) == 62_001_757 and 20 + 4 * expected_floats(net) == 248_007_048
    assert sum(p.numel() for p in net.parameters()) == 61_949_149
    with torch.no_grad():
        out = net.eval()(torch.rand(1, 3, 64, 96))
    assert out.shape == (1, 3 * (2 * 3 + 4 * 6 + 8 * 12), 85)  # 3 anchors per cell at strides 32, 16, 8


def test_cfg_parser_reads_darknet_cfg_text():
    layers = parse_cfg(TINY_CFG)
    assert [x["type"] for x in layers][:6] == ["convolutional"] * 3 + ["shortcut", "maxpool", "route"]
    assert layers[5]["layers"] == [-1, -3] and layers[7]["anchors"] == [[8, 8], [16, 16]]
    assert layers[7]["mask"] == [0] and layers[10]["layers"] == [-1, 0]
    with pytest.raises(TellkitError, match="not supported"):
        parse_cfg("[net]\n[reorg]\nstride=2\n")


@pytest.mark.parametrize("version,seen_format", [((0, 2, 0), "<q"), ((0, 1, 0), "<i")])
def test_darknet_weights_written_by_the_test_load_back_exactly(tmp_path, version, seen_format):
    net = _randomised(YOLOv3(parse_cfg(TINY_CFG)))
    # the file, written here by hand in darknet's order: header, then per convolution
    # (BN beta, gamma, mean, var | conv bias) and the conv weights
    blobs = [struct.pack("<iii", *version), struct.pack(seen_format, 1234)]
    for conv in net.convolutions():
        parts = ([conv.bn.bias, conv.bn.weight, conv.bn.running_mean, conv.bn.running_var] if conv.bn is not None
                 else [conv.conv.bias]) + [conv.conv.weight]
        blobs += [p.detach().numpy().astype("<f4").tobytes() for p in parts]
    path = tmp_path / "tiny.weights"
    path.write_bytes(b"".join(blobs))
    fresh = YOLOv3(parse_cfg(TINY_CFG))
    assert load_darknet_weights(fresh, path) == (*version, 1234)
    for (name, a), (_, b) in zip(net.state_dict().items(), fresh.state_dict().items()):
        if a.dtype.is_floating_point:
            assert torch.equal(a, b), name
    # and the writer produces the same bytes
    save_darknet_weights(net, tmp_path / "again.weights", version=version, seen=1234)
    assert (tmp_path / "again.weights").read_bytes() == path.read_bytes()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(net(x), fresh.eval()(x))


def test_a_weights_file_of_the_wrong_size_is_one_line(tmp_path):
    net = YOLOv3(parse_cfg(TINY_CFG))
    path = tmp_path / "short.weights"
    path.write_bytes(struct.pack("<iiiq", 0, 2, 0, 0) + b"\0" * 40)
    with pytest.raises(TellkitError, match="holds 10 floats after its header, the network needs"):
        load_darknet_weights(net, path)
    with pytest.raises(TellkitError, match="yolov3.weights comes from the darknet release"):
        load_darknet_weights(net, tmp_path / "missing.weights")


def test_conv_bn_leaky_against_a_restated_layer():
    """darknet's convolutional layer: y = conv(x); y = gamma * (y - mean) / sqrt(var + 1e-5) + beta;
    leaky: y if y > 0 else 0.1 * y. Computed here with explicit sums over a padded input."""
    spec = {"filters": 2, "size": 3, "stride": 2, "pad": 1, "batch_normalize": 1, "activation": "leaky"}
    layer = ConvBNLeaky(3, spec).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.conv.weight.copy_(torch.randn(2, 3, 3, 3, generator=g))
        layer.bn.weight.copy_(torch.tensor([1.5, -0.5]))
        layer.bn.bias.copy_(torch.tensor([0.2, -0.1]))
        layer.bn.running_mean.copy_(torch.tensor([0.3, -0.2]))
        layer.bn.running_var.copy_(torch.tensor([2.0, 0.5]))
    x = torch.randn(1, 3, 5, 5, generator=g)
    with torch.no_grad():
        got = layer(x)[0].numpy()
    w = layer.conv.weight.detach().numpy()
    xp = np.pad(x[0].numpy(), ((0, 0), (1, 1), (1, 1)))
    want = np.zeros((2, 3, 3))
    for o in range(2):
        for i in range(3):
            for j in range(3):
                v = float((xp[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3] * w[o]).sum())
                v = [1.5, -0.5][o] * (v - [0.3, -0.2][o]) / math.sqrt([2.0, 0.5][o] + 1e-5) + [0.2, -0.1][o]
                want[o, i, j] = v if v > 0 else 0.1 * v
    assert np.allclose(got, want, atol=1e-5)


def test_box_decoding_against_a_restatement():
    """x = (sigmoid(tx) + cx) * stride, y likewise; w = exp(tw) * anchor_w; objectness and
    classes sigmoid; order: anchor, row, column."""
    anchors = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    p = torch.zeros(1, 2 * 7, 2, 3)  # 2 anchors, 2 classes, 2 x 3 grid
    # anchor 1, row 1, column 2: tx = 0 (centre of the cell), ty = ln 3 (sigmoid 0.75), tw = ln 2, th = 0
    p[0, 7 + 1, 1, 2] = math.log(3.0)
    p[0, 7 + 2, 1, 2] = math.log(2.0)
    p[0, 7 + 4, 1, 2] = 2.0
    p[0, 7 + 6, 1, 2] = -1.0
    out = decode_head(p, anchors, stride=16.0)
    assert out.shape == (1, 2 * 2 * 3, 7)
    row = out[0, 1 * 6 + 1 * 3 + 2]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    want = [(0.5 + 2) * 16, (0.75 + 1) * 16, 2 * 30, 1 * 40, sig(2.0), 0.5, sig(-1.0)]
    assert torch.allclose(row, torch.tensor(want), atol=1e-5)
    first = out[0, 0]  # anchor 0, cell (0, 0), all zeros
    assert torch.allclose(first, torch.tensor([8.0, 8.0, 10.0, 20.0, 0.5, 0.5, 0.5]))


def _pred(rows):
    """rows of (cx, cy, w, h, objectness, class probabilities...)."""
    return torch.tensor(rows, dtype=torch.float32)


def test_nms_as_the_reference_on_hand_made_boxes():
    pred = _pred([
        [5, 5, 10, 10, 0.9, 1.0, 0.0],     # A: class 0, score 0.9
        [6, 5, 10, 10, 0.8, 1.0, 0.0],     # B: IoU with A 90/110 = 0.82 > 0.6: dropped
        [5, 5, 10, 10, 0.7, 0.0, 0.9],     # C: A's box, class 1 (per-class NMS): kept, 0.63
        [25, 25, 10, 10, 0.95, 0.5, 0.0],  # D: score 0.475, alone
        [45, 45, 10, 10, 0.6, 0.45, 0.0],  # E: score 0.27 < 0.3: dropped
        [65, 65, 10, 10, 0.2, 1.0, 0.0],   # F: objectness 0.2 < 0.3: dropped
        [85, 85, 2, 10, 0.9, 1.0, 0.0],    # G: width 2, not > 2: dropped
        [5, 7, 10, 6, 0.5, 0.8, 0.9],      # H: two classes above 0.3 (0.4, 0.45): both candidates
    ])
    det = non_max_suppression(pred, 0.3, 0.6)
    # H class 0: IoU with A = 60/100 = 0.6, not > 0.6: kept; H class 1 against C likewise
    assert det.scores.tolist() == pytest.approx([0.9, 0.63, 0.475, 0.45, 0.4])
    assert det.classes.tolist() == [0, 1, 0, 1, 0]
    assert det.boxes[0].tolist() == [0, 0, 10, 10] and det.boxes[2].tolist() == [20, 20, 30, 30]
    assert non_max_suppression(pred, 0.3, 0.5).scores.tolist() == pytest.approx([0.9, 0.63, 0.475])
    assert len(non_max_suppression(pred, 0.3, 0.6, max_det=2)) == 2
    assert len(non_max_suppression(pred[4:6], 0.3, 0.6)) == 0


def test_letterbox_and_boxes_back_to_the_image():
    img = Image.new("RGB", (200, 100), (255, 0, 0))
    x, gain, (dw, dh) = letterbox(img, 416)
    # long side 200 -> 416 (gain 2.08), short side 208, padded by 208 % 32 = 16 (8 a side)
    assert x.shape == (3, 224, 416) and gain == pytest.approx(2.08) and (dw, dh) == (0, 8)
    assert x[:, 0, 0].tolist() == pytest.approx([128 / 255] * 3) and x[0, 8, 0] == 1.0
    boxes = scale_boxes(torch.tensor([[0.0, 8.0, 416.0, 216.0], [-20.0, 50.0, 104.0, 500.0]]), (224, 416), (200, 100))
    assert boxes.tolist() == [[0, 0, 200, 100], [0, 20, 50, 100]]


def test_objects_encoder_crops_through_resnet():
    torch.manual_seed(0)
    tiny_resnet = ResNet((1, 1, 1, 1)).eval()
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 80, 3), dtype=np.uint8))
    enc = ObjectEncoder(YOLOv3(parse_cfg(TINY_CFG)), tiny_resnet)
    det = Detections(torch.tensor([[10.0, 5.0, 50.0, 45.0], [70.0, 50.0, 90.0, 70.0]]), torch.tensor([0.9, 0.5]),
                     torch.tensor([0, 1]))
    feats = enc.features(img, det)
    assert feats.shape == (2, 2048)
    # the reference's crop: integer box clipped to the image, 224 x 224 bicubic, ImageNet normalisation
    assert crop_box(img, det.boxes[1]).size == (224, 224)
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    crop = img.crop((10, 5, 50, 45)).resize((224, 224), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(((np.asarray(crop, np.float32) / 255 - mean) / std).transpose(2, 0, 1).copy())
    with torch.no_grad():
        want = tiny_resnet.forward_features(pixels[None]).mean(dim=(2, 3))[0]
    assert torch.allclose(feats[0], want, atol=1e-5)
    assert enc.features(img, det[:0]).shape == (0, 2048)


def test_objects_encoder_end_to_end_with_random_weights(tmp_path):
    """A detector whose heads are forced (zero weights, chosen biases) finds one box a cell; NMS,
    the 64-object cap and the crops follow."""
    layers = parse_cfg(TINY_CFG)
    det_net = _randomised(YOLOv3(layers))
    with torch.no_grad():
        for i, _ in det_net.heads:
            conv = det_net.blocks[i - 1]
            conv.conv.weight.zero_()
            conv.conv.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 6.0, 6.0, -6.0]))
    save_darknet_weights(det_net, tmp_path / "forced.weights")
    (tmp_path / "tiny.cfg").write_text(TINY_CFG)
    enc = ObjectEncoder.from_files(tmp_path / "forced.weights", ResNet((1, 1, 1, 1)), cfg=tmp_path / "tiny.cfg",
                                   img_size=64, max_objects=5)
    img = Image.new("RGB", (64, 64), (90, 120, 30))
    feats, det = enc.encode(img)
    assert feats.shape == (5, 2048) and len(det) == 5 and (det.classes == 0).all()
    assert (det.boxes[:, 2] - det.boxes[:, 0] > 0).all()
    with pytest.raises(TellkitError, match="encoders.object_weights"):
        ObjectEncoder.from_files(None, "random")


def _stride32_cfg() -> str:
    """Five stride-2 convolutions and one head with one large anchor (500 x 500): 1 anchor, 2 classes."""
    conv = "[convolutional]\nbatch_normalize=1\nfilters=4\nsize=3\nstride=2\npad=1\nactivation=leaky\n\n"
    head = ("[convolutional]\nsize=1\nstride=1\npad=1\nfilters=7\nactivation=linear\n\n"
            "[yolo]\nmask=0\nanchors=500,500\nclasses=2\nnum=1\n")
    return "[net]\n\n" + conv * 5 + head


def _one_object_detector(tmp_path):
    """A detector that sees one object covering any image: every cell predicts a box of
    exp(ln 8) * 500 = 4000 pixels with objectness and class 0 near 1; NMS keeps the first."""
    (tmp_path / "det.cfg").write_text(_stride32_cfg())
    net = _randomised(YOLOv3(parse_cfg(_stride32_cfg())))
    with torch.no_grad():
        head = net.convolutions()[-1].conv
        head.weight.zero_()
        head.bias.copy_(torch.tensor([0.0, 0.0, math.log(8.0), math.log(8.0), 6.0, 6.0, -6.0]))
    save_darknet_weights(net, tmp_path / "det.weights")
    return tmp_path / "det.weights", tmp_path / "det.cfg"


def test_features_builds_object_vectors_from_images(tmp_path, capsys):
    from tellkit.cli import main
    from tellkit.encoders.features import FeatureStore

    weights, cfg = _one_object_detector(tmp_path)
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in (("a", (80, 100)), ("b", (64, 64))):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(imgs / f"{name}.png")
    out = tmp_path / "feats"
    argv = ["features", str(out), "--images", str(imgs), "--no-faces", "--no-progress", "--objects"]
    assert main([*argv, "--object-weights", str(weights), "--object-cfg", str(cfg),
                 "--object-resnet-weights", "random"]) == 0
    store = FeatureStore(out)
    assert store["a"]["objects"].shape == (1, 2048) and store["b"]["objects"].shape == (1, 2048)
    assert store.config["object_weights"] == str(weights)
    capsys.readouterr()
    # without the detector's weights: one line naming the option and where the file comes from
    assert main([*argv[:2], "--images", str(imgs), "--objects"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--object-weights" in err and "yolov3.weights" in err


def test_the_bundle_detects_objects_when_given_the_weights(tmp_path):
    from tellkit.encoders.bundle import CaptionInput, EncoderBundle

    weights, cfg = _one_object_detector(tmp_path)
    img = Image.new("RGB", (90, 60), (10, 200, 30))
    conf = {"image": "mobilenet_v2", "objects": "yolov3_resnet152", "object_weights": str(weights),
            "object_cfg": str(cfg), "object_resnet_weights": "random"}
    bundle = EncoderBundle(conf, ("image", "objects"))
    item = bundle.encode([CaptionInput("x", image=img)], details=True)[0]
    assert item["objects"].shape == (1, 2048) and item["objects_source"] == "yolov3"
    assert item["object_boxes"].tolist() == [[0, 0, 90, 60]]  # the whole image, clipped
    given = bundle.encode([CaptionInput("y", image=img, objects=np.ones((2, 2048), np.float32))], details=True)[0]
    assert given["objects_source"] == "precomputed" and given["objects"].shape == (2, 2048)
    without = EncoderBundle({"image": "mobilenet_v2"}, ("image", "objects"))
    assert without.encode([CaptionInput("x", image=img)], details=True)[0]["objects_source"] == "none"
    no_resnet = EncoderBundle({**conf, "object_resnet_weights": None}, ("image", "objects"))
    with pytest.raises(TellkitError, match="object_resnet_weights"):
        no_resnet.encode([CaptionInput("x", image=img)])
