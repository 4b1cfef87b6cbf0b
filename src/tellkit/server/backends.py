"""The models the server runs, and how each endpoint calls its model. A served model is an
inference pipeline (:class:`tellkit.pipelines.base.Pipeline`), the one ``tellkit caption`` and
``tellkit recognize`` run, given as ``{task: pipeline}``; the server only does HTTP and never
branches on a task's name. What the server reads of a model:

- ``task``: the task key (``caption``, ``recognize``) whose endpoint it serves (``/api/<task>``);
  an endpoint refuses a model of another task;
- ``model(items) -> [result, ...]``: one result per request (``{"text": ..., extras}``); the
  caption endpoint's items are ``(PIL image, article text)`` pairs, the recognize endpoint's PIL
  images or :class:`~tellkit.pipelines.recognition.Strokes`;
- ``api_text``: the API's name for a result's text (``caption``, ``latex``);
- ``cost(item, prepared)``, ``prepares_early``, ``small_lane``: what an input costs and how the
  server schedules it (:mod:`tellkit.pipelines.base`); a model without ``cost`` costs a fixed share;
- ``info``: which model it serves, from which checkpoint, and whether it was trained
  (``trained: false`` for the tiny random models of ``--untrained``);
- ``generation``: its search settings (runaway stop included), bounded by the server's limits
  (:func:`bound_generation`).

Checkpoints are only ever opened from paths given at start-up (``tellkit serve --model``), never
from a request.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError
from tellkit.pipelines import pipeline_class
from tellkit.pipelines.captioning import CAPTION_FAMILIES, CaptioningPipeline, article_input
from tellkit.pipelines.recognition import RecognitionPipeline
from tellkit.recipes import PACKAGED_DEFAULTS, task_key

__all__ = ["CAPTION_FAMILIES", "SERVED_TASKS", "CaptioningPipeline", "RecognitionPipeline", "article_input",
           "batch_function", "bound_generation", "checkpoint_name", "load_served", "public_info", "served_models"]

# the tasks the server has an endpoint for (``/api/<task>``, ``--models``, /health)
SERVED_TASKS = ("caption", "recognize")


def served_models(models: Mapping[str, Any] | None, where: str = "create_app") -> dict[str, Any]:
    """``{task: model or None}`` for every served task, from ``models`` keyed by task (a former
    name such as ``math`` is read with a deprecation message); a model of another task, or a
    task the server has no endpoint for, is a one-line error."""
    out: dict[str, Any] = dict.fromkeys(SERVED_TASKS)
    for name, model in (models or {}).items():
        key = task_key(name, f"{where} model")
        if key not in SERVED_TASKS:
            raise TellkitError(f"{where}: no endpoint for task '{name}'; the server serves {', '.join(SERVED_TASKS)}")
        if model is not None and getattr(model, "task", key) != key:
            raise TellkitError(f"the {key} endpoint serves a '{key}' model, not a '{model.task}' one")
        out[key] = model
    return out


def load_served(chosen: Mapping[str, str | None], device: str | None = None,
                dtype: str | None = None, options: Mapping[str, Mapping[str, Any]] | None = None,
                runtime: str | None = None) -> dict[str, Any]:
    """``{task: checkpoint folder, or None for the task's tiny random model}`` -> ``{task: pipeline}``;
    ``runtime``: 'torch' (None) or 'onnx', chosen by each pipeline's ``load`` as for the commands;
    ``options``: per task, more keyword arguments of its pipeline's ``load`` (the captioner's
    ``encoders``: local copies of the weights its checkpoint names)."""
    out = {}
    for task, path in chosen.items():
        cls = pipeline_class(task)
        extra = dict((options or {}).get(task) or {})
        out[task] = (cls.untrained(device=device) if path is None
                     else cls.load(path, device=device, dtype=dtype, runtime=runtime, **extra))
    return out


def batch_function(task: str, model) -> Callable[[list[Any]], list[dict[str, Any]]]:
    """What the endpoint's batching worker calls with a list of requests' items: the model,
    its results with the text under the API's name (``model.api_text``)."""
    if model.task != task:
        raise TellkitError(f"the {task} endpoint serves a '{task}' model, not a '{model.task}' one")
    key = getattr(model, "api_text", "text")

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
