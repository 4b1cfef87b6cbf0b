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

from pathlib import Path

from tellkit.pipelines.captioning import CAPTION_FAMILIES, CaptioningPipeline, ImageCaptioner, article_sample
from tellkit.pipelines.recognition import BTTRMathRecognizer
from tellkit.recipes import PACKAGED_DEFAULTS

__all__ = ["CAPTION_FAMILIES", "BTTRMathRecognizer", "CaptioningPipeline", "ImageCaptioner", "article_sample",
           "bound_generation", "checkpoint_name", "public_info"]


def bound_generation(backend, limits) -> int:
    """Serve ``backend`` with at most ``limits.max_beam_size`` beams and ``limits.max_gen_len``
    tokens, whatever its checkpoint says (its stored settings already passed the recipe caps,
    :data:`tellkit.recipes.MAX_BEAM_SIZE`); a lowered setting is noted in ``backend.info``
    (``served_with``). -> the beam width served (the worker's batch is sized by it)."""
    if hasattr(backend, "generation"):  # a captioning pipeline
        gen = backend.generation
        default_len = getattr(getattr(backend.model, "config", None), "max_len", None)
        beam, length = int(gen.beam_size), int(gen.max_len or default_len or limits.max_gen_len)
    elif hasattr(backend, "rec"):  # the math recognizer
        beam = int(backend.beam_size or backend.rec.beam_size)
        length = int(backend.max_len or backend.rec.max_len)
    else:  # a backend without search settings (a stand-in in tests)
        return 1
    served = min(beam, limits.max_beam_size), min(length, limits.max_gen_len)
    if hasattr(backend, "generation"):
        backend.generation = backend.generation.updated(beam_size=served[0], max_len=served[1])
    else:
        backend.beam_size, backend.max_len = served
    backend.info = {**backend.info, "served_with": {"beam_size": served[0], "max_len": served[1]}}
    if served != (beam, length):
        backend.info["served_with"]["lowered_from"] = {"beam_size": beam, "max_len": length}
    return served[0]


def public_info(backend) -> dict | None:
    """What /health and every answer say about a model: its ``info`` with the checkpoint given
    by name (the folder's last two parts, or the packaged default's name), never a host path."""
    if backend is None:
        return None
    info = dict(backend.info)
    if info.get("checkpoint"):
        info["checkpoint"] = checkpoint_name(info["checkpoint"])
    return info


def checkpoint_name(path) -> str:
    """A checkpoint folder by name: ``packaged:NAME`` for a packaged default, else its parent's
    and its own folder names (``run/best``)."""
    p = Path(path)
    for default in PACKAGED_DEFAULTS.values():
        if p.resolve() == default.resolve():
            return f"packaged:{default.name}"
    return "/".join(p.resolve().parts[-2:])
