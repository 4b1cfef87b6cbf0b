"""`tellkit sprint CONFIG [key=value ...] --out RUN --minutes M`: on a machine lent for minutes,
profile the training step (batch sizes, data loading, device busy share, host-device
synchronisations), then train at the fastest setting until the time is up, saving a state every
minute; the same command again resumes the run. See :mod:`tellkit.workflows.sprint`."""
from __future__ import annotations

import argparse
import json

from tellkit.cli import positive_float, positive_int

NAME = "sprint"
HELP = "profile the training step, then train at the fastest setting for a fixed time (resumable)"


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes such as 32,64,128, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive whole numbers, got {text!r}")
    return sizes


def add_arguments(p) -> None:
    p.add_argument("config", help="YAML recipe (path, or name under configs/ such as bttr/crohme_aug)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, right after CONFIG")
    p.add_argument("--out", required=True, help="run folder (a folder a sprint started is resumed)")
    p.add_argument("--minutes", type=positive_float, required=True,
                   help="wall-clock minutes from start to finish, profile and saving included")
    p.add_argument("--batch-sizes", type=_sizes, default=[32, 64, 128], metavar="B,B,...",
                   help="batch sizes to profile (default 32,64,128); the one that trains most images/s is used")
    p.add_argument("--profile-seconds", type=positive_float, default=60.0, metavar="S",
                   help="time for the profile, all batch sizes together (default 60)")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="data-loading processes (default: the available cores but one)")
    p.add_argument("--epoch-minutes", type=positive_float, default=3.0, metavar="M",
                   help="training time between validations (default 3)")
    p.add_argument("--no-lr-scaling", action="store_true",
                   help="keep the recipe's learning rate (default: scaled by sqrt(batch / the recipe's batch))")
    p.add_argument("--export", metavar="DIR",
                   help="also write the last state (float16), the profile, logs and summary into DIR, one flat folder")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of progress bars")


def run(args) -> int:
    from tellkit.config import deep_merge, load_yaml, parse_overrides, resolve_config_path  # heavy
    from tellkit.workflows.sprint import sprint  # heavy

    recipe = deep_merge(load_yaml(resolve_config_path(args.config)), parse_overrides(args.overrides))
    summary = sprint(recipe, args.out, minutes=args.minutes, batch_sizes=args.batch_sizes,
                     profile_seconds=args.profile_seconds, workers=args.workers, device=args.device,
                     epoch_minutes=args.epoch_minutes, export=args.export, scale_lr=not args.no_lr_scaling,
                     progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0
