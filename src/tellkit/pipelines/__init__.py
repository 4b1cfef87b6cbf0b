"""Inference pipelines: a trained checkpoint (or a packaged default) in, answers out. The
commands (``tellkit caption``, ``recognize``, ``summarize``, ``demo``), the HTTP server and
``tellkit.pipeline`` all run these; none holds model code of its own, and each runs its task's
processor, the one evaluation uses.

- :mod:`tellkit.pipelines.base`: :class:`~tellkit.pipelines.base.Pipeline` (load,
  preprocess / forward / postprocess, generation settings, dtype, ``info``).
- :mod:`tellkit.pipelines.captioning`: photo (+ article) -> caption with per-token attention.
- :mod:`tellkit.pipelines.recognition`: handwritten math (image, InkML, strokes) -> LaTeX.
- :mod:`tellkit.pipelines.summarization`: transcript (+ video features) -> summary.

:func:`pipeline` picks one by the task's key (the command's name, the key the task registry,
recipes, checkpoints and the server use: :data:`tellkit.recipes.TASK_KEYS`; a former name is
read with a deprecation message). Modules are imported on demand: ``import tellkit.pipelines``
loads no model code.
"""
from __future__ import annotations

import difflib
import importlib
from typing import Any

from tellkit.errors import TellkitError
from tellkit.recipes import task_key

# task (the command's name) -> the module and class of its pipeline
TASKS = {"caption": ("captioning", "CaptioningPipeline"), "recognize": ("recognition", "RecognitionPipeline"),
         "summarize": ("summarization", "SummarizationPipeline")}


def pipeline_class(task: str):
    """The pipeline class of ``task`` ("caption", "recognize" or "summarize")."""
    task = task_key(task, "tellkit.pipeline task")
    if task not in TASKS:
        near = difflib.get_close_matches(str(task), TASKS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise TellkitError(f"unknown task '{task}'{hint}; tasks: {', '.join(TASKS)}")
    module, name = TASKS[task]
    return getattr(importlib.import_module(f"tellkit.pipelines.{module}"), name)


def pipeline(task: str, model: Any = None, device: Any = None, dtype: str | None = None, **options: Any):
    """The ready-to-call pipeline of ``task`` with ``model`` (a checkpoint or run folder; None:
    the packaged default); see :meth:`tellkit.pipelines.base.Pipeline.load`."""
    return pipeline_class(task).load(model, device=device, dtype=dtype, **options)
