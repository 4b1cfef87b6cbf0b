"""What one request costs, known before its search starts, and the bridge that lets the server
prepare an input on its own threads.

Each served pipeline says what an input costs (:meth:`tellkit.pipelines.base.Pipeline.cost`:
bytes for the shared :class:`~tellkit.server.batching.MemoryBudget`, units of work for the
worker's time estimate), and whether its inputs are prepared first
(:attr:`~tellkit.pipelines.base.Pipeline.prepares_early`: a recognizer's working set follows from
the prepared image's size, which for a bitmap depends on its ink, not on its pixel count).

:class:`PrepareOnce` lets the server prepare an input on its decoding threads while the
pipeline's call stays ``model(items)``: the pipeline's per-input ``prepare`` finds the result the
server already made instead of preparing the input again.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from tellkit.pipelines.base import FIXED_BYTES, Cost

__all__ = ["FIXED_BYTES", "Cost", "PrepareOnce", "preparer"]


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


# --- the memory of requests' decoded inputs ---------------------------------------------------------
# Bytes the estimates count (CPython, measured with tracemalloc): a JSON list or object parsed
# from the strokes field holds up to 88 bytes with its slot in its parent, a number 32; a parsed
# point (a tuple of two floats in a list) is kept at about 120 bytes; PIL holds 4 bytes a pixel of
# an RGB(A) image being decoded, and the shrunk RGB copy 3.
PARSED_CONTAINER, PARSED_NUMBER, KEPT_POINT, KEPT_STROKE = 88, 32, 120, 64
DECODING_PIXEL, DECODED_PIXEL = 4, 3


def strokes_parse_bytes(text: str) -> int:
    """Memory that parsing the strokes JSON ``text`` may take at most (its containers and numbers
    counted from its brackets and commas, plus the text), before a byte of it is parsed."""
    containers = text.count("[") + text.count("{")
    return len(text) + PARSED_CONTAINER * containers + PARSED_NUMBER * (text.count(",") + 1)


def strokes_kept_bytes(strokes) -> int:
    """Memory a parsed drawing (:class:`~tellkit.pipelines.recognition.Strokes`) keeps."""
    lines = getattr(strokes, "strokes", strokes)
    return sum(KEPT_STROKE + KEPT_POINT * len(s) for s in lines)


def article_bytes(text: str) -> int:
    """Memory of an article's text (up to 4 bytes a character)."""
    return 4 * len(text)


def image_bytes(width: int, height: int, out_size: tuple[int, int] | None = None) -> int:
    """Memory of an image being decoded (its full bitmap and the shrunk copy, ``out_size``), or,
    with only ``width`` x ``height``, of the decoded RGB copy kept for the model."""
    if out_size is None:
        return DECODED_PIXEL * width * height
    return DECODING_PIXEL * width * height + DECODED_PIXEL * out_size[0] * out_size[1]


class InputBudget:
    """Bytes of requests' inputs the server holds at once: images being decoded and decoded,
    strokes being parsed and parsed, articles. A request takes its share before the work that
    needs it (:class:`InputHold`); past ``total`` it is refused, not queued (a 503 with
    Retry-After). A single input larger than ``total`` is admitted when nothing else is held."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError("an input budget is at least 1 byte")
        self.total, self.used, self.peak = int(total), 0, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.total:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


class InputHold:
    """One request's share of an :class:`InputBudget`, by part (``"image"``, ``"strokes"``,
    ``"article"``): :meth:`need` sets a part to ``n`` bytes (more is taken from the budget, or
    ``refuse(what, n)`` is raised; less is given back), :meth:`close` gives all back when the
    request ends. Thread-safe through the budget's lock (a request's parts change one at a time)."""

    def __init__(self, budget: InputBudget, refuse):
        self.budget, self.refuse, self.parts = budget, refuse, {}

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())

    def need(self, n: int, what: str) -> None:
        n, had = max(0, int(n)), self.parts.get(what, 0)
        if n > had and not self.budget.take(n - had):
            raise self.refuse(what, n)
        if n < had:
            self.budget.give(had - n)
        self.parts[what] = n

    def close(self) -> None:
        self.budget.give(self.bytes)
        self.parts.clear()

    def __enter__(self) -> InputHold:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
