"""Benchmarks behind ``tellkit bench`` / ``make bench``.

Each module ``tellkit/bench/<suite>.py`` defines ``run(quick: bool = False, device: str = "cpu")
-> dict`` (JSON-able); ``tellkit bench`` writes ``bench/results/<suite>.json`` with the
machine's description added. Timings are measured here; tests never assert on them.
"""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any


def machine() -> dict[str, Any]:
    import torch  # heavy

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            info["memory_gb"] = round(int(f.readline().split()[1]) / 1024**2, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def timed(fn: Callable[[], Any], device: str = "cpu", repeat: int = 1) -> tuple[float, Any]:
    """Best wall-clock seconds of ``repeat`` runs (CUDA synchronised), and the last result."""
    import torch  # heavy

    best, result = float("inf"), None
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, result
