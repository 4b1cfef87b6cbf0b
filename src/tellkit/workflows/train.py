"""Train a recipe with its task: what ``tellkit train`` runs.

    summary = train_recipe(recipe, "runs/tiny")                      # the recipe's task, the one loop
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tellkit.config import check_recipe_sections
from tellkit.tasks import make_task
from tellkit.training.loop import train
from tellkit.training.task import Task


def train_recipe(recipe: Mapping[str, Any], run_dir: str | os.PathLike, task: Task | None = None,
                 **options: Any) -> dict[str, Any]:
    """Train ``recipe`` into ``run_dir`` with ``task`` (default: the one its ``task:`` names);
    ``options``: those of :func:`tellkit.training.loop.train` (resume, device, save_every_steps, ...)."""
    check_recipe_sections(recipe)
    return train(recipe, run_dir, make_task(recipe) if task is None else task, **options)
