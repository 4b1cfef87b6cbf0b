"""What the commands do, as library calls: train a recipe with its task (:mod:`.train`),
evaluate a checkpoint on a data split (:mod:`.evaluate`), make one row of a results table
(:mod:`.table`) and a time-boxed training run (:mod:`.sprint`). ``tellkit train``,
``tellkit evaluate``, ``tellkit table``, ``tellkit sprint`` and the benchmarks call these; the
commands only parse arguments and print.

    summary = train_recipe(recipe, "runs/tiny")                      # the recipe's task, the one loop
    result = evaluate_checkpoint("runs/tiny", "test", data="/data/flickr8k")
    result.metrics, result.summary_file, result.predictions_file
    row = table_row("configs/baselines/flickr8k_papers/show_tell.yaml", TableOptions(out="runs/t"))
"""
from __future__ import annotations

from tellkit.workflows.evaluate import (
    EvalResult,
    checkpoint_recipe,
    default_eval_dir,
    evaluate_checkpoint,
)
from tellkit.workflows.table import TableOptions, cacheable, feature_key, published_numbers, table_row
from tellkit.workflows.train import train_recipe

__all__ = ["EvalResult", "TableOptions", "cacheable", "checkpoint_recipe", "default_eval_dir",
           "evaluate_checkpoint", "feature_key", "published_numbers",
           "table_row", "train_recipe"]
