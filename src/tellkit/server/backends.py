"""The models the server runs, and how each endpoint calls its model. A served model is an
inference pipeline (:class:`tellkit.pipelines.base.Pipeline`), the one ``tellkit caption`` and
``tellkit recognize`` run; the server only does HTTP. What the server reads of a model:

- ``task``: which endpoint it serves (``caption`` for ``/api/caption``, ``recognize`` for
  ``/api/recognize``); an endpoint refuses a model of another task;
- ``model(items) -> [result, ...]``: one result per request (``{"text": ..., extras}``); the
  caption endpoint's items are ``(PIL image, article text)`` pairs, the math endpoint's PIL
  images or :class:`~tellkit.pipelines.recognition.Strokes`;
- ``info``: which model it serves, from which checkpoint, and whether it was trained
  (``trained: false`` for the tiny random models of ``--untrained``);
- ``generation``: its search settings, bounded by the server's limits (:func:`bound_generation`).

The API names a result's text by what it is: ``caption`` and ``latex``. Checkpoints are only
ever opened from paths given at start-up (``tellkit serve --model``), never from a request.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError
from tellkit.pipelines.captioning import CAPTION_FAMILIES, CaptioningPipeline, article_input
from tellkit.pipelines.recognition import RecognitionPipeline
from tellkit.recipes import PACKAGED_DEFAULTS

__all__ = ["CAPTION_FAMILIES", "ENDPOINT_TASKS", "CaptioningPipeline", "RecognitionPipeline", "article_input",
           "batch_function", "bound_generation", "checkpoint_name", "public_info"]

# endpoint (``--models``, /health) -> the task of the model it serves
ENDPOINT_TASKS = {"caption": "caption", "math": "recognize"}
# task -> the API's name for a result's text
API_TEXT = {"caption": "caption", "recognize": "latex"}


def batch_function(endpoint: str, model) -> Callable[[list[Any]], list[dict[str, Any]]]:
    """What the endpoint's batching worker calls with a list of requests' items: the model,
    its results under the API's names."""
    task = ENDPOINT_TASKS[endpoint]
    if model.task != task:
        raise TellkitError(f"the {endpoint} endpoint serves a '{task}' model, not a '{model.task}' one")
    key = API_TEXT[task]

    def run(items: list[Any]) -> list[dict[str, Any]]:
        return [{key: r["text"], **{k: v for k, v in r.items() if k != "text"}} for r in model(items)]

    return run


def bound_generation(model, limits) -> int:
    """Serve ``model`` with at most ``limits.max_beam_size`` beams and ``limits.max_gen_len``
    tokens, whatever its checkpoint says (its stored settings already passed the recipe caps,
    :data:`tellkit.recipes.MAX_BEAM_SIZE`); a lowered setting is noted in ``model.info``
    (``served_with``). -> the beam width served (the worker's batch is sized by it)."""
    gen = getattr(model, "generation", None)
    if gen is None:  # a model without search settings (a stand-in in tests)
        return 1
    default_len = getattr(getattr(model.model, "config", None), "max_len", None)
    beam, length = int(gen.beam_size), int(gen.max_len or default_len or limits.max_gen_len)
    served = min(beam, limits.max_beam_size), min(length, limits.max_gen_len)
    model.generation = gen.updated(beam_size=served[0], max_len=served[1])
    model.info = {**model.info, "served_with": {"beam_size": served[0], "max_len": served[1]}}
    if served != (beam, length):
        model.info["served_with"]["lowered_from"] = {"beam_size": beam, "max_len": length}
    return served[0]


def public_info(model) -> dict | None:
    """What /health and every answer say about a model: its ``info`` with the checkpoint given
    by name (the folder's last two parts, or the packaged default's name), never a host path."""
    if model is None:
        return None
    info = dict(model.info)
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
