"""A worker thread per model that groups concurrent requests into one forward pass.

Requests are queued with :meth:`BatchWorker.submit` (a ``concurrent.futures.Future`` comes back);
the worker takes the first waiting item, then keeps collecting until ``max_batch`` items or
``max_wait_s`` have passed, and calls ``fn(items) -> results`` once for the group. Items whose
future was cancelled (the request timed out) are dropped before the forward pass. If a whole
group fails, each item is retried alone so that one bad input cannot fail its neighbours.
A full queue refuses new work at once (the caller answers 503) instead of growing without bound.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any


class QueueFull(Exception):
    pass


class BatchWorker:
    def __init__(self, name: str, fn: Callable[[Sequence[Any]], Sequence[Any]], max_batch: int = 8,
                 max_wait_s: float = 0.01, max_queue: int = 64):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.name, self.fn = name, fn
        self.max_batch, self.max_wait_s = int(max_batch), float(max_wait_s)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.stats = {"batches": 0, "items": 0, "max_batch_seen": 0, "dropped_cancelled": 0, "errors": 0,
                      "busy_s": 0.0}
        self._thread = threading.Thread(target=self._loop, name=f"tellkit-{name}-worker", daemon=True)
        self._thread.start()

    # -- client side ----------------------------------------------------------------------------
    def submit(self, item: Any) -> Future:
        if self._stop.is_set():
            raise RuntimeError(f"{self.name} worker is stopped")
        fut: Future = Future()
        try:
            self._queue.put_nowait((item, fut))
        except queue.Full:
            raise QueueFull(f"the {self.name} queue is full ({self._queue.maxsize} waiting)") from None
        return fut

    def queued(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # -- worker side ----------------------------------------------------------------------------
    def _collect(self) -> list[tuple[Any, Future]]:
        try:
            first = self._queue.get(timeout=0.1)
        except queue.Empty:
            return []
        group = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(group) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                group.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        live = []
        for item, fut in group:
            if fut.set_running_or_notify_cancel():
                live.append((item, fut))
            else:
                with self._lock:
                    self.stats["dropped_cancelled"] += 1
        return live

    def _run(self, group: list[tuple[Any, Future]]) -> None:
        t0 = time.perf_counter()
        try:
            results = list(self.fn([item for item, _ in group]))
            if len(results) != len(group):
                raise RuntimeError(f"{self.name}: {len(results)} results for {len(group)} inputs")
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting requests
            if len(group) > 1:  # isolate the failing input
                for one in group:
                    self._run_alone(one)
            else:
                group[0][1].set_exception(exc)
                with self._lock:
                    self.stats["errors"] += 1
            return
        finally:
            with self._lock:
                self.stats["busy_s"] += time.perf_counter() - t0
        with self._lock:
            self.stats["batches"] += 1
            self.stats["items"] += len(group)
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(group))
        for (_, fut), res in zip(group, results):
            fut.set_result(res)

    def _run_alone(self, one: tuple[Any, Future]) -> None:
        item, fut = one
        try:
            res = list(self.fn([item]))[0]
        except BaseException as exc:  # noqa: BLE001
            fut.set_exception(exc)
            with self._lock:
                self.stats["errors"] += 1
            return
        with self._lock:
            self.stats["batches"] += 1
            self.stats["items"] += 1
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], 1)
        fut.set_result(res)

    def _loop(self) -> None:
        while not self._stop.is_set():
            group = self._collect()
            if group:
                self._run(group)
        # fail whatever is still waiting, so no request hangs until its timeout
        while True:
            try:
                _, fut = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"{self.name} worker stopped"))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            s = dict(self.stats)
        s["busy_s"] = round(s["busy_s"], 3)
        return {**s, "queued": self.queued(), "max_batch": self.max_batch,
                "max_wait_ms": round(self.max_wait_s * 1000, 1)}
