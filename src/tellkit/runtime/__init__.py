"""Where a model's forward computation runs: PyTorch (``torch``, the default) or ONNX Runtime
(``onnx``, the ``onnx`` extra). :meth:`tellkit.pipelines.base.Pipeline.load` (``runtime=``, also
of ``tellkit.pipeline`` and ``tellkit recognize / caption --runtime``) and evaluation
(``tellkit evaluate --runtime``) choose it the same way, through :func:`generating_model`: the
model whose ``generate`` the task's processor calls.

- :mod:`tellkit.export.onnx`: ``tellkit export --format onnx`` (a checkpoint folder plus its
  graphs: the model pieces of :mod:`tellkit.export.onnx_graphs`) and the export of any
  checkpoint made once into the user cache.
- :mod:`tellkit.runtime.ort`: the graphs behind the interfaces the project's searches drive,
  so the searches (beam search, BTTR's joint search and rescoring, length normalisation) are the
  same code on both runtimes.

With ``onnx`` the task's processor still prepares the inputs and decodes the outputs (the one
path from input to answer); the captioner's frozen image encoder runs as a graph too. The ONNX
runtime computes in float32 on the CPU: ``dtype='bf16'`` and CUDA devices are refused.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from tellkit.errors import TellkitError
from tellkit.export.onnx import exported
from tellkit.runtime.ort import OnnxImageEncoder, open_model
from tellkit.utils.optional import require

RUNTIMES = ("torch", "onnx")


def check_runtime(runtime: str | None, *, device: Any = None, dtype: str | None = None) -> str:
    """``runtime`` (None: torch) checked against the device and dtype it would run with."""
    name = "torch" if runtime is None else str(runtime)
    if name not in RUNTIMES:
        raise TellkitError(f"runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if name == "onnx":
        for module in ("onnx", "onnxruntime"):  # before any work: a missing extra is named first
            require(module, "onnx", "the ONNX runtime")
        if device is not None and torch.device(device).type != "cpu":
            raise TellkitError(f"runtime onnx runs on the CPU, not on {device}")
        if dtype is not None and str(dtype).lower() not in ("fp32", "float32"):
            raise TellkitError(f"runtime onnx computes in float32; dtype {dtype} is for the torch runtime")
    return name


def onnx_model(path: str | os.PathLike, meta: dict[str, Any], threads: int | None = None):
    """The ONNX runtime model of the checkpoint at ``path`` (exported first when it is not an
    ONNX folder: :func:`tellkit.export.onnx.exported`)."""
    return open_model(exported(path, meta), threads=threads)


def bind(model, processor) -> None:
    """Let ``processor`` compute through ``model``'s graphs where it runs a network itself (a
    captioning processor's frozen image encoder)."""
    bundle = getattr(processor, "bundle", None)
    if bundle is not None and "image" in bundle.contexts and "image_encoder" in model.sessions:
        current = bundle.image_encoder
        if not isinstance(current, OnnxImageEncoder):
            bundle.image_encoder = OnnxImageEncoder(current, model)


def generating_model(model, runtime: str | None, path: str | os.PathLike, meta: dict[str, Any], processor, *,
                     device: Any = None, dtype: str | None = None, threads: int | None = None):
    """The model whose ``generate`` a pipeline's or the evaluator's searches call, for ``runtime``:
    ``model`` itself ('torch', None), or the ONNX Runtime model of the checkpoint at ``path``
    with ``processor``'s own network bound to its graphs (:func:`bind`). The processor, the
    search and the decoding stay the same. -> (that model, what the pipeline's ``info`` adds:
    nothing for torch; ``runtime`` and ``onnx``, the graphs' folder, for ONNX)."""
    if check_runtime(runtime, device=device, dtype=dtype) == "torch":
        return model, {}
    onnx = onnx_model(path, meta, threads)
    bind(onnx, processor)
    return onnx, {"runtime": "onnx", "onnx": str(onnx.folder)}
