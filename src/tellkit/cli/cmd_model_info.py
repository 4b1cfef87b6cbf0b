"""`tellkit model-info CONFIG`: parameter counts (and a per-part breakdown) as JSON."""
from __future__ import annotations

import json

NAME = "model-info"
HELP = "print a model's parameter counts as JSON (CONFIG: YAML recipe, family name, or checkpoint dir)"


def add_arguments(p) -> None:
    p.add_argument("config", help="YAML recipe (path or name under configs/), model family, or checkpoint directory")
    p.add_argument("overrides", nargs="*", help="model field overrides, key=value (e.g. d_model=512)")


def run(args) -> int:
    from pathlib import Path

    import torch

    from tellkit.config import parse_overrides, to_dict
    from tellkit.registry import create_model

    over = parse_overrides(args.overrides)
    over = over.get("model", over)
    with torch.device("meta"):  # counts only: no memory, no init time
        if Path(args.config).is_dir():
            from tellkit.checkpoint import read_checkpoint_config

            meta = read_checkpoint_config(args.config)
            model = create_model({"name": meta["family"], **meta["config"]}, **over)
        else:
            model = create_model(args.config, **over)
    info = {
        "family": model.family,
        "trainable_params": model.num_parameters(trainable_only=True),
        "total_params": model.num_parameters(),
    }
    if hasattr(model, "parameter_breakdown"):
        info["breakdown"] = model.parameter_breakdown()
    info["config"] = to_dict(model.config)
    print(json.dumps(info, indent=2))
    return 0
