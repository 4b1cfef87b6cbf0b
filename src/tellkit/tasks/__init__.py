"""Tasks bind a model family to its data, batching and evaluation, so that one generic
training loop (``tellkit.training``) and one ``tellkit evaluate`` serve every model.

A recipe's top-level ``task:`` key names the task by its key, the command's name (``caption``,
``recognize``, ``summarize``: :data:`tellkit.recipes.TASK_KEYS`), the same key the pipelines,
the server and checkpoints use; a former name (``captioning``, ``recognition``,
``summarization``) is still read, with a deprecation message. Tasks register themselves with
:func:`register_task` in ``tellkit/tasks/<name>.py`` and are discovered automatically.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from tellkit.errors import TellkitError
from tellkit.recipes import task_key
from tellkit.training.task import Task

_TASKS: dict[str, type[Task]] = {}


def register_task(name: str):
    def deco(cls: type[Task]) -> type[Task]:
        _TASKS[name] = cls
        cls.name = name
        return cls

    return deco


def _discover() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"tellkit.tasks.{info.name}")


def get_task(name: str, where: str = "task") -> type[Task]:
    """The task class registered as ``name`` (a former name: see :func:`tellkit.recipes.task_key`)."""
    name = task_key(name, where)
    if name not in _TASKS:
        _discover()
    if name not in _TASKS:
        raise TellkitError(f"unknown task '{name}'; known: {', '.join(sorted(_TASKS)) or '(none)'}")
    return _TASKS[name]


def make_task(recipe: Mapping[str, Any], **kwargs: Any) -> Task:
    """The task a recipe names in its ``task:`` key, built from the recipe (``kwargs``: the
    task's own options, e.g. a captioning task's shared encoder ``bundle``)."""
    name = recipe.get("task")
    if not isinstance(name, str):
        raise TellkitError("the recipe has no 'task:' (which task trains this model)")
    cls = get_task(name, "the recipe's task:")
    return cls(recipe if name == cls.name else {**recipe, "task": cls.name}, **kwargs)
