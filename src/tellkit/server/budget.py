"""What one request costs the model that answers it, known before its search starts.

A recognizer's input is prepared (rendered or scaled to the model's training size, which for a
bitmap depends on its ink, not on its pixel count) on the server's decoding threads; from the
prepared image's size follow BTTR's encoder grid (one cell per 16 x 16 pixels) and so the working
set of its search: the grid's projected keys and values in every decoder layer (one copy per
image, shared by the beams of both directions, and again in the rescoring pass), the
self-attention cache of the 2 x beam decoder rows up to ``max_len`` tokens, and the encoder's
activations. :func:`recognition_cost` turns that into bytes (for the shared
:class:`~tellkit.server.batching.MemoryBudget`) and units of work (for the worker's time estimate).

Measured on the packaged BTTR (beam 10, d_model 256, 3 decoder layers; a 300 x 300 noise PNG is
prepared to 576 x 576, 1,296 cells): one search grows the process's peak by 96 MiB, two in one
batch by 188 MiB; the estimate is 141 MiB a search (docs/server.md).

:class:`PrepareOnce` is the bridge that lets the server prepare an input on its own threads while
the pipeline's call stays ``model(items)``: the pipeline's per-input ``prepare`` finds the result
the server already made instead of preparing the input again.
"""
from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GRID_STRIDE = 16            # BTTR's DenseNet encoder: one memory cell per 16 x 16 input pixels
WORST_PIXELS = 576 * 576    # an input the server could not prepare first: the renderer's cap, padded
ENCODER_BYTES_PER_PIXEL = 240  # DenseNet activations at their peak (measured: 79 MiB for 576 x 576)
KV_COPIES = 2               # the projected memory in the search and again in the rescoring pass
CACHE_OVERHEAD = 1.5        # the self-attention cache and the copy made when beams are reordered
FIXED_BYTES = 8 << 20
CAPTION_FIXED_BYTES = 8 << 20  # a caption's encoders and search besides its image copies
CAPTION_BYTES_PER_PIXEL = 6     # measured: 66 MiB for a batch of four 1600 x 1600 photos (packaged captioner)
FACE_BYTES_PER_PIXEL = 24       # MTCNN's image pyramid in float32, for models that read faces


@dataclass(frozen=True)
class Cost:
    bytes: int    # estimated peak working memory of the item's share of a batch
    work: float   # relative time (the worker learns seconds per unit)


def preparer(model) -> Any | None:
    """The object whose ``prepare(item)`` the served pipeline calls once per input, or None."""
    for name in ("rec", "processor"):
        obj = getattr(model, name, None)
        if obj is not None and callable(getattr(obj, "prepare", None)):
            return obj
    return None


class PrepareOnce:
    """Installed as ``owner.prepare``: :meth:`early` prepares an item (on the caller's thread) and
    keeps the result until the pipeline asks for that same item object; anything else is prepared
    as before. A result nobody asks for goes when its item is garbage-collected."""

    def __init__(self, owner):
        self.inner = owner.prepare
        self._ready: dict[int, tuple[weakref.ref, Any]] = {}
        self._lock = threading.Lock()
        owner.prepare = self

    def early(self, item: Any) -> Any:
        out = self.inner(item)
        key = id(item)
        ref = weakref.ref(item, lambda _r, k=key: self._forget(k))
        with self._lock:
            self._ready[key] = (ref, out)
        return out

    def _forget(self, key: int) -> None:
        with self._lock:
            self._ready.pop(key, None)

    def __call__(self, item: Any) -> Any:
        with self._lock:
            found = self._ready.get(id(item))
            if found is not None and found[0]() is item:
                del self._ready[id(item)]
                return found[1]
        return self.inner(item)

    def pending(self) -> int:
        with self._lock:
            return len(self._ready)


def _pixels(prepared: Any) -> tuple[int, int] | None:
    """(height, width) of a prepared input: a tensor [..., H, W] or a mapping holding one."""
    if isinstance(prepared, Mapping):
        prepared = prepared.get("image")
    shape = getattr(prepared, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return int(shape[-2]), int(shape[-1])


def _search_settings(model) -> tuple[int, int]:
    gen = getattr(model, "generation", None)
    beam = getattr(model, "beam_size", None) or getattr(gen, "beam_size", None)
    length = getattr(model, "max_len", None) or getattr(gen, "max_len", None)
    rec = getattr(model, "rec", None)
    beam = beam or getattr(rec, "beam_size", None) or 1
    length = length or getattr(rec, "max_len", None) or 256
    return int(beam), int(length)


def _network_config(model) -> Any:
    net = getattr(getattr(model, "rec", None), "model", None) or getattr(model, "model", None)
    return getattr(net, "config", None)


def recognition_cost(model, prepared: Any = None) -> Cost:
    """Bytes and work of one input's BTTR search (worst case when ``prepared`` is None)."""
    hw = _pixels(prepared) if prepared is not None else None
    pixels = hw[0] * hw[1] if hw else WORST_PIXELS
    cells = (math.ceil(hw[0] / GRID_STRIDE) * math.ceil(hw[1] / GRID_STRIDE)) if hw else WORST_PIXELS // 256
    cfg = _network_config(model)
    if cfg is None or not hasattr(cfg, "d_model"):  # not a BTTR-like search (a stand-in): its share only
        return Cost(FIXED_BYTES, 1.0)
    beam, length = _search_settings(model)
    d, layers = int(getattr(cfg, "d_model", 256)), int(getattr(cfg, "num_decoder_layers", 3))
    rows = 2 * beam  # both directions
    per_row = 2 * layers * d * 4  # keys and values, float32, every layer: per memory cell or past token
    kv = KV_COPIES * cells * per_row  # one projected memory per image, shared by its rows
    cache = CACHE_OVERHEAD * rows * length * per_row  # the self-attention cache at max_len
    total = kv + cache + ENCODER_BYTES_PER_PIXEL * pixels + FIXED_BYTES
    return Cost(int(total), float(rows * (cells + 64)))


def caption_cost(image: Any, faces: bool = False) -> Cost:
    """Bytes and work of one caption: copies of the (already shrunk) image, face detection's
    pyramid when the model reads faces, plus the models' share."""
    w, h = getattr(image, "size", (1600, 1600))
    per_pixel = CAPTION_BYTES_PER_PIXEL + (FACE_BYTES_PER_PIXEL if faces else 0)
    return Cost(int(per_pixel * w * h + CAPTION_FIXED_BYTES), 1.0 + w * h / 1e6)


def reads_faces(model) -> bool:
    """Whether a captioner detects faces (its ``info`` lists them among its contexts)."""
    contexts = (getattr(model, "info", None) or {}).get("contexts") or ()
    return any("face" in str(c) for c in contexts)
