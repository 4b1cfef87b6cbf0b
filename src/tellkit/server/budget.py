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
