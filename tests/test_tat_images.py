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


def exif_rotated_jpeg(path, w=40, h=20):
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to show upright"
    gradient(w, h).save(path, "JPEG", exif=exif.tobytes())


def test_dataset_images_as_the_reference_read_them(tmp_path):
    """The reference opened a data set's image with PIL as stored (no EXIF rotation) and its
    preparation resized with PIL's ANTIALIAS (Lanczos); a user's own photo is turned upright."""
    from tellkit.encoders.bundle import CaptionInput, EncoderBundle
    from tellkit.encoders.preprocess import load_image

    exif_rotated_jpeg(tmp_path / "a.jpg")
    assert load_image(tmp_path / "a.jpg").size == (20, 40)  # upright
    assert load_image(tmp_path / "a.jpg", exif=False).size == (40, 20)  # as stored
    ref = EncoderBundle({"dataset_images": "reference"}, ("image",))
    ours = EncoderBundle({}, ("image",))
    data = CaptionInput("a", str(tmp_path / "a.jpg"), from_dataset=True)
    photo = CaptionInput("a", str(tmp_path / "a.jpg"))
    assert ref._image(data).size == (40, 20) and ref._resample(data) == "lanczos"
    assert ref._image(photo).size == (20, 40) and ref._resample(photo) is None
    assert ours._image(data).size == (20, 40) and ours._resample(data) is None


def test_dataset_images_lanczos_through_the_image_encoder():
    from tellkit.encoders.image import build_image_encoder

    enc = build_image_encoder("mobilenet_v2", "random")
    raw = gradient(400, 300)
    assert enc.transform_for("lanczos").resample == "lanczos" and enc.preprocess.resample == "bilinear"
    torch.testing.assert_close(enc.transform_for("lanczos")(raw),
                               to_tensor(raw.resize((341, 256), Image.LANCZOS).crop((58, 16, 282, 240))))


def test_goodnews_reads_images_processed_before_images(tmp_path):
    """The reference's GoodNews reader opens ``images_processed/<id>.jpg`` (its own 224 x 224 crops)."""
    import shutil
    from pathlib import Path

    from tellkit.data.goodnews import load_goodnews

    fix = Path(__file__).parent / "fixtures" / "goodnews"
    for name in ("captioning_dataset.json", "img_splits.json"):
        shutil.copy(fix / name, tmp_path / name)
    shutil.copytree(fix / "images", tmp_path / "images")
    shutil.copytree(fix / "images", tmp_path / "images_processed")
    samples = load_goodnews(tmp_path)
    assert samples and all(Path(s.image_path).parent.name == "images_processed" for s in samples if s.image_path)
