"""CROHME loaders (shared TSV layout and WAP/BTTR caption layout), images, batching."""
import pytest
import torch
from PIL import Image, ImageDraw

from tellkit.data.crohme import (
    CrohmeDataset,
    collate,
    load_caption_dir,
    load_image,
    load_split,
    read_tsv_labels,
    size_batches,
)
from tellkit.errors import TellkitError


def _draw(path, w=120, h=40, text_len=3):
    im = Image.new("L", (w, h), 255)
    d = ImageDraw.Draw(im)
    for i in range(text_len):
        d.line([(10 + 30 * i, 10), (30 + 30 * i, 30)], fill=0, width=2)
    im.save(path)


def test_tsv_layout_with_quoted_multiline_label(tmp_path):
    (tmp_path / "train" / "A").mkdir(parents=True)
    _draw(tmp_path / "train" / "A" / "e1.png")
    _draw(tmp_path / "train" / "A" / "e2.png", w=60)
    (tmp_path / "groundtruth_train.tsv").write_text('A/e1\tx^2\nA/e2\t"\\frac 1 2\n"\n', encoding="utf-8")
    rows = read_tsv_labels(tmp_path / "groundtruth_train.tsv")
    assert rows == [("A/e1", "x^2"), ("A/e2", "\\frac 1 2")]
    ex = load_split(tmp_path, "train")
    assert [e.tokens for e in ex] == [["x", "^", "{", "2", "}"], ["\\frac", "{", "1", "}", "{", "2", "}"]]
    ds = CrohmeDataset(ex)
    b = collate([ds[0], ds[1]])
    assert b["image"].shape[0] == 2 and b["image"].shape[-1] % 16 == 0 and b["image"].shape[-2] % 16 == 0
    assert b["image_mask"][1].sum() < b["image_mask"][0].sum()  # the narrower image is padded
    assert b["image"][1][0][~b["image_mask"][1]].abs().sum() == 0  # padding is background
    assert b["labels"].tolist()[0][:5] == ds.vocab.encode(["x", "^", "{", "2", "}"])
    assert b["label_lengths"].tolist() == [5, 7]


def test_caption_layout(tmp_path):
    (tmp_path / "img").mkdir()
    _draw(tmp_path / "img" / "a.bmp")
    (tmp_path / "caption.txt").write_text("a\tx ^ { 2 }\n", encoding="utf-8")
    ex = load_caption_dir(tmp_path)
    assert ex[0].tokens == ["x", "^", "{", "2", "}"] and ex[0].image.name == "a.bmp"
    (tmp_path / "caption.txt").write_text("missing\tx\n", encoding="utf-8")
    with pytest.raises(TellkitError):
        load_caption_dir(tmp_path)


def test_image_loading_crop_and_errors(tmp_path):
    _draw(tmp_path / "a.png", w=256, h=256)
    t = load_image(tmp_path / "a.png")
    assert t.shape[0] == 1 and t.shape[1] < 256 and 0.0 <= t.min() and t.max() <= 1.0
    assert load_image(tmp_path / "a.png", crop=False).shape == (1, 256, 256)
    assert load_image(tmp_path / "a.png", crop=False, scale=0.5).shape == (1, 128, 128)
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(TellkitError):
        load_image(tmp_path / "bad.png")
    with pytest.raises(TellkitError):
        load_image(tmp_path / "nope.png")


def test_size_batches_caps_pixels():
    sizes = [(16, 16 * (i + 1)) for i in range(10)]
    batches = size_batches(sizes, batch_size=4, max_batch_pixels=16 * 16 * 8)
    assert sorted(i for b in batches for i in b) == list(range(10))
    for b in batches:
        assert len(b) <= 4
        assert len(b) == 1 or len(b) * max(sizes[i][0] for i in b) * max(sizes[i][1] for i in b) <= 16 * 16 * 8
    assert size_batches(sizes, 4, 0, shuffle=True, seed=1) != size_batches(sizes, 4, 0)


@pytest.mark.data
def test_shared_crohme_splits(shared_data):
    d = shared_data / "crohme"
    test = load_split(d, "2014")
    assert len(test) == 986 and all(e.image.is_file() for e in test[:20])
    val = load_split(d, "gt_split/validation")  # 1,773 lines, 1,767 rows (quoted labels span lines)
    assert len(val) == 1767 and val[0].image.is_file()
    img = load_image(test[0].image)
    assert img.dim() == 3 and img.max() > 0.5


def test_image_augment_keeps_size_and_moves_ink():
    from unittest import mock

    from tellkit.data.crohme import CrohmeDataset, Expression, ImageAugment
    from tellkit.data.recognition import RecognitionDataConfig, augmenter, check
    from tellkit.errors import TellkitError
    from tellkit.recipes import section

    def data_section(d):  # the recognition task reads its data section so
        return check(section({"data": d}, "data", RecognitionDataConfig))

    img = torch.zeros(1, 64, 200)
    img[0, 28:36, 20:180] = 1
    # a pure scale about the centre: a 160 x 8 bar becomes 80 x 4, centred
    half = ImageAugment(scale=[0.5, 0.5])(img)
    cols = (half[0] > 0.5).any(0).nonzero().flatten()
    rows = (half[0] > 0.5).any(1).nonzero().flatten()
    assert half.shape == img.shape and (cols.min(), cols.max(), rows.min(), rows.max()) == (60, 139, 30, 33)
    # rotation by the full angle turns a ray from the centre by 45 degrees
    ray = torch.zeros(1, 101, 101)
    ray[0, 50, 50:100] = 1
    with mock.patch("torch.rand", lambda n: torch.tensor([1.0, 0.5, 0.0])):
        turned = ImageAugment(rotate=45)(ray)
    ys, xs = (turned[0] > 0.3).nonzero().T
    assert abs(int(xs.max()) - 85) <= 1 and abs(int(ys.max()) - 85) <= 1 and int(ys.min()) >= 49
    assert ImageAugment()(img) is img and not ImageAugment().active
    # random draws differ, the size never changes
    aug = ImageAugment(rotate=3, shear=0.2, scale=[0.85, 1.0])
    a, b = aug(img), aug(img)
    assert a.shape == b.shape == img.shape and not torch.equal(a, b) and not torch.equal(a, img)
    # wired through the recipe: training items only, the recorded sizes are the undistorted ones
    d = data_section({"augment": {"rotate": 2, "shear": 0.1, "scale": [0.9, 1.0]}})
    assert augmenter(d) == ImageAugment(rotate=2, shear=0.1, scale=(0.9, 1.0))
    assert augmenter(data_section({})) is None
    ds = CrohmeDataset([Expression("e", None, ["x"])], render=lambda e: img, augment=augmenter(d))
    assert ds.sizes() == [(64, 200)] and ds[0]["image"].shape == img.shape and not torch.equal(ds[0]["image"], img)
    with pytest.raises(TellkitError, match="unknown key"):
        data_section({"augment": {"rot": 2}})
    with pytest.raises(TellkitError, match="augment.scale"):
        data_section({"augment": {"scale": [1.2, 0.9]}})
    with pytest.raises(TellkitError, match="rotate must be"):
        data_section({"augment": {"rotate": 90}})
