"""`tellkit evaluate CHECKPOINT --data PATH --split test [--out DIR]`.

The checkpoint's ``config.json`` names its ``task`` and carries the other sections of the training
recipe (data, eval, train, encoders ...; written by ``tellkit train``); ``--data`` replaces ``data.root``, ``key=value``
overrides change anything else (e.g. ``eval.beam_size=4``). Writes ``metrics_<split>.json`` and
``predictions_<split>.jsonl`` into ``--out``, by default ``<run>/eval`` for a checkpoint of a
``tellkit train`` run and ``./runs/eval/<checkpoint name>`` for any other (never into the
checkpoint's folder, which may be inside the installed package). Generation runs the task's
processor and search, as ``tellkit caption`` / ``recognize`` / ``summarize`` do; ``--dtype bf16``
runs it in bfloat16 autocast where the device computes it natively, ``--runtime onnx`` with the
model's ONNX graphs under ONNX Runtime (the loss stays PyTorch's). Works under ``torchrun`` too
(predictions gathered, scored once).
"""
from __future__ import annotations

import json
import sys

from tellkit.cli import add_dtype_argument, add_runtime_argument, positive_int

NAME = "evaluate"
HELP = "generate for a data split with a checkpoint and score it (JSON summary + per-example JSONL)"


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder, or a run folder (its best checkpoint is used)")
    p.add_argument("overrides", nargs="*",
                   help="section.key=value overrides of the stored recipe (right after CHECKPOINT)")
    p.add_argument("--data", help="data location (sets data.root of the stored recipe)")
    p.add_argument("--split", default="test", help="train, val or test (default: test)")
    p.add_argument("--out", help="output folder (default: <run>/eval for a training run's checkpoint, "
                                 "else ./runs/eval/<checkpoint name>)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="default: eval.batch_size or train.batch_size")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    add_dtype_argument(p)
    add_runtime_argument(p)
    p.add_argument("--no-progress", action="store_true")


def run(args) -> int:
    from tellkit.checkpoint import resolve_checkpoint  # heavy
    from tellkit.errors import TellkitError  # heavy
    from tellkit.utils.files import check_output_path  # heavy
    from tellkit.utils.runlock import pruned_while_reading, reading_states  # heavy
    from tellkit.workflows import evaluate_checkpoint  # heavy

    if args.out:  # a looping link, /proc, a file: refused before the evaluation
        check_output_path(args.out, "--out", folder=True)
    with reading_states(args.checkpoint):  # a run being trained prunes no state meanwhile
        ckpt = resolve_checkpoint(args.checkpoint)
        try:
            result = evaluate_checkpoint(ckpt, args.split, data=args.data, overrides=args.overrides, out=args.out,
                                         batch_size=args.batch_size, device=args.device,
                                         progress=not args.no_progress, dtype=args.dtype, runtime=args.runtime)
        except TellkitError as exc:
            raise pruned_while_reading(ckpt, exc) or exc from None
    if result.info.get("dtype_note"):
        print(f"tellkit evaluate: note: {result.info['dtype_note']}", file=sys.stderr)
    if (result.info.get("rare_names") or {}).get("note"):  # e.g. no training split: said, not hidden
        print(f"tellkit evaluate: warning: {result.info['rare_names']['note']}", file=sys.stderr)
    if result.summary_file is not None:  # the main process of a torchrun group
        print(json.dumps(result.report(), indent=2))
    return 0
