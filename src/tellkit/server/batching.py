"""A worker thread per model that groups concurrent requests into one forward pass, within a
memory budget shared by the models, and refuses work it cannot finish in time.

Requests are queued with :meth:`BatchWorker.submit` (a ``concurrent.futures.Future`` comes back)
with what they cost: ``cost`` (bytes of model working memory, estimated before the search
starts) and ``work`` (the worker's own unit of time, e.g. grid cells x beams). The worker takes
the waiting item that is due first, then keeps collecting until ``max_batch`` items, the
:class:`MemoryBudget`, or ``max_wait_s`` says stop, and calls ``fn(items) -> results`` once for
the group. The budget is shared by every worker of the server: the batches running at once
together hold at most ``budget.total`` bytes (one item larger than that runs alone). Items
whose future was cancelled (the request timed out) are dropped before the forward pass. If a
whole group fails, each item is retried alone so that one bad input cannot fail its neighbours.

Which item is due first: the one submitted earliest, plus ``aging`` times its estimated
seconds, so a cheap request is not stuck behind a queue of expensive ones (and an expensive one
waits at most for the cheap ones submitted within that window). Admission: from the measured
seconds per unit of work, a request whose estimated wait plus its own time would pass
``deadline_s`` is refused at once (:class:`QueueFull` with a ``retry_after``), as is one that finds
``max_queue`` items waiting, so an admitted request is answered, not timed out. After a batch,
when nothing is waiting, freed memory goes back to the system (:func:`tellkit.utils.memory.release_memory`).
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tellkit.utils.memory import release_memory


class QueueFull(Exception):
    """The worker refuses an item; ``retry_after``: seconds after which it may accept it."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class MemoryBudget:
    """Bytes of model working memory that the batches running at once may hold (all workers)."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError("a memory budget is at least 1 byte")
        self.total, self.used, self.peak = int(total), 0, 0
        self._cond = threading.Condition()

    def acquire(self, n: int, stop: threading.Event | None = None) -> bool:
        """Wait until ``n`` more bytes fit (or nothing else holds any); False if ``stop`` is set."""
        with self._cond:
            while self.used and self.used + n > self.total:
                if stop is not None and stop.is_set():
                    return False
                self._cond.wait(0.1)
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used = max(0, self.used - n)
            self._cond.notify_all()


@dataclass(order=True)
class _Entry:
    due: float
    seq: int
    item: Any = field(compare=False)
    fut: Future = field(compare=False)
    cost: int = field(compare=False, default=0)
    work: float = field(compare=False, default=1.0)


class BatchWorker:
    def __init__(self, name: str, fn: Callable[[Sequence[Any]], Sequence[Any]], max_batch: int = 8,
                 max_wait_s: float = 0.01, max_queue: int = 64, budget: MemoryBudget | None = None,
                 aging: float = 10.0, trim: bool = True):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name, self.fn = name, fn
        self.max_batch, self.max_wait_s, self.max_queue = int(max_batch), float(max_wait_s), int(max_queue)
        self.budget, self.aging, self.trim = budget, float(aging), trim
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.seconds_per_work: float | None = None  # measured (moving average); None until a batch ran
        self._running_until = 0.0  # estimated end of the batch now running
        self.stats = {"batches": 0, "items": 0, "max_batch_seen": 0, "dropped_cancelled": 0, "errors": 0,
                      "busy_s": 0.0, "refused_busy": 0}
        self._thread = threading.Thread(target=self._loop, name=f"tellkit-{name}-worker", daemon=True)
        self._thread.start()

    # -- client side ----------------------------------------------------------------------------
    def estimate_s(self, work: float) -> float:
        return 0.0 if self.seconds_per_work is None else work * self.seconds_per_work

    def submit(self, item: Any, cost: int = 0, work: float = 1.0, deadline_s: float | None = None) -> Future:
        """Queue ``item``; :class:`QueueFull` when the queue is full or when, by the measured
        speed, it would not be answered within ``deadline_s`` seconds."""
        if self._stop.is_set():
            raise RuntimeError(f"{self.name} worker is stopped")
        fut: Future = Future()
        now = time.monotonic()
        own = self.estimate_s(work)
        entry = _Entry(now + self.aging * own, next(self._seq), item, fut, int(cost), float(work))
        with self._cond:
            if len(self._heap) >= self.max_queue:
                self._refused()
                raise QueueFull(f"the {self.name} queue is full ({self.max_queue} waiting)",
                                self.estimate_s(sum(e.work for e in self._heap)) or 1.0)
            ahead = sum(e.work for e in self._heap if e < entry)
            wait = max(0.0, self._running_until - now) + self.estimate_s(ahead) + own
            if deadline_s is not None and self.seconds_per_work is not None and wait > deadline_s:
                self._refused()
                raise QueueFull(f"the {self.name} model has about {wait:.0f} s of work queued, more than the "
                                f"{deadline_s:g} s a request may take", wait - deadline_s + own)
            heapq.heappush(self._heap, entry)
            self._cond.notify()
        return fut

    def _refused(self) -> None:
        with self._lock:
            self.stats["refused_busy"] += 1

    def queued(self) -> int:
        with self._cond:
            return len(self._heap)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

    # -- worker side ----------------------------------------------------------------------------
    def _take(self, group: list[_Entry], wait_s: float) -> bool:
        """Move the entry due first into ``group`` if it fits the batch and the budget; waits up
        to ``wait_s`` for one to arrive. -> whether one was taken."""
        with self._cond:
            if not self._heap and wait_s > 0:
                self._cond.wait(wait_s)
            if not self._heap:
                return False
            cost = sum(e.cost for e in group)
            if group and self.budget is not None and cost + self._heap[0].cost > self.budget.total:
                return False
            group.append(heapq.heappop(self._heap))
            return True

    def _collect(self) -> list[_Entry]:
        group: list[_Entry] = []
        if not self._take(group, 0.1):
            return []
        deadline = time.monotonic() + self.max_wait_s
        while len(group) < self.max_batch and self._take(group, deadline - time.monotonic()):
            pass
        live = []
        for e in group:
            if e.fut.set_running_or_notify_cancel():
                live.append(e)
            else:
                with self._lock:
                    self.stats["dropped_cancelled"] += 1
        return live

    def _run(self, group: list[_Entry]) -> None:
        cost = sum(e.cost for e in group)
        if self.budget is not None and not self.budget.acquire(cost, self._stop):
            for e in group:
                e.fut.set_exception(RuntimeError(f"{self.name} worker stopped"))
            return
        work = sum(e.work for e in group)
        t0 = time.perf_counter()
        self._running_until = time.monotonic() + self.estimate_s(work)
        try:
            self._call(group)
        finally:
            dt = time.perf_counter() - t0
            self._running_until = 0.0
            if self.budget is not None:
                self.budget.release(cost)
            rate = dt / max(work, 1e-9)  # a moving average of the measured speed
            self.seconds_per_work = rate if self.seconds_per_work is None else 0.7 * self.seconds_per_work + 0.3 * rate
            with self._lock:
                self.stats["busy_s"] += dt

    def _call(self, group: list[_Entry]) -> None:
        try:
            results = list(self.fn([e.item for e in group]))
            if len(results) != len(group):
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(group)} inputs")
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting requests
            if len(group) > 1:  # isolate the failing input
                for one in group:
                    self._call([one])
            else:
                group[0].fut.set_exception(exc)
                with self._lock:
                    self.stats["errors"] += 1
            return
        with self._lock:
            self.stats["batches"] += 1
            self.stats["items"] += len(group)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(group))
        for e, res in zip(group, results):
            e.fut.set_result(res)

    def _loop(self) -> None:
        while not self._stop.is_set():
            group = self._collect()
            if group:
                self._run(group)
                if self.trim and not self.queued():
                    release_memory()  # the burst is over: give the batch's memory back
        with self._cond:  # fail whatever is still waiting, so no request hangs until its timeout
            left, self._heap = self._heap, []
        for e in left:
            if e.fut.set_running_or_notify_cancel():
                e.fut.set_exception(RuntimeError(f"{self.name} worker stopped"))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self.stats)
        s["busy_s"] = round(s["busy_s"], 3)
        rate = self.seconds_per_work
        return {**s, "queued": self.queued(), "max_batch": self.max_batch,
                "max_wait_ms": round(self.max_wait_s * 1000, 1),
                "seconds_per_work": None if rate is None else float(f"{rate:.3g}")}
