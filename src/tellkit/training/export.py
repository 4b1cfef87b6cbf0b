"""Turn a training checkpoint into a compact inference checkpoint (how packaged default models
are made): the model's weights (float16 by default: half the size; loading casts them back to
the model's float32 parameters), its config, and the recipe sections the training loop stored
(task, data, eval, train, encoders ...), so evaluation and captioning prepare inputs exactly as
in training. No optimizer, RNG or trainer state, and nothing of the training machine: the data
root and the run it started from are cleared (pass ``--data`` to evaluate it), and the number
of data-loading worker processes goes back to the default, so a model trained on a large
machine does not start a dozen workers on a laptop. Works for any registered model family."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tellkit.training.config import TrainConfig

RESERVED = ("format_version", "family", "config", "tellkit_version")
# settings of the training machine, not of the model: (section, key) -> the exported value
MACHINE_LOCAL = {("data", "root"): None, ("train", "init_from"): None,
                 ("train", "num_workers"): TrainConfig.num_workers}


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, half: bool = True,
                      note: dict[str, Any] | None = None) -> Path:
    from tellkit.checkpoint import load_model, read_checkpoint_config

    meta = read_checkpoint_config(checkpoint)
    model = load_model(checkpoint)
    if half:
        model = model.half()
    extra = {k: v for k, v in meta.items() if k not in RESERVED}
    for (section, key), value in MACHINE_LOCAL.items():
        if isinstance(extra.get(section), dict) and key in extra[section]:
            extra[section] = {**extra[section], key: value}
    extra["weights_dtype"] = "float16" if half else "float32"
    if note:
        extra["note"] = note
    return model.save_pretrained(out, extra=extra)
