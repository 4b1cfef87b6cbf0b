"""`tellkit evaluate CHECKPOINT --data PATH --split test [--out DIR]`.

The checkpoint's ``config.json`` names its ``task`` and carries the other sections of the training
recipe (data, eval, train, encoders ...; written by ``tellkit train``); ``--data`` replaces ``data.root``, ``key=value``
overrides change anything else (e.g. ``eval.beam_size=4``). Writes ``metrics_<split>.json`` and
``predictions_<split>.jsonl``. Works under ``torchrun`` too (predictions gathered, scored once).
"""
from __future__ import annotations

import json

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
    from tellkit.workflows import evaluate_checkpoint  # heavy

    result = evaluate_checkpoint(args.checkpoint, args.split, data=args.data, overrides=args.overrides, out=args.out,
                                 batch_size=args.batch_size, device=args.device, progress=not args.no_progress)
    if result.summary_file is not None:  # the main process of a torchrun group
        print(json.dumps(result.report(), indent=2))
    return 0
