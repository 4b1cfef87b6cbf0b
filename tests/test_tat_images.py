"""Images as the reference prepared them: resize 256 + centre crop 224 exactly once;
NYTimes800k's images_processed (already 224 x 224) are only normalised."""
import numpy as np
import pytest
import torch
from PIL import Image

from tellkit.encoders.preprocess import ImageNetTransform, to_tensor


def gradient(w, h):
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    a = np.concatenate([np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)),
                        np.full((h, w, 1), 77, np.float32)], axis=2)
    return Image.fromarray(a.round().astype(np.uint8), "RGB")


def test_processed_images_are_not_cropped_again():
    img = gradient(224, 224)  # as in NYTimes800k's images_processed
    t = ImageNetTransform()
    x = t(img)
    torch.testing.assert_close(x, to_tensor(img))  # every pixel, corners included
    # what a second resize + crop would have done: only the central ~196 px, magnified
    twice = ImageNetTransform(prepared="never")(img)
    assert (twice - x).abs().max() > 0.25  # the magnified crop moves every edge pixel


def test_raw_images_are_resized_and_cropped_once():
    raw = gradient(400, 300)
    t = ImageNetTransform()
    x = t(raw)
    assert x.shape == (3, 224, 224)
    # by hand: short side 300 -> 256 gives 341 x 256, centre crop 224 at (58, 16)
    ref = raw.resize((341, 256), Image.BILINEAR).crop((58, 16, 282, 240))
    torch.testing.assert_close(x, to_tensor(ref))
    # the prepared result passes through the transform unchanged: prepared once, never twice
    torch.testing.assert_close(t(ref), x)
    lz = ImageNetTransform(resample="lanczos")(raw)
    torch.testing.assert_close(lz, to_tensor(raw.resize((341, 256), Image.LANCZOS).crop((58, 16, 282, 240))))
    with pytest.raises(ValueError):
        ImageNetTransform(prepared="sometimes")
