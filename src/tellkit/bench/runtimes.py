"""Runtimes side by side, in one run (``tellkit bench runtimes`` -> ``bench/results/runtimes.json``):
PyTorch float32, PyTorch bfloat16 autocast (``dtype="bf16"``), int8 dynamic quantisation of the
linear layers (PyTorch's ``quantize_dynamic`` on the float32 model: weights int8, activations
quantised per batch; see :func:`int8_dynamic`) and ONNX Runtime (``runtime="onnx"``), for

* the packaged BTTR's joint search over CROHME 2014 test (all 986 InkML expressions under
  ``$TELLKIT_SHARED_DATA/crohme_inkml/test/2014``): images/s of the search (inputs rendered once
  beforehand, the same for every row), ExpRate, and how many outputs differ from float32's;
* the packaged captioner on a folder of 100 Flickr8k test photos (``flickr8k/``; decoding,
  the image encoder and the beam search included): photos/s, and the captions compared.

Every row runs with the same thread count (``torch.get_num_threads()``; ONNX Runtime is given
the same) after a warm-up batch; the load average before and after is recorded, since other work
on the machine slows every row. ``quick``: 16 expressions, 8 photos.

The ``onnxruntime`` row of the recognition part is the ONNX parity over all 986 expressions."""
from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tellkit.data.crohme import load_split
from tellkit.errors import TellkitError
from tellkit.metrics.exprate import exprate
from tellkit.pipelines.base import Pipeline
from tellkit.pipelines.captioning import CaptioningPipeline
from tellkit.pipelines.recognition import RecognitionPipeline, Strokes

QUICK = (16, 8)  # --quick: expressions, photos
FULL = (None, 100)  # all 986 expressions, 100 photos

# row name -> Pipeline.load options; "int8" is not a load option: the float32 model is quantised
ROWS: dict[str, dict[str, Any]] = {
    "pytorch_fp32": {},
    "pytorch_bf16": {"dtype": "bf16"},
    "int8_dynamic": {"int8": True},
    "onnxruntime": {"runtime": "onnx"},
}


def int8_dynamic(model):
    """``model`` with its ``nn.Linear`` layers replaced by dynamically quantised int8 ones
    (``torch.ao.quantization.quantize_dynamic``). Layers inside modules that read a linear
    layer's ``weight`` themselves (adaptive input and softmax: class names starting with
    ``Adaptive``) stay float32."""
    keep = {name for name, m in model.named_modules() if type(m).__name__.startswith("Adaptive")}
    names = {name for name, m in model.named_modules() if type(m) is nn.Linear
             and not any(name == k or name.startswith(k + ".") for k in keep)}
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
        warnings.simplefilter("ignore")
        spec = {n: torch.ao.quantization.default_dynamic_qconfig for n in names}
        return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8)


def load_row(cls, options: dict[str, Any]):
    """The pipeline of one row (``cls.load`` with ``options``; int8: quantised after loading)."""
    options = dict(options)
    int8 = options.pop("int8", False)
    pipe = cls.load(**options)
    if int8:
        pipe.model = int8_dynamic(pipe.model)
        pipe.info["dtype"] = "int8 dynamic (linear layers)"
    return pipe


def shared_data() -> Path:
    env = os.environ.get("TELLKIT_SHARED_DATA", "").strip()
    path = Path(env).expanduser() if env else Path(__file__).resolve().parents[4] / "shared" / "data"
    if not path.is_dir():
        raise TellkitError(f"bench runtimes: the shared data is not at {path} (set TELLKIT_SHARED_DATA)")
    return path


def flickr8k_test(root: Path) -> list[Path]:
    names = (root / "flickr8k" / "Flickr8k_text" / "Flickr_8k.testImages.txt").read_text().split()
    return [root / "flickr8k" / "images" / n for n in names]


def _timed_run(pipe: Pipeline, prepared: list, **options: Any) -> tuple[float, list[dict]]:
    """:meth:`Pipeline.run` on inputs already prepared: seconds and results in input order."""
    results: list[dict | None] = [None] * len(prepared)
    t0 = time.perf_counter()
    for idx in pipe.processor.batches(prepared, pipe.batch_size):
        batch = pipe.preprocess([prepared[i] for i in idx])
        out = pipe.forward(batch, **pipe.generate_options(**options))
        for i, res in zip(idx, pipe.postprocess(out, batch, **options)):
            results[i] = res
    return time.perf_counter() - t0, results  # type: ignore[return-value]


def _compare(ids: list[str], base: list[dict], other: list[dict]) -> dict[str, Any]:
    diff = [{"id": i, "fp32": a["text"], "other": b["text"], "fp32_score": a.get("score"),
             "other_score": b.get("score")} for i, a, b in zip(ids, base, other) if a["text"] != b["text"]]
    return {"outputs_differing_from_fp32": len(diff), "differences": diff}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def bench_recognition(limit: int | None, threads: int) -> dict[str, Any]:
    """Every row over the first ``limit`` (None: all) CROHME 2014 test expressions."""
    root = shared_data() / "crohme_inkml"
    exprs = load_split(root, "2014", "inkml")[:limit]
    ids, refs = [e.id for e in exprs], [e.tokens for e in exprs]
    prepared = None
    rows, base = {}, None
    for name, options in ROWS.items():
        pipe = load_row(RecognitionPipeline, options)
        if prepared is None:  # rendered once: every row reads the same images
            prepared = pipe.prepare([Strokes(e.ink.strokes) for e in exprs])
        _timed_run(pipe, prepared[:2])  # warm-up
        before = _load()
        seconds, res = _timed_run(pipe, prepared)
        row = {"seconds": round(seconds, 1), "images_per_s": round(len(res) / seconds, 3), "dtype": pipe.info["dtype"],
               **exprate([r["tokens"] for r in res], refs), "load_average": {"before": before, "after": _load()}}
        if base is None:
            base = res
        else:
            row.update(_compare(ids, base, res))
        rows[name] = row
    return {"model": "packaged BTTR (bttr_default)", "data": "CROHME 2014 test, InkML", "expressions": len(exprs),
            "threads": threads, "rows": rows}


def bench_captioning(photos: list[Path], threads: int) -> dict[str, Any]:
    """Every row captioning ``photos`` as a folder is captioned (read, encode, search)."""
    ids = [p.name for p in photos]
    rows, base = {}, None
    for name, options in ROWS.items():
        pipe = load_row(CaptioningPipeline, options)
        pipe([str(p) for p in photos[:2]], details=False)  # warm-up
        before = _load()
        t0 = time.perf_counter()
        res = pipe([str(p) for p in photos], details=False)
        seconds = time.perf_counter() - t0
        row = {"seconds": round(seconds, 1), "photos_per_s": round(len(res) / seconds, 3), "dtype": pipe.info["dtype"],
               "load_average": {"before": before, "after": _load()}}
        if base is None:
            base = res
        else:
            row.update(_compare(ids, base, res))
        if len(ids) <= 8:
            row["captions"] = {i: r["text"] for i, r in zip(ids, res)}
        rows[name] = row
    return {"model": "packaged captioner (default_caption)", "data": "Flickr8k test photos (the split's first)",
            "photos": len(photos), "threads": threads, "rows": rows}


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """``tellkit bench runtimes``: see the module docstring."""
    import torch  # heavy

    if device != "cpu":
        raise TellkitError("bench runtimes compares CPU runtimes (ONNX Runtime runs on the CPU): use --device cpu")
    threads = torch.get_num_threads()
    load_before = _load()
    n_exprs, n_photos = QUICK if quick else FULL
    photos = flickr8k_test(shared_data())[:n_photos]
    result = {"recognize": bench_recognition(n_exprs, threads), "captioning": bench_captioning(photos, threads)}
    result["load_average"] = {"before": load_before, "after": _load()}
    return result
