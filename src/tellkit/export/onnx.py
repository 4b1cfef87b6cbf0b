"""``tellkit export MODEL --format onnx --out DIR``: a checkpoint's model as ONNX graphs that
:mod:`tellkit.runtime.ort` runs with ONNX Runtime, driven by the project's own searches.

What is exported is the model, never a search: the encoder, and one decoder step whose state
(self-attention keys/values per layer, the projected memory; the LSTM state and the attention
inputs) comes in and goes out as explicit tensors (the graphs: :mod:`tellkit.export.onnx_graphs`).

The folder is also the checkpoint it was made from: its ``config.json`` (the task, the model
and its recipe sections: how inputs are prepared and searched) with an ``onnx`` entry naming the
graphs, its ``model.safetensors`` and any encoder weights it carries, copied unchanged. So
``tellkit recognize / caption / evaluate --model DIR`` read it as any checkpoint, and
``--runtime onnx`` runs the graphs. Families: ``bttr`` (not ``bttr_legacy``, tellkit 0.1's layout) and
``show_attend_tell`` (soft attention, with its frozen image encoder).

:func:`exported` gives the ONNX folder of any checkpoint: the checkpoint itself when it is one,
else an export made once into the user cache (``$TELLKIT_CACHE``, default ``~/.cache/tellkit``:
``onnx/<family>-<digest of the checkpoint's files>``).

The graphs are written by PyTorch's TorchScript-based exporter (``torch.onnx.export(...,
dynamo=False)``; torch is pinned, see ``pyproject.toml``) at ONNX opset :data:`OPSET`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from tellkit._version import __version__
from tellkit.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    carried_encoder_files,
    load_model,
    read_json_file,
    upgrade_checkpoint_meta,
)
from tellkit.encoders.bundle import EncoderBundle
from tellkit.errors import TellkitError
from tellkit.export import onnx_graphs as graphs
from tellkit.utils.optional import require

OPSET = 17
FORMAT_VERSION = 1
FAMILIES = ("bttr", "show_attend_tell")
# the graphs of each family: role -> file
GRAPHS = {"bttr": {"encoder": "bttr_encoder.onnx", "memory": "bttr_memory.onnx", "step": "bttr_step.onnx",
                   "score": "bttr_score.onnx"},
          "show_attend_tell": {"image_encoder": "image_encoder.onnx", "init": "sat_init.onnx", "step": "sat_step.onnx"}}


def manifest(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The ``onnx`` entry of a checkpoint's config.json (None: not an ONNX export)."""
    entry = meta.get("onnx")
    return entry if isinstance(entry, dict) else None


def check_exportable(meta: dict[str, Any], where: str = "") -> None:
    family = meta.get("family")
    if family == "bttr_legacy":
        raise TellkitError(f"{where}: ONNX export covers BTTR in the reference's layout, "
                           "not tellkit 0.1's own (bttr_legacy)")
    if family not in FAMILIES:
        raise TellkitError(f"{where}: ONNX export covers {', '.join(FAMILIES)}; this checkpoint holds '{family}'")
    cfg = meta.get("config") or {}
    if family == "show_attend_tell" and cfg.get("attention", "soft") != "soft":
        raise TellkitError(f"{where}: ONNX export covers Show, Attend and Tell with soft attention")


def export_onnx(checkpoint: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the ONNX export of ``checkpoint`` (a checkpoint folder) into the folder ``out``
    (created; its parent must exist). Returns ``out``."""
    require("onnx", "onnx", "ONNX export")
    src, out = Path(checkpoint), Path(out)
    raw = read_json_file(src / CONFIG_NAME, "checkpoint config")
    raw = upgrade_checkpoint_meta(raw, str(src / CONFIG_NAME))  # a format-1 BTTR names its layout by a variant
    check_exportable(raw, str(src))
    model = load_model(src).float().eval()
    meta = model.checkpoint_meta  # as read_checkpoint_config gives it: carried encoder files resolved
    out.mkdir(parents=True, exist_ok=True)
    names = dict(GRAPHS[raw["family"]])
    extra: dict[str, Any] = {}
    with warnings.catch_warnings(), torch.no_grad():
        # the TorchScript exporter's deprecation and tracer notes: the graphs are checked by the parity tests
        warnings.simplefilter("ignore")
        if raw["family"] == "bttr":
            _export_bttr(model, out, names)
        else:
            extra["image_size"] = _export_sat(model, meta, out, names)
    shutil.copyfile(src / WEIGHTS_NAME, out / WEIGHTS_NAME)
    for path in carried_encoder_files(meta, src).values():
        shutil.copyfile(path, out / path.name)
    raw["onnx"] = {"format_version": FORMAT_VERSION, "opset": OPSET, "graphs": names, **extra,
                   "exported_with": {"tellkit": __version__, "torch": torch.__version__}}
    (out / CONFIG_NAME).write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def _save(module: torch.nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
          dynamic: dict[str, dict[int, str]]) -> None:
    torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                      dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)


def _export_bttr(model, out: Path, names: dict[str, str]) -> None:
    cfg = model.config
    n_layers, heads, d = cfg.num_decoder_layers, cfg.nhead, cfg.d_model
    hd = d // heads
    # encoder: grad mode on so that DenseNetB.forward takes its plain layer-by-layer path (the
    # inference shortcut writes into preallocated buffers, which a trace cannot generalise)
    with torch.enable_grad():
        _save(graphs.BTTREncoderGraph(model), (torch.rand(2, 1, 48, 80),), out / names["encoder"], ["image"],
              ["memory"], {"image": {0: "images", 2: "height", 3: "width"}, "memory": {0: "images", 1: "cells"}})
    mem_names = [f"memory_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]
    cells = {0: "images", 2: "cells"}
    _save(graphs.BTTRMemoryGraph(model), (torch.rand(2, 7, d),), out / names["memory"], ["memory"], mem_names,
          {"memory": {0: "images", 1: "cells"}, **{n: cells for n in mem_names}})
    m, n = 2, 3  # images, rows (two slots per image)
    memory = [torch.rand(m, heads, 7, hd) for _ in mem_names]
    layout = [torch.tensor([0, 1, 2, n]), torch.tensor([0, 1, 2])]  # image 0: rows 0, 1; image 1: row 2
    pad = torch.zeros(m, 7, dtype=torch.bool)
    pad[1, 5:] = True
    common = ["slot_rows", "row_slots", "memory_pad"]
    dyn_common = {"slot_rows": {0: "slots"}, "row_slots": {0: "rows"}, "memory_pad": {0: "images", 1: "cells"},
                  **{k: cells for k in mem_names}}
    past_names = [f"past_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]
    present_names = [f"present_{kv}_{i}" for i in range(n_layers) for kv in ("key", "value")]
    past = [torch.rand(n, heads, 3, hd) for _ in past_names]
    _save(graphs.BTTRStepGraph(model),
          (torch.tensor([4, 5, 6]), torch.tensor([3]), *layout, pad, *past, *memory), out / names["step"],
          ["tokens", "position", *common, *past_names, *mem_names], ["log_probs", *present_names],
          {"tokens": {0: "rows"}, "log_probs": {0: "rows"}, **dyn_common,
           **{k: {0: "rows", 2: "past"} for k in past_names}, **{k: {0: "rows", 2: "length"} for k in present_names}})
    seq = torch.tensor([[1, 5, 6, 7], [2, 7, 0, 0], [1, 8, 9, 0]])
    _save(graphs.BTTRScoreGraph(model), (seq, seq.roll(-1, 1), *layout, pad, *memory), out / names["score"],
          ["inputs", "targets", *common, *mem_names], ["logprob"],
          {"inputs": {0: "rows", 1: "length"}, "targets": {0: "rows", 1: "length"}, "logprob": {0: "rows"},
           **dyn_common})


def _export_sat(model, meta: dict[str, Any], out: Path, names: dict[str, str]) -> list[int]:
    cfg = model.config
    encoder = image_encoder(meta)
    from PIL import Image  # heavy

    pixels = encoder.preprocess.batch([Image.new("RGB", (64, 48)), Image.new("RGB", (48, 64))])
    size = list(pixels.shape[-2:])
    # fixed pixel size (the encoder's pre-processing gives one): TF 'same' padding is read from it
    _save(graphs.ImageEncoderGraph(encoder, size), (pixels,), out / names["image_encoder"], ["pixels"], ["grid"],
          {"pixels": {0: "images"}, "grid": {0: "images"}})
    b, cells = 2, 5
    a, valid = torch.rand(b, cells, cfg.image_dim), torch.ones(b, cells, dtype=torch.bool)
    valid[1, 4] = False
    rows = {0: "rows", 1: "cells"}
    _save(graphs.SATInitGraph(model), (a, valid), out / names["init"], ["a", "valid"], ["wa", "h", "c"],
          {"a": rows, "valid": rows, "wa": rows, "h": {0: "rows"}, "c": {0: "rows"}})
    h = torch.rand(b, cfg.hidden_dim)
    wa = torch.rand(b, cells, cfg.attention_dim)
    _save(graphs.SATStepGraph(model), (torch.tensor([cfg.bos_id, 7]), a, valid, wa, h, h.clone()),
          out / names["step"], ["tokens", "a", "valid", "wa", "h", "c"], ["log_probs", "alpha", "h_out", "c_out"],
          {"tokens": {0: "rows"}, "a": rows, "valid": rows, "wa": rows, "h": {0: "rows"}, "c": {0: "rows"},
           "log_probs": {0: "rows"}, "alpha": rows, "h_out": {0: "rows"}, "c_out": {0: "rows"}})
    return size


def image_encoder(meta: dict[str, Any]):
    """The frozen image encoder a captioning checkpoint's ``encoders`` section names (``meta`` as
    :func:`~tellkit.checkpoint.read_checkpoint_config` gives it: a carried weights file resolved)."""
    return EncoderBundle(meta.get("encoders"), ("image",)).image_encoder


# --- the ONNX folder of any checkpoint ------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("TELLKIT_CACHE") or Path.home() / ".cache" / "tellkit").expanduser() / "onnx"


def _digest(folder: Path, meta: dict[str, Any]) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION} {__version__} {torch.__version__}".encode())
    for path in [folder / CONFIG_NAME, folder / WEIGHTS_NAME, *carried_encoder_files(meta, folder).values()]:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def exported(checkpoint: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """The ONNX folder for ``checkpoint`` (its config.json read as ``meta``): the checkpoint
    itself when it is an ONNX export, else one exported once into :func:`cache_root`."""
    folder = Path(checkpoint)
    entry = manifest(meta)
    if entry is not None:
        missing = [g for g in entry.get("graphs", {}).values() if not (folder / g).is_file()]
        if missing:
            raise TellkitError(f"{folder}: an ONNX export without {', '.join(missing)}; export it again")
        return folder
    check_exportable(meta, str(folder))
    target = cache_root() / f"{meta['family']}-{_digest(folder, meta)}"
    if (target / CONFIG_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"tellkit: exporting {folder} to ONNX once, into {target}", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        export_onnx(folder, staging)
        try:
            staging.rename(target)
        except OSError:  # another process put it there first
            if not (target / CONFIG_NAME).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
