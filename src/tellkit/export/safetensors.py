"""``tellkit export SRC --format safetensors --out DIR``: a training checkpoint as a compact
inference checkpoint (how packaged default models are made): the model's weights (float16 by
default: half the size; loading casts them back to the model's float32 parameters), its config,
and the recipe sections the training loop stored (task, data, eval, train, encoders ...), so
evaluation and captioning prepare inputs exactly as in training. No optimizer, RNG or trainer
state, and nothing of the training machine: the data root, the feature-cache folder and the run
it started from are cleared (pass ``--data`` to evaluate it), and the number of data-loading
worker processes goes back to the default, so a model trained on a large machine does not start
a dozen workers on a laptop. Works for any registered model family.

:func:`average_checkpoints` writes the same kind of checkpoint from the element-wise mean of
several checkpoints of one model (weight averaging of the states along a training run, as in
checkpoint averaging / stochastic weight averaging); :func:`tellkit.export.folder.write_checkpoint_folder`
puts either in place without ever leaving a half-written or lost folder.

``weights="int8"`` stores weight matrices as int8 with one float32 scale per row
(:func:`quantize_int8`); :func:`tellkit.checkpoint.load_model` restores float32."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tellkit.checkpoint import (
    INT8_SCALE,
    carried_encoder_files,
    load_model,
    save_model,
    unique_state,
    write_tensor_files,
)
from tellkit.encoders.weights import read_weights_file
from tellkit.errors import TellkitError
from tellkit.recipes import RESERVED_CHECKPOINT_KEYS, TrainConfig
from tellkit.training.ema import EMA_FILE, check_fits, read_average

# how an inference checkpoint stores its weights: float16 halves float32's size; int8 stores weight
# matrices with one float32 scale per row (see quantize_int8), the rest float16
WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}

# settings of the training machine, not of the model: (section, key) -> the exported value
MACHINE_LOCAL = {("data", "root"): None, ("data", "features"): None, ("train", "init_from"): None,
                 ("train", "num_workers"): TrainConfig.num_workers}


def export_safetensors(checkpoint: str | Path, out: str | Path, *, weights: str = "float16",
                       note: dict[str, Any] | None = None, average: bool = False) -> Path:
    """The checkpoint folder (or run folder's checkpoint) ``checkpoint`` as a compact inference
    checkpoint in ``out``: ``weights`` float16 (default), float32 or int8, ``note`` stored as
    provenance under ``note`` in config.json. ``average``: the moving average of the weights the
    state carries (``train.ema``, :mod:`tellkit.training.ema`) instead of its raw weights."""

    model = load_model(checkpoint)
    if average:
        tensors = read_average(model.checkpoint_dir)
        if tensors is None:
            raise TellkitError(f"{model.checkpoint_dir}: carries no averaged weights (trained without train.ema)")
        check_fits(model, tensors, str(model.checkpoint_dir / EMA_FILE))
        model.load_state_dict({**model.state_dict(), **tensors})
        note = {**(note or {}), "weights": "exponential moving average (train.ema)"}
    carried = {key: _read_tensors(path) for key, path in
               carried_encoder_files(model.checkpoint_meta, model.checkpoint_dir).items()}
    return _write_inference(model, model.checkpoint_meta, out, weights=weights, note=note, carried=carried)


def average_checkpoints(checkpoints: Sequence[str | Path], out: str | Path, *, weights: str = "float16",
                        note: dict[str, Any] | None = None) -> Path:
    """The mean of the weights of ``checkpoints`` (two or more, of the same family and model
    config) as an inference checkpoint whose recipe sections are the first one's. Floating-point
    tensors (BatchNorm running statistics included) are averaged in float32; integer buffers
    (BatchNorm batch counts) are the last checkpoint's. ``averaged_from`` in config.json lists
    the sources (run and state folder names)."""

    if len(checkpoints) < 2:
        raise TellkitError(f"averaging needs at least two checkpoints, got {len(checkpoints)}")
    first = load_model(checkpoints[0])
    meta = first.checkpoint_meta
    carried = [carried_encoder_files(meta, first.checkpoint_dir)]
    total = {k: v.detach().float().clone() if v.is_floating_point() else v.clone()
             for k, v in first.state_dict().items()}
    for path in checkpoints[1:]:
        other = load_model(path)
        theirs = other.checkpoint_meta
        if theirs["family"] != meta["family"]:
            raise TellkitError(f"{path}: holds a '{theirs['family']}' model, {checkpoints[0]} a '{meta['family']}' one")
        if theirs["config"] != meta["config"]:
            diff = sorted(k for k in set(meta["config"]) | set(theirs["config"])
                          if meta["config"].get(k) != theirs["config"].get(k))
            raise TellkitError(f"{path}: a different model configuration from {checkpoints[0]} "
                               f"({', '.join(diff[:5])}); only checkpoints of one model can be averaged")
        carried.append(carried_encoder_files(theirs, other.checkpoint_dir))
        if set(carried[-1]) != set(carried[0]):
            raise TellkitError(f"{path}: carries encoder weights {sorted(carried[-1]) or 'none'}, {checkpoints[0]} "
                               f"{sorted(carried[0]) or 'none'}; only checkpoints of one kind can be averaged")
        for k, v in other.state_dict().items():
            if v.is_floating_point():
                total[k] += v.detach().float()
            else:
                total[k] = v.clone()
        del other
    n = len(checkpoints)
    own = first.state_dict()
    with torch.no_grad():
        for k, v in own.items():
            v.copy_((total[k] / n).to(v.dtype) if v.is_floating_point() else total[k])
    sources = [source_name(Path(c)) for c in checkpoints]
    means = {key: _mean_tensors([_read_tensors(c[key]) for c in carried], key) for key in carried[0]}
    return _write_inference(first, meta, out, weights=weights, note=note, averaged_from=sources,
                            carried=means)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_weights_file(path, f"encoder weights {path.name}")


def _mean_tensors(states: list[dict[str, torch.Tensor]], key: str) -> dict[str, torch.Tensor]:
    """The element-wise mean of encoder weights (e.g. BatchNorm running statistics that moved
    during training), floating-point tensors in float32; integer ones are the last state's."""
    if any(set(s) != set(states[0]) or any(s[k].shape != states[0][k].shape for k in s) for s in states):
        raise TellkitError(f"the checkpoints' encoders.{key} files hold different tensors; they cannot be averaged")
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            out[k] = (sum(s[k].float() for s in states) / len(states)).to(v.dtype)
        else:
            out[k] = states[-1][k].clone()
    return out


def source_name(path: Path) -> str:
    """``run/step_00000584`` for a state of a run, else ``parent/folder`` (no machine paths)."""
    path = path.resolve()
    parent = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return f"{parent.name}/{path.name}"


def _write_inference(model, meta: dict[str, Any], out: str | Path, *, weights: str,
                     note: dict[str, Any] | None, averaged_from: list[str] | None = None,
                     carried: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """``carried``: {encoders key: tensors} of encoder weights the source checkpoint carries
    (a converted ResNet, the BatchNorm statistics of a reference-mode run): written beside the
    model under their usual names and named by their bare file names, as the source did."""
    if weights not in WEIGHT_DTYPES:
        raise TellkitError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    extra = {k: v for k, v in meta.items() if k not in RESERVED_CHECKPOINT_KEYS}
    for (section, key), value in MACHINE_LOCAL.items():
        if isinstance(extra.get(section), dict) and key in extra[section]:
            extra[section] = {**extra[section], key: value}
    extra.pop("averaged_from", None)
    if averaged_from:
        extra["averaged_from"] = averaged_from
    if note:
        extra["note"] = note
    files = {}
    for key, tensors in (carried or {}).items():
        name = Path(str(meta["encoders"][key])).name
        extra["encoders"] = {**extra["encoders"], key: name}
        files[name] = tensors
    if weights == "int8":
        d = save_model(model, out, extra={**extra, "weights_dtype": "int8"}, state=quantize_int8(unique_state(model)))
    else:
        d = save_model(model, out, extra=extra, dtype=WEIGHT_DTYPES[weights])
    if files:
        write_tensor_files(Path(d), files)
    return d


INT8_MIN_ELEMENTS = 4096  # smaller floating-point tensors (biases, norms) are stored in float16


def quantize_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight matrices (floating point, 2+ dimensions, at least INT8_MIN_ELEMENTS) as int8 with
    one float32 scale per row (symmetric: row / (max |row| / 127), rounded), stored under
    ``name + INT8_SCALE``; other floating-point tensors in float16, the rest unchanged. A quarter
    of float32's size for the matrices; :func:`tellkit.checkpoint.dequantize_int8` restores float32."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if v.is_floating_point() and v.dim() >= 2 and v.numel() >= INT8_MIN_ELEMENTS:
            rows = v.detach().float().reshape(v.size(0), -1)
            scale = rows.abs().amax(1).clamp(min=1e-30) / 127.0
            out[k] = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8).reshape(v.shape)
            out[k + INT8_SCALE] = scale.contiguous()
        elif v.is_floating_point():
            out[k] = v.to(torch.float16)
        else:
            out[k] = v
    return out
