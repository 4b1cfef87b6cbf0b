"""`tellkit train CONFIG [key=value ...] [--out DIR] [--resume]`: the one training loop.

Multi-GPU / multi-process: ``torchrun --nproc_per_node N -m tellkit train CONFIG ...``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from tellkit.cli import positive_int

NAME = "train"
HELP = "train a model from a YAML recipe (key=value overrides, e.g. train.lr=3e-4 model.d_model=256)"


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes, got {text!r}") from None
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or a positive number of minutes, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_arguments(p) -> None:
    p.add_argument("config", help="YAML recipe (path, or name under configs/ such as tat/small)")
    p.add_argument("overrides", nargs="*",
                   help="section.key=value overrides, right after CONFIG (values parsed as YAML)")
    p.add_argument("--out", help="run folder (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--save-every-steps", type=positive_int, default=None, metavar="N",
                   help="also checkpoint every N optimizer steps")
    p.add_argument("--save-every-minutes", type=_minutes, default=30.0, metavar="M",
                   help="also checkpoint every M minutes (default 30; 0 = only at evaluations)")
    p.add_argument("--keep-checkpoints", type=_count, default=0, metavar="N",
                   help="keep the states of the N newest saved steps besides last and best (default 0), e.g. to "
                   "average them with tellkit average")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")


def run(args) -> int:
    from tellkit.config import deep_merge, load_yaml, parse_overrides, resolve_config_path  # heavy
    from tellkit.workflows import train_recipe  # heavy

    path = resolve_config_path(args.config)
    recipe = deep_merge(load_yaml(path), parse_overrides(args.overrides))
    out = Path(args.out) if args.out else Path("runs") / path.stem
    summary = train_recipe(
        recipe,
        out,
        resume=args.resume,
        device=args.device,
        save_every_steps=args.save_every_steps,
        save_every_minutes=args.save_every_minutes or None,
        keep_checkpoints=args.keep_checkpoints,
        progress=not args.no_progress,
    )

    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary, indent=2))
    if summary["stopped"] == "signal":
        return 130
    return 0
