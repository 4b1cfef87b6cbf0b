"""`tellkit model-info CONFIG`: parameter counts (and a per-part breakdown) as JSON."""
from __future__ import annotations

import json
from pathlib import Path

from tellkit.errors import TellkitError

NAME = "model-info"
HELP = ("print a model's parameter counts (and this CPU's bf16 capability) as JSON "
        "(CONFIG: YAML recipe, family name, or checkpoint dir)")


def add_arguments(p) -> None:
    p.add_argument("config", help="YAML recipe (path or name under configs/), model family, or checkpoint directory")
    p.add_argument("overrides", nargs="*", help="model field overrides, key=value (e.g. d_model=512)")


def run(args) -> int:
    import torch  # heavy

    from tellkit.config import parse_overrides, to_dict  # heavy
    from tellkit.registry import create_model  # heavy

    over = parse_overrides(args.overrides)
    over = over.get("model", over)
    if Path(args.config).is_dir():
        from tellkit.checkpoint import check_config_values, read_checkpoint_config  # heavy

        meta = read_checkpoint_config(args.config)
        check_config_values(meta["config"], str(Path(args.config) / "config.json"))
        source: object = {"name": meta["family"], **meta["config"]}
        vocabulary = _vocabulary(meta)
    else:
        vocabulary = None
        source = args.config
    try:
        with torch.device("meta"):  # counts only: no memory, no init time
            model = create_model(source, **over)
    except TellkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a config that does not build is bad input, not a crash
        first = (str(exc).strip().splitlines() or [""])[0]
        raise TellkitError(f"{args.config}: the model config does not build ({type(exc).__name__}: {first})") from exc
    info = {
        "family": model.family,
        "trainable_params": model.num_parameters(trainable_only=True),
        "total_params": model.num_parameters(),
    }
    if hasattr(model, "parameter_breakdown"):
        info["breakdown"] = model.parameter_breakdown()
    info["config"] = to_dict(model.config)
    from tellkit.utils.precision import bf16_support  # heavy

    # what `--dtype bf16` / `train.amp: bf16` get on this machine's CPU (granted only where native)
    info["cpu_bf16"] = bf16_support().as_dict()
    if vocabulary is not None:
        info["vocabulary"] = vocabulary
    print(json.dumps(info, indent=2))
    return 0


def _vocabulary(meta) -> dict | None:
    """A handwriting reader's vocabulary: the symbols it stores (``data.symbols``), or CROHME's."""
    from tellkit.data.latex import SYMBOLS, Vocab, check_symbols  # heavy

    if meta.get("family") not in ("bttr", "comer", "bttr_legacy"):
        return None
    stored = (meta.get("data") or {}).get("symbols") if isinstance(meta.get("data"), dict) else None
    symbols = check_symbols(stored, "config.json: data.symbols") if stored is not None else list(SYMBOLS)
    v = Vocab(symbols)
    return {"size": len(v), "special": v.itos[:3], "symbols": v.symbols,
            "source": "data.symbols" if stored is not None else "CROHME's 110 symbols (the default)"}
