"""What every inference pipeline says about the model it runs: its ``info`` dict (family,
checkpoint, trained or not, training progress), and JSON-safe scores."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite_or_none(x) -> float | None:
    """JSON has no infinities: a search that found nothing scores -inf -> None."""
    x = float(x)
    return x if math.isfinite(x) else None


def checkpoint_info(family: str, path: Path | str | None, meta: dict[str, Any],
                    trained: bool | None = None) -> dict[str, Any]:
    """What /health and every response say about a model. A checkpoint counts as trained when
    the training loop wrote it (its metadata has a ``train`` section) unless told otherwise."""
    if trained is None:
        trained = bool(meta.get("train")) or bool(meta.get("trained"))
    info = {"family": family, "checkpoint": str(path) if path else None, "trained": trained}
    for key in ("task", "step", "tellkit_version", "weights_dtype", "note"):
        if key in meta:
            info[key] = meta[key]
    state = Path(path) / "trainer_state.json" if path else None
    if state is not None and state.is_file():  # a training-loop checkpoint: how far it got
        try:
            st = json.loads(state.read_text(encoding="utf-8"))
            info["train_steps"] = st.get("step")
            info["best"] = {"value": st.get("best"), "step": st.get("best_step")}
        except (OSError, ValueError):
            pass
    return info
