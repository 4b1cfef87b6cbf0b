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

With ``small_lane_bytes``, a second thread takes only batches that cost at most that much, so a
small request is answered while a large one runs beside it (within the shared budget).

Which item is due first: the one submitted earliest, plus ``aging`` times its estimated
seconds, so a cheap request is not stuck behind a queue of expensive ones (and an expensive one
waits at most for the cheap ones submitted within that window). Admission: from the measured
seconds per unit of work, a request whose estimated wait plus its own time, times
:data:`ADMIT_MARGIN`, would pass ``deadline_s`` is refused at once (:class:`QueueFull` with a
``retry_after``), as is one that finds ``max_queue`` items waiting, so an admitted request is
answered, not timed out. After a batch, when nothing is waiting, freed memory goes back to the
system (:func:`tellkit.utils.memory.release_memory`).
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

ADMIT_MARGIN = 1.5  # the speed estimate may be off this much (another process's load, an unlike input)


class QueueFull(Exception):
    """The worker refuses an item; ``retry_after``: seconds after which it may accept it."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class MemoryBudget:
    """Bytes of model working memory that the batches running at once may hold (all workers).
    Granted in the order asked (a worker that releases and asks again queues behind the one
    already waiting, so no worker is starved by another's stream of batches)."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError("a memory budget is at least 1 byte")
        self.total, self.used, self.peak = int(total), 0, 0
        self._cond = threading.Condition()
        self._turns: list[int] = []
        self._tickets = itertools.count()

    def acquire(self, n: int, stop: threading.Event | None = None) -> bool:
        """Wait for this caller's turn and until ``n`` more bytes fit (or nothing else holds
        any); False if ``stop`` is set meanwhile."""
        with self._cond:
            ticket = next(self._tickets)
            self._turns.append(ticket)
            try:
                while self._turns[0] != ticket or (self.used and self.used + n > self.total):
                    if stop is not None and stop.is_set():
                        return False
                    self._cond.wait(0.1)
                self.used += n
                self.peak = max(self.peak, self.used)
                return True
            finally:
                self._turns.remove(ticket)
                self._cond.notify_all()

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
                 aging: float = 10.0, trim: bool = True, small_lane_bytes: int | None = None):
        """``small_lane_bytes``: a second thread runs only batches of items that cost at most
        this much (together), so a small request does not wait for a large one to finish."""
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name, self.fn = name, fn
        self.max_batch, self.max_wait_s, self.max_queue = int(max_batch), float(max_wait_s), int(max_queue)
        self.budget, self.aging, self.trim, self.small = budget, float(aging), trim, small_lane_bytes
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.rates: dict[bool, float] = {}  # seconds per unit of work, measured (moving average), per item class
        self._running_until: dict[bool, float] = {}  # lane (small only?) -> estimated end of its batch
        self.stats = {"batches": 0, "items": 0, "max_batch_seen": 0, "dropped_cancelled": 0, "errors": 0,
                      "busy_s": 0.0, "refused_busy": 0}
        lanes = [False] + ([True] if small_lane_bytes is not None else [])
        self._threads = [threading.Thread(target=self._loop, args=(small,), daemon=True,
                                          name=f"tellkit-{name}-worker" + ("-small" if small else ""))
                         for small in lanes]
        for t in self._threads:
            t.start()

    # -- client side ----------------------------------------------------------------------------
    @property
    def seconds_per_work(self) -> float | None:
        """The measured speed of the large items (the only class without a small lane)."""
        return self.rates.get(False, self.rates.get(True))

    def _small(self, cost: int) -> bool:
        """Whether an item of ``cost`` bytes may run on the small lane (its class for timing)."""
        return self.small is not None and cost <= self.small

    def estimate_s(self, work: float, small: bool = False) -> float:
        """Seconds for ``work`` units of the class; a class not measured yet is assumed twice as
        slow as the other (0 before anything ran)."""
        if small in self.rates:
            return work * self.rates[small]
        return work * 2 * self.rates[not small] if (not small) in self.rates else 0.0

    def submit(self, item: Any, cost: int = 0, work: float = 1.0, deadline_s: float | None = None) -> Future:
        """Queue ``item``; :class:`QueueFull` when the queue is full or when, by the measured
        speed of its class (small or large), it would not be answered within ``deadline_s``."""
        if self._stop.is_set():
            raise RuntimeError(f"{self.name} worker is stopped")
        fut: Future = Future()
        now, small = time.monotonic(), self._small(cost)
        own = self.estimate_s(work, small)
        entry = _Entry(now + self.aging * own, next(self._seq), item, fut, int(cost), float(work))
        with self._cond:
            if len(self._heap) >= self.max_queue:
                self._refused()
                raise QueueFull(f"the {self.name} queue is full ({self.max_queue} waiting)",
                                self.estimate_s(sum(e.work for e in self._heap)) or 1.0)
            # the items of its class due before it, and the batch now running in its lane
            ahead = sum(e.work for e in self._heap if e < entry and self._small(e.cost) == small)
            wait = max(0.0, self._running_until.get(small, 0.0) - now) + self.estimate_s(ahead, small) + own
            if deadline_s is not None and self.rates and wait * ADMIT_MARGIN > deadline_s:
                self._refused()
                raise QueueFull(f"the {self.name} model has about {wait:.0f} s of work queued for this request, "
                                f"too close to the {deadline_s:g} s a request may take",
                                wait * ADMIT_MARGIN - deadline_s + own)
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
        for t in self._threads:
            t.join(timeout)

    # -- worker side ----------------------------------------------------------------------------
    def _due(self, small: bool) -> _Entry | None:
        if not small:
            return self._heap[0] if self._heap else None
        return min((e for e in self._heap if e.cost <= self.small), default=None)

    def _take(self, group: list[_Entry], wait_s: float, small: bool = False) -> bool:
        """Move the entry due first (of those the lane takes) into ``group`` if it fits the batch
        and the budget; waits up to ``wait_s`` for one to arrive. -> whether one was taken."""
        with self._cond:
            if self._due(small) is None and wait_s > 0:
                self._cond.wait(wait_s)
            e = self._due(small)
            if e is None:
                return False
            limit = self.small if small else (self.budget.total if self.budget is not None else None)
            if group and limit is not None and sum(x.cost for x in group) + e.cost > limit:
                return False
            self._heap.remove(e)
            heapq.heapify(self._heap)
            group.append(e)
            return True

    def _collect(self, small: bool = False) -> list[_Entry]:
        group: list[_Entry] = []
        if not self._take(group, 0.1, small):
            return []
        deadline = time.monotonic() + self.max_wait_s
        while len(group) < self.max_batch and self._take(group, deadline - time.monotonic(), small):
            pass
        live = []
        for e in group:
            if e.fut.set_running_or_notify_cancel():
                live.append(e)
            else:
                with self._lock:
                    self.stats["dropped_cancelled"] += 1
        return live

    def _run(self, group: list[_Entry], small: bool = False) -> None:
        cost = sum(e.cost for e in group)
        if self.budget is not None and not self.budget.acquire(cost, self._stop):
            for e in group:
                e.fut.set_exception(RuntimeError(f"{self.name} worker stopped"))
            return
        work = sum(e.work for e in group)
        t0 = time.perf_counter()
        cls = all(self._small(e.cost) for e in group)
        self._running_until[small] = time.monotonic() + self.estimate_s(work, cls)
        try:
            self._call(group)
        finally:
            dt = time.perf_counter() - t0
            self._running_until.pop(small, None)
            if self.budget is not None:
                self.budget.release(cost)
            rate = dt / max(work, 1e-9)  # a moving average of the measured speed of this class
            self.rates[cls] = rate if cls not in self.rates else 0.7 * self.rates[cls] + 0.3 * rate
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

    def _loop(self, small: bool = False) -> None:
        while not self._stop.is_set():
            group = self._collect(small)
            if group:
                self._run(group, small)
                # the finished batch (its inputs, futures and results) is not kept alive by this
                # frame while the thread waits for the next one
                del group
                if self.trim and not self.queued():
                    release_memory()  # the burst is over: give the batch's memory back
        if small:
            return
        with self._cond:  # fail whatever is still waiting, so no request hangs until its timeout
            left, self._heap = self._heap, []
        for e in left:
            if e.fut.set_running_or_notify_cancel():
                e.fut.set_exception(RuntimeError(f"{self.name} worker stopped"))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self.stats)
        s["busy_s"] = round(s["busy_s"], 3)
        return {**s, "queued": self.queued(), "max_batch": self.max_batch,
                "max_wait_ms": round(self.max_wait_s * 1000, 1), "small_lane": self.small is not None,
                "seconds_per_work": {("small" if k else "large"): float(f"{v:.3g}") for k, v in self.rates.items()}}


class PriorityPool:
    """A fixed set of threads running submitted calls, the one due first first: due = the time it
    was submitted + ``weight_s`` (what the caller expects it to cost, in seconds of patience), so
    a small upload is decoded and prepared before a queue of large ones submitted just before it.
    At most ``max_heavy`` calls submitted as ``heavy`` run at once, so with two threads or more
    one is always free for the light ones (a heavy call in pure Python also holds the GIL)."""

    def __init__(self, threads: int, name: str, max_heavy: int = 1):
        self._heap: list[tuple[float, int, bool, Callable, tuple, Future]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stop, self._heavy, self.max_heavy = False, 0, max(1, max_heavy if threads > 1 else threads)
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args, weight_s: float = 0.0, heavy: bool = False) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("the pool is shut down")
            heapq.heappush(self._heap, (time.monotonic() + weight_s, next(self._seq), heavy, fn, args, fut))
            self._cond.notify()
        return fut

    def _next(self):
        """The job due first that may run now (a heavy one only below ``max_heavy``), or None."""
        if self._heavy < self.max_heavy:
            return self._heap[0] if self._heap else None
        return min((j for j in self._heap if not j[2]), default=None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                self._heap.remove(job)
                heapq.heapify(self._heap)
                self._heavy += job[2]
            _, _, heavy, fn, args, fut = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
            finally:
                with self._cond:
                    self._heavy -= heavy
                    self._cond.notify_all()
            # while it waits for the next job, the thread keeps nothing of this one (its arguments
            # may be a 5 MB upload, its future the parsed input or an exception with its frames)
            del job, fn, args, fut

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            left, self._heap = self._heap, []
            self._cond.notify_all()
        for *_, fut in left:
            fut.cancel()
