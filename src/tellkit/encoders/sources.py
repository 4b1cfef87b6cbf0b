"""Where the paper encoders' pre-trained weights come from, and how a local copy is given.

None of them ships with tellkit (no package carries them): a user downloads each once and names
the file (or folder) in the ``encoders:`` section of a recipe or checkpoint, with an override
(``encoders.face_weights=FILE`` after ``tellkit train`` / ``evaluate``) or, for ``tellkit
caption`` and ``serve``, with ``--encoder face_weights=FILE``. A missing one is a one-line error
that names the network, its source and the key (:func:`how_to_pass`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightSource:
    what: str  # the network, as the paper names it
    source: str  # where its weights come from
    key: str  # the encoders-section key that takes a local copy
    value: str  # what that key takes (FILE, DIR)


SOURCES = {
    "roberta-large": WeightSource(
        "RoBERTa-large", "the Hugging Face hub model roberta-large "
        "(huggingface-cli download roberta-large --local-dir DIR)", "article", "DIR"),
    "roberta-base": WeightSource(
        "RoBERTa-base", "the Hugging Face hub model roberta-base "
        "(huggingface-cli download roberta-base --local-dir DIR)", "article", "DIR"),
    "resnet152": WeightSource(
        "ResNet-152 (ImageNet)", "torchvision's resnet152-394f9c45.pth "
        "(https://download.pytorch.org/models/resnet152-394f9c45.pth)", "image_weights", "FILE"),
    "facenet_vggface2": WeightSource(
        "FaceNet (VGGFace2)", "facenet-pytorch's 20180402-114759-vggface2.pt "
        "(https://github.com/timesler/facenet-pytorch/releases/download/v2.2.9/20180402-114759-vggface2.pt)",
        "face_weights", "FILE"),
    "yolov3": WeightSource(
        "YOLOv3", "the darknet file yolov3.weights (https://pjreddie.com/media/files/yolov3.weights)",
        "object_weights", "FILE"),
}
SOURCES["yolov3_resnet152"] = SOURCES["yolov3"]  # the recipes' name: YOLOv3 boxes, ResNet-152 vectors


def how_to_pass(name: str | None, key: str, value: str = "FILE") -> str:
    """``name``'s source (when known) and the override that gives a local copy, as one clause."""
    src = SOURCES.get(str(name))
    if src is None:
        return f"pass a local copy with encoders.{key}={value} (tellkit caption / serve: --encoder {key}={value})"
    return (f"get {src.source} and pass it with encoders.{src.key}={src.value} (tellkit caption / serve: "
            f"--encoder {src.key}={src.value})")


def what(name: str | None, default: str) -> str:
    """The network ``name`` names, as the paper calls it (``default`` when not a paper encoder)."""
    src = SOURCES.get(str(name))
    return src.what if src is not None else default
