"""Faces as a context set: detect with MTCNN, keep the largest ``max_faces`` (4, as Transform
and Tell), crop each box to 160 x 160, embed with FaceNet (512-d unit vectors).

    enc = FaceEncoder()                                  # offline: packaged MTCNN + CASIA FaceNet
    enc = FaceEncoder(facenet_weights="20180402-114759-vggface2.pt")  # the paper's VGGFace2 net
    out = enc.detect_and_embed(pil_image)
    out["boxes"] float[F, 4], out["probs"] float[F], out["landmarks"] float[F, 5, 2],
    out["embeddings"] float[F, 512]; F <= 4, largest face first; F = 0 for no face.

The crop follows the reference pipeline (facenet-pytorch's ``MTCNN(keep_all=True)`` then
``InceptionResnetV1``): the detected box grown by ``margin`` pixels (in 160-px units, 0 by
default), clamped to the image, resized bilinearly to 160 x 160; no rotation; each crop prewhitened as
the reference's MTCNN does by default (``standardization="fixed"`` for (x - 127.5) / 128).
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

from tellkit.encoders.faces.facenet import load_facenet, standardize
from tellkit.encoders.faces.mtcnn import MTCNN
from tellkit.encoders.preprocess import to_rgb
from tellkit.recipes import MAX_FACES

FACE_SIZE = 160


def crop_face(image: Image.Image, box, size: int = FACE_SIZE, margin: float = 0.0) -> np.ndarray:
    """uint8[size, size, 3]: the box plus a margin (given in output pixels), clamped to the image."""
    x1, y1, x2, y2 = (float(v) for v in box)
    mx = margin * (x2 - x1) / (size - margin)
    my = margin * (y2 - y1) / (size - margin)
    w, h = image.size
    box = (int(max(x1 - mx / 2, 0)), int(max(y1 - my / 2, 0)), int(min(x2 + mx / 2, w)), int(min(y2 + my / 2, h)))
    if box[2] <= box[0] or box[3] <= box[1]:
        return np.zeros((size, size, 3), np.uint8)
    return np.asarray(image.crop(box).resize((size, size), Image.BILINEAR))


class FaceEncoder(nn.Module):
    """MTCNN + FaceNet; see the module docstring. ``facenet_weights``: None = packaged
    CASIA-WebFace network, or a path to a facenet-pytorch-layout state dict (VGGFace2)."""

    dim = 512

    def __init__(self, facenet_weights=None, max_faces: int = MAX_FACES, min_face_size: int = 20,
                 thresholds=(0.6, 0.7, 0.7), margin: float = 0.0, standardization: str = "prewhiten"):
        super().__init__()
        self.detector = MTCNN(min_face_size=min_face_size, thresholds=thresholds)
        self.facenet = load_facenet(facenet_weights)
        self.max_faces, self.margin, self.standardization = max_faces, margin, standardization

    def train(self, mode: bool = True) -> FaceEncoder:
        return super().train(False)

    @torch.no_grad()
    def embed_crops(self, crops: np.ndarray) -> torch.Tensor:
        """uint8[F, 160, 160, 3] face crops -> float[F, 512] unit vectors."""
        if len(crops) == 0:
            return torch.zeros(0, self.dim)
        device = self.facenet.last_linear.weight.device
        x = torch.from_numpy(np.ascontiguousarray(crops)).permute(0, 3, 1, 2).float().to(device)
        return self.facenet(standardize(x, self.standardization)).cpu()

    @torch.no_grad()
    def detect_and_embed(self, image: Image.Image, max_side: int | None = None) -> dict:
        """``max_side``: detect on a copy shrunk so its longer side is at most this (MTCNN's
        memory and time grow with the pixels); boxes and landmarks are mapped back, and the
        crops are still cut from ``image``. None, or an image no larger: detect on ``image``."""
        image = to_rgb(image)
        small, sx, sy = image, 1.0, 1.0
        if max_side and max(image.size) > max_side:
            f = max_side / max(image.size)
            small = image.resize((max(1, round(image.width * f)), max(1, round(image.height * f))), Image.BILINEAR)
            sx, sy = image.width / small.width, image.height / small.height
        det = self.detector.detect(small)
        del small
        scale = np.array([sx, sy, sx, sy], np.float32)
        boxes_all, marks_all = det.boxes * scale, det.landmarks * scale[:2]
        areas = (boxes_all[:, 2] - boxes_all[:, 0]) * (boxes_all[:, 3] - boxes_all[:, 1])
        order = np.argsort(-areas, kind="stable")[: self.max_faces]
        boxes = boxes_all[order]
        crops = np.stack([crop_face(image, b, margin=self.margin) for b in boxes]) if len(boxes) else np.zeros((0,))
        return {
            "boxes": torch.from_numpy(boxes.reshape(-1, 4)),
            "probs": torch.from_numpy(det.probs[order]),
            "landmarks": torch.from_numpy(marks_all[order].reshape(-1, 5, 2)),
            "embeddings": self.embed_crops(crops),
        }
