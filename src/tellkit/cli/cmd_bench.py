"""`tellkit bench`: run the speed benchmarks and write JSON under bench/results/."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from pathlib import Path

from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_json

NAME = "bench"
HELP = "run speed benchmarks (Transform and Tell generation/training, encoders, BTTR search) and write JSON"


def add_arguments(p) -> None:
    p.add_argument("suites", nargs="*", help="which suites (default: all found in tellkit.bench)")
    p.add_argument("--out", default="bench/results", help="output folder (default: bench/results)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")


def _suites() -> dict[str, str]:
    import tellkit.bench as pkg  # heavy

    # a suite is a module of tellkit.bench with a run() function
    names = [m.name for m in pkgutil.iter_modules(pkg.__path__)]
    return {n: f"tellkit.bench.{n}" for n in names if hasattr(importlib.import_module(f"tellkit.bench.{n}"), "run")}


def run(args) -> int:
    import torch  # heavy

    from tellkit.bench import machine  # heavy

    available = _suites()
    chosen = args.suites or sorted(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise TellkitError(f"unknown benchmark suite(s) {unknown}; available: {sorted(available)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TellkitError("--device cuda asked for, but no CUDA device is available")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        mod = importlib.import_module(available[name])
        fn = mod.run
        params = inspect.signature(fn).parameters
        kwargs = {k: v for k, v in (("quick", args.quick), ("device", device)) if k in params}
        print(f"[bench] {name} ...", flush=True)
        t0 = time.time()
        result = fn(**kwargs)
        record = {"suite": name, "device": device, "quick": args.quick, "machine": machine(),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "wall_seconds": round(time.time() - t0, 1), "results": result}
        path = out_dir / f"{name}.json"
        atomic_write_json(path, record)
        print(f"[bench] {name}: wrote {path}", flush=True)
    return 0
