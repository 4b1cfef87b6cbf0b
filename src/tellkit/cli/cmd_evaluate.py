"""`tellkit evaluate CHECKPOINT --data PATH --split test [--out DIR]`.

The checkpoint's ``config.json`` names its ``task`` and carries the other sections of the training
recipe (data, eval, train, encoders ...; written by ``tellkit train``); ``--data`` replaces ``data.root``, ``key=value``
overrides change anything else (e.g. ``eval.beam_size=4``). Writes ``metrics_<split>.json`` and
``predictions_<split>.jsonl``. Works under ``torchrun`` too (predictions gathered, scored once).
"""
from __future__ import annotations

from tellkit.cli import positive_int

NAME = "evaluate"
HELP = "generate for a data split with a checkpoint and score it (JSON summary + per-example JSONL)"


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder, or a run folder (its best checkpoint is used)")
    p.add_argument("overrides", nargs="*",
                   help="section.key=value overrides of the stored recipe (right after CHECKPOINT)")
    p.add_argument("--data", help="data location (sets data.root of the stored recipe)")
    p.add_argument("--split", default="test", help="train, val or test (default: test)")
    p.add_argument("--out", help="output folder (default: <run>/eval, or <checkpoint>/eval)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="default: eval.batch_size or train.batch_size")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    import json
    from pathlib import Path

    from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
    from tellkit.config import deep_merge, parse_overrides
    from tellkit.errors import TellkitError
    from tellkit.tasks import get_task
    from tellkit.training import distributed
    from tellkit.training.evaluation import run_eval, write_eval_outputs

    ckpt = resolve_checkpoint(args.checkpoint)
    meta = read_checkpoint_config(ckpt)
    if not meta.get("task"):
        raise TellkitError(f"{ckpt}: the checkpoint does not name its task (it was not written by `tellkit train`)")
    skip = {"format_version", "family", "config", "tellkit_version"}
    recipe = {**{k: v for k, v in meta.items() if k not in skip}, "model": {"name": meta["family"], **meta["config"]}}
    if not isinstance(meta["task"], str):
        raise TellkitError(f"{ckpt}: 'task' in config.json must be a task name")
    for section in ("data", "eval", "train"):
        if not isinstance(recipe.get(section) or {}, dict):
            raise TellkitError(f"{ckpt}: the '{section}' section of config.json must be a mapping")
        recipe[section] = dict(recipe.get(section) or {})
    if args.data:
        if not Path(args.data).exists():
            raise TellkitError(f"--data: not found: {args.data}")
        recipe["data"]["root"] = args.data
    recipe = deep_merge(recipe, parse_overrides(args.overrides))
    if args.split not in ("train", "val", "test"):
        raise TellkitError(f"--split must be train, val or test, got {args.split!r}")

    info = distributed.setup(args.device)
    try:
        task = get_task(recipe["task"])(recipe)
        model = load_model(ckpt, map_location=info.device)
        dataset = task.build_dataset(args.split)
        if dataset is None or len(dataset) == 0:
            raise TellkitError(f"split '{args.split}' is empty")
        bs = args.batch_size or recipe["eval"].get("batch_size") or recipe["train"].get("batch_size") or 16
        metrics, preds = run_eval(task, model, dataset, args.split, info, batch_size=int(bs),
                                  num_workers=int(recipe["train"].get("num_workers") or 0),
                                  progress=not args.no_progress)
        if info.is_main:
            if args.out:
                out = Path(args.out)
            else:  # a run's checkpoints/<name> evaluates into <run>/eval, a lone checkpoint into <checkpoint>/eval
                out = ckpt.parent.parent / "eval" if ckpt.parent.name == "checkpoints" else ckpt / "eval"
            info_out = {"checkpoint": str(ckpt), "task": recipe["task"], **getattr(task, "eval_info", {})}
            summary, per_example = write_eval_outputs(out, args.split, metrics, preds, info_out)
            print(json.dumps({"split": args.split, "n": len(preds), "metrics": metrics, "summary": str(summary),
                              "predictions": str(per_example)}, indent=2))
    finally:
        distributed.teardown(info)
    return 0
