"""The two models the server runs. Both are inference pipelines (:mod:`tellkit.pipelines`), the
same code ``tellkit caption`` and ``tellkit recognize`` use; the server only does HTTP.

- A captioner (:class:`tellkit.pipelines.captioning.CaptioningPipeline`):
  ``caption([(PIL image, article text), ...]) -> [result, ...]``.
- A recognizer (:class:`tellkit.pipelines.recognition.BTTRMathRecognizer`):
  ``recognize([PIL image, ...]) -> [{"latex", "tokens", "score"}, ...]``.

Each carries ``info``: which model it serves, from which checkpoint, and whether it was trained
(``trained: false`` for the tiny random models used by ``--untrained``). Checkpoints are only
ever opened from paths given at start-up (``tellkit serve --checkpoint``), never from a request.
"""
from __future__ import annotations

from tellkit.pipelines.captioning import CAPTION_FAMILIES, CaptioningPipeline, ImageCaptioner, article_sample
from tellkit.pipelines.recognition import BTTRMathRecognizer

__all__ = ["CAPTION_FAMILIES", "BTTRMathRecognizer", "CaptioningPipeline", "ImageCaptioner", "article_sample"]
