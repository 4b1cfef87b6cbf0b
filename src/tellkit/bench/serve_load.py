"""Bounded load test of ``tellkit serve`` over loopback: a fixed number of caption and recognize
requests from several concurrent clients, one in eight of them a bad request that must get its
4xx; throughput, latency percentiles (good requests), errors (must be zero) and the server's
peak memory, with request batching on (``--max-batch 8``) and off (``--max-batch 1``); then the
server's peak memory while it decodes concurrent large uploads (a 16-bit 4000x4000 PNG of ~40 KB,
16 M pixels: the largest the default pixel cap admits); then an attack (:func:`attack`): 16
concurrent random-noise images to ``/api/recognize`` (each one the model cannot read: the most
search work an image of that size can cause) while 32 clients upload one byte every 10 s (and
reconnect when cut), and one normal client sends the page's sample requests throughout: the
server's peak memory over its idle size, its memory after the burst, the answers to the noise
images, how soon the slow uploads were cut, and the normal requests' latency and statuses.

The server runs as its own process (``python -m tellkit serve --api-only``, bound to 127.0.0.1),
so its peak resident memory is read exactly from ``/proc/<pid>/status`` (VmHWM) and the client
threads do not share its interpreter. Inputs are the packaged demo samples (photos, two with an
article, one with a face; a drawn expression). The served models are the packaged defaults where
installed, tiny untrained ones (``--untrained``) otherwise; the JSON says which.

    tellkit bench serve_load            # writes bench/results/serve_load.json
    python -m tellkit.bench.serve_load --requests 96 --concurrency 8 --out bench/results
    python -m tellkit.bench.serve_load --attack-only   # only the attack: bench/results/serve_attack.json
    python -m tellkit.bench.serve_load --held-only     # 64 stalled 5 MB uploads + 16 heavy requests
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tellkit.bench import machine
from tellkit.recipes import packaged_default
from tellkit.server.runner import encode_multipart, free_port
from tellkit.server.runner import post as _strict_post
from tellkit.utils.files import atomic_write_json

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def post(url: str, fields=None, files=None, timeout: float = 60.0) -> tuple[int, dict]:
    """:func:`tellkit.server.runner.post`, but a connection the server reset or closed (it may
    refuse a body before reading all of it) or a client timeout is counted, not raised: status 0
    and ``{"error": the exception's name}``."""
    try:
        return _strict_post(url, fields=fields, files=files, timeout=timeout)
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        name = type(reason if isinstance(reason, BaseException) else exc).__name__
        return 0, {"error": name, "detail": str(exc)[:200]}


def _inputs() -> tuple[list[tuple[str, bytes, str]], bytes]:
    photos = []
    for img in sorted((ASSETS / "demo_caption").glob("*.jpg")):
        txt = img.with_suffix(".txt")
        photos.append((img.name, img.read_bytes(), txt.read_text(encoding="utf-8") if txt.is_file() else ""))
    math = (ASSETS / "samples" / "bttr_x2_plus_1.png").read_bytes()
    if not photos:
        raise RuntimeError(f"no demo images under {ASSETS / 'demo_caption'}")
    return photos, math


def _default_models() -> list[str]:
    """Server arguments: each packaged default checkpoint that is installed, tiny untrained
    models (--untrained) for the others."""
    args: list[str] = []
    for task in ("caption", "recognize"):
        path = packaged_default(task)
        if path is not None:
            args += ["--model", f"{task}={path}"]
    if len(args) < 4:
        args.append("--untrained")
    return args


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p):  # nearest-rank
        return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]

    return {"p50_ms": round(q(50) * 1000, 1), "p90_ms": round(q(90) * 1000, 1), "p99_ms": round(q(99) * 1000, 1),
            "max_ms": round(s[-1] * 1000, 1), "mean_ms": round(sum(s) / len(s) * 1000, 1)}


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def _start_server(model_args: list[str], max_batch: int, threads: int,
                  timeout: float = 120.0) -> tuple[subprocess.Popen, str]:

    port = free_port()
    cmd = [sys.executable, "-m", "tellkit", "serve", "--host", "127.0.0.1", "--port", str(port), "--api-only",
           "--max-batch", str(max_batch), "--max-wait-ms", "10", "--timeout", f"{timeout:g}", "--log-level", "warning",
           *model_args]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not answer /health within 180 s")


def large_png(width: int = 4000, height: int = 4000) -> bytes:
    """A small file that decodes to a large bitmap: 16-bit grayscale, a sparse grid of dots."""
    import numpy as np  # heavy
    from PIL import Image  # heavy

    a = np.zeros((height, width), np.uint16)
    a[::7, ::5] = 60000
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def reset_peak(pid: int) -> bool:
    """Reset the process's peak resident memory (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def large_upload_peak(url: str, pid: int, n: int = 16, path: str = "/api/recognize", data: bytes | None = None,
                      timeout: float = 120.0) -> dict[str, Any]:
    """Send ``n`` large uploads at once; -> the server's resident memory before and its peak while
    answering (MiB), and the status codes."""

    data = data if data is not None else large_png()
    if not reset_peak(pid):
        raise RuntimeError(f"cannot reset the peak memory of process {pid} (/proc/{pid}/clear_refs)")
    before = _proc_status(pid)
    with ThreadPoolExecutor(n) as pool:
        statuses = list(pool.map(lambda _: post(url + path, files={"image": ("large.png", data, "image/png")},
                                                timeout=timeout)[0], range(n)))
    after = _proc_status(pid)
    return {"uploads": n, "upload_bytes": len(data), "path": path, "rss_before_mib": before["VmRSS"],
            "peak_rss_mib": after["VmHWM"], "peak_growth_mib": after["VmHWM"] - before["VmRSS"],
            "statuses": sorted(set(statuses)), "status_counts": {s: statuses.count(s) for s in sorted(set(statuses))}}


def noise_png(side: int = 300, seed: int = 0) -> bytes:
    """A grayscale PNG of uniform random noise (~90 KB at 300 x 300): ink everywhere, nothing to read."""
    import numpy as np  # heavy
    from PIL import Image  # heavy

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _slow_upload(url: str, stop: threading.Event, drip_s: float, log: list) -> None:
    """One client that uploads a 100 KB body one byte every ``drip_s`` seconds, reconnecting
    whenever the server cuts it, until ``stop``; logs (seconds until cut, status line)."""
    host, port = url.split("//")[1].split(":")
    head = (f"POST /api/recognize HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            "Content-Length: 100000\r\n\r\n").encode()
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall(head + b"-")
                got = b""
                while not stop.is_set() and not got:
                    s.settimeout(drip_s)
                    try:
                        got = s.recv(4096) or b"<closed>"
                    except TimeoutError:
                        s.sendall(b"-")
                status = got.split(b"\r\n", 1)[0].decode("latin-1")
        except OSError as exc:
            status = f"<{type(exc).__name__}>"
        if not stop.is_set():
            log.append((round(time.monotonic() - t0, 1), status))


def _normal_client(url: str, stop: threading.Event, photo: tuple, math: bytes, log: list) -> None:
    """The page's own requests, one after another (math sample, then a caption), until ``stop``."""
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        if i % 2 == 0:
            status, _ = post(url + "/api/recognize", files={"image": ("expr.png", math, "image/png")}, timeout=120)
        else:
            name, data, article = photo
            status, _ = post(url + "/api/caption", fields={"article": article},
                             files={"image": (name, data, "image/jpeg")}, timeout=120)
        log.append(("recognize" if i % 2 == 0 else "caption", status, time.perf_counter() - t0))
        i += 1
        stop.wait(0.5)


def _sample_rss(pid: int, stop: threading.Event, log: list, t0: float) -> None:
    while not stop.is_set():
        log.append((round(time.monotonic() - t0, 1), _proc_status(pid)["VmRSS"]))
        stop.wait(0.25)


def attack(url: str, pid: int, photo: tuple, math: bytes, n_noise: int = 16, n_slow: int = 32, side: int = 300,
           drip_s: float = 10.0, min_s: float = 45.0, settle_s: float = 10.0) -> dict[str, Any]:
    """The attack of issue 39 against a running server (see the module docstring); -> its figures.
    The noise burst starts 2 s after the slow uploads and the normal client; the attack lasts until
    every noise request is answered and at least ``min_s`` seconds have passed; memory is then
    followed for ``settle_s`` seconds."""
    stop, rss_stop = threading.Event(), threading.Event()
    slow_log: list = []
    normal_log: list = []
    rss_log: list = []
    idle = _proc_status(pid)["VmRSS"]
    if not reset_peak(pid):
        raise RuntimeError(f"cannot reset the peak memory of process {pid} (/proc/{pid}/clear_refs)")
    t0 = time.monotonic()
    threads = [threading.Thread(target=_slow_upload, args=(url, stop, drip_s, slow_log), daemon=True)
               for _ in range(n_slow)]
    threads.append(threading.Thread(target=_normal_client, args=(url, stop, photo, math, normal_log), daemon=True))
    sampler = threading.Thread(target=_sample_rss, args=(pid, rss_stop, rss_log, t0), daemon=True)
    for t in [*threads, sampler]:
        t.start()
    time.sleep(2.0)
    images = [noise_png(side, seed) for seed in range(n_noise)]

    def one(data: bytes):
        t = time.perf_counter()
        status, body = post(url + "/api/recognize", files={"image": ("noise.png", data, "image/png")}, timeout=180)
        return status, time.perf_counter() - t, body.get("error")

    with ThreadPoolExecutor(n_noise) as pool:
        noise = list(pool.map(one, images))
    burst_end = time.monotonic()
    while time.monotonic() - t0 < min_s:
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(drip_s + 5)
    peak = _proc_status(pid)["VmHWM"]
    end = time.monotonic()
    time.sleep(settle_s)
    rss_stop.set()
    sampler.join(2)
    after = {f"{s}s": next((r for t, r in rss_log if t >= end - t0 + s), rss_log[-1][1]) for s in (1, 3, 5, 10)
             if s <= settle_s}
    during = [(k, s, t) for k, s, t in normal_log]
    lat = [t for _, s, t in during if s == 200]
    return {
        "noise_images": {"count": n_noise, "side": side, "png_bytes": len(images[0]),
                         "statuses": {s: [x[0] for x in noise].count(s) for s in sorted({x[0] for x in noise})},
                         "latency": _percentiles([x[1] for x in noise]),
                         "burst_s": round(burst_end - t0 - 2.0, 1)},
        "slow_uploads": {"clients": n_slow, "drip_s": drip_s, "connections": len(slow_log),
                         "cut_after_s": _seconds([x[0] for x in slow_log]),
                         "answers": {a: [x[1] for x in slow_log].count(a) for a in sorted({x[1] for x in slow_log})}},
        "normal_requests": {"sent": len(during), "statuses": {s: [x[1] for x in during].count(s)
                                                              for s in sorted({x[1] for x in during})},
                            "latency": _percentiles(lat),
                            "recognize_latency": _percentiles([t for k, s, t in during
                                                               if k == "recognize" and s == 200]),
                            "caption_latency": _percentiles([t for k, s, t in during if k == "caption" and s == 200])},
        "memory_mib": {"idle_rss": idle, "peak_rss": peak, "peak_over_idle": peak - idle,
                       "rss_after_attack": {k: v - idle for k, v in after.items()},
                       "rss_timeline": rss_log[::4]},
        "duration_s": round(end - t0, 1),
    }


# --- held uploads: many large bodies that stall, with a mix of heavy requests at once ---------------
def strokes_body(target_bytes: int = 4_900_000) -> tuple[bytes, str]:
    """A multipart body whose ``strokes`` field is ~``target_bytes`` of valid JSON strokes."""
    stroke = "[[12.5,40.25],[13.75,41.5],[15.0,43.125],[16.25,44.0]]"
    n = max(1, target_bytes // (len(stroke) + 1))
    return encode_multipart({"strokes": "[" + ",".join([stroke] * n) + "]"})


def _held_upload(url: str, data: bytes, ctype: str, hold_s: float, log: list) -> None:
    """Send all of a body but its last 200 bytes, then wait for the answer (the server cuts the
    stalled body); log (status line, seconds)."""
    host, port = url.split("//")[1].split(":")
    t0 = time.monotonic()
    head = (f"POST /api/recognize HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    status = "no answer"
    try:
        with socket.create_connection((host, int(port)), timeout=hold_s + 30) as s:
            s.sendall(head + data[:-200])
            first = s.recv(64)
            status = first.split(b"\r\n", 1)[0].decode("latin-1", "replace")[9:12] or "closed"
    except OSError as exc:
        status = type(exc).__name__
    log.append((status, round(time.monotonic() - t0, 1)))


def mixed_requests() -> list[tuple[str, dict, dict]]:
    """The 16 heavy requests of the mix: noise images, a 16-bit 4000x4000 PNG, 100,000 stroke
    points, 4.99 M characters of ``{}``, a 20,000-character article (path, fields, files)."""
    import numpy as np  # heavy

    photos, _ = _inputs()
    rng = np.random.default_rng(0)
    points = json.dumps([[[float(x), float(y)] for x, y in rng.random((50, 2)) * 600] for _ in range(2_000)])
    article = ("word " * 4_000)[:20_000]
    big = large_png()
    mix = []
    for i in range(16):
        kind = i % 5
        if kind == 0:
            mix.append(("/api/recognize", {}, {"image": ("noise.png", noise_png(300, i), "image/png")}))
        elif kind == 1:
            mix.append(("/api/recognize", {}, {"image": ("large.png", big, "image/png")}))
        elif kind == 2:
            mix.append(("/api/recognize", {"strokes": points}, {}))
        elif kind == 3:
            mix.append(("/api/recognize", {"strokes": "{}" * 2_495_000}, {}))
        else:
            name, data, _ = photos[0]
            mix.append(("/api/caption", {"article": article}, {"image": (name, data, "image/jpeg")}))
    return mix


def held_uploads(url: str, pid: int, n_held: int = 64, held_bytes: int = 4_900_000, settle_s: float = 30.0,
                 hold_s: float = 15.0, mixed: bool = True) -> dict[str, Any]:
    """``n_held`` connections each send ~``held_bytes`` of strokes and stall before the last 200
    bytes, while the 16 requests of :func:`mixed_requests` run at once; -> the server's idle, peak
    and later resident memory (MiB) and every answer's status."""
    data, ctype = strokes_body(held_bytes)
    mix = mixed_requests() if mixed else []
    idle = _proc_status(pid)["VmRSS"]
    if not reset_peak(pid):
        raise RuntimeError(f"cannot reset the peak memory of process {pid} (/proc/{pid}/clear_refs)")
    rss_log: list = []
    rss_stop = threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=_sample_rss, args=(pid, rss_stop, rss_log, t0), daemon=True)
    sampler.start()
    held_log: list = []
    held = [threading.Thread(target=_held_upload, args=(url, data, ctype, hold_s, held_log), daemon=True)
            for _ in range(n_held)]
    for t in held:
        t.start()
    time.sleep(1.0)

    def one(req):
        path, fields, files = req
        t = time.perf_counter()
        status, body = post(url + path, fields=fields or None, files=files or None, timeout=180)
        return status, round(time.perf_counter() - t, 2), body.get("error")

    with ThreadPoolExecutor(max(1, len(mix))) as pool:
        answers = list(pool.map(one, mix))
    for t in held:
        t.join(hold_s + 40)
    peak = _proc_status(pid)["VmHWM"]
    end = time.monotonic()
    time.sleep(settle_s)
    rss_stop.set()
    sampler.join(2)
    later = _proc_status(pid)["VmRSS"]
    return {"held": {"connections": n_held, "body_bytes": len(data),
                     "answers": {a: [x[0] for x in held_log].count(a) for a in sorted({x[0] for x in held_log})},
                     "answered_after_s": _seconds([x[1] for x in held_log])},
            "mixed": {"requests": len(mix), "statuses": {s: [x[0] for x in answers].count(s)
                                                         for s in sorted({x[0] for x in answers})},
                      "errors": sorted({x[2] for x in answers if x[2]}),
                      "latency": _percentiles([x[1] for x in answers])},
            "memory_mib": {"idle_rss": idle, "peak_rss": peak, "peak_over_idle": peak - idle,
                           f"rss_over_idle_{settle_s:g}s_after": later - idle, "rss_timeline": rss_log[::8]},
            "duration_s": round(end - t0, 1)}


def run_held(model_args: list[str] | None = None, threads: int = 0, **kw) -> dict[str, Any]:
    """:func:`held_uploads` against a fresh ``tellkit serve`` after a warm-up."""
    photos, math = _inputs()
    model_args = list(model_args or _default_models())
    proc, url = _start_server(model_args, 8, threads, timeout=60.0)
    try:
        load_once(url, 4, 2, photos, math)  # warm-up (first-call allocations), not counted
        time.sleep(2.0)
        out = held_uploads(url, proc.pid, **kw)
    finally:
        _stop(proc)
    return {"server_args": model_args, **out}


def _seconds(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    return {"min": s[0], "median": s[len(s) // 2], "max": s[-1]}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# Bad requests mixed into the load: (endpoint, files, fields, the 4xx status expected).
BAD_REQUESTS = [
    ("/api/caption", {"image": ("notes.txt", b"not an image", "text/plain")}, {}, 415),
    ("/api/recognize", {"image": ("x.png", b"\x89PNG\r\n\x1a\n garbage", "image/png")}, {}, 400),
    ("/api/caption", None, {"article": "an article without its image"}, 422),
    ("/api/caption", "photo", {"article": "x" * 20_001}, 413),
]


def load_once(url: str, n_requests: int, concurrency: int, photos, math: bytes, timeout: float = 120.0,
              bad_every: int = 0) -> dict[str, Any]:
    """Send ``n_requests`` from ``concurrency`` client threads: alternating caption / math, and
    with ``bad_every=k`` every k-th request is a bad one (wrong type, garbage, missing image,
    over-long article) that must get its expected 4xx. An error is any good request that did not
    get 200 or any bad one that did not get its 4xx."""

    def one(i: int):
        t0 = time.perf_counter()
        if bad_every and i % bad_every == bad_every - 1:
            path, files, fields, want = BAD_REQUESTS[(i // bad_every) % len(BAD_REQUESTS)]
            if files == "photo":
                name, data, _ = photos[0]
                files = {"image": (name, data, "image/jpeg")}
            status, body = post(url + path, fields=fields, files=files, timeout=timeout)
            return "bad", status, time.perf_counter() - t0, (None if status == want else body)
        if i % 2 == 0:
            name, data, article = photos[(i // 2) % len(photos)]
            status, body = post(url + "/api/caption", fields={"article": article},
                                files={"image": (name, data, "image/jpeg")}, timeout=timeout)
            kind = "caption"
        else:
            status, body = post(url + "/api/recognize", files={"image": ("expr.png", math, "image/png")},
                                timeout=timeout)
            kind = "recognize"
        return kind, status, time.perf_counter() - t0, (None if status == 200 else body)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(one, range(n_requests)))
    wall = time.perf_counter() - t0
    errors = [{"kind": k, "status": s, "body": b} for k, s, _, b in rows if b is not None]
    out: dict[str, Any] = {"requests": n_requests, "concurrency": concurrency, "wall_s": round(wall, 2),
                           "throughput_rps": round(n_requests / wall, 2), "errors": len(errors),
                           "error_examples": errors[:3],
                           "latency": _percentiles([t for k, _, t, _ in rows if k != "bad"])}
    for kind in ("caption", "recognize"):
        ts = [t for k, s, t, _ in rows if k == kind and s == 200]
        out[kind] = {"ok": len(ts), **_percentiles(ts)}
    bad = [(s, b) for k, s, _, b in rows if k == "bad"]
    out["bad_requests"] = {"sent": len(bad), "answered_expected_4xx": sum(b is None for _, b in bad)}
    return out


def run_attack(model_args: list[str] | None = None, threads: int = 0, **kw) -> dict[str, Any]:
    """:func:`attack` against a fresh ``tellkit serve`` (batching on, the default 60 s request
    timeout), after a warm-up."""
    photos, math = _inputs()
    model_args = list(model_args or _default_models())
    proc, url = _start_server(model_args, 8, threads, timeout=60.0)
    try:
        load_once(url, 4, 2, photos, math)  # warm-up (first-call allocations), not counted
        time.sleep(2.0)
        out = attack(url, proc.pid, photos[0], math, **kw)
        out["workers"] = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())["workers"]
    finally:
        _stop(proc)
    return {"server_args": model_args, **out}


def run(quick: bool = False, device: str = "cpu", requests: int | None = None, concurrency: int = 8,
        model_args: list[str] | None = None, threads: int = 0) -> dict[str, Any]:
    n = requests or (16 if quick else 96)
    photos, math = _inputs()
    model_args = list(model_args or _default_models())
    if device != "cpu":
        model_args += ["--device", device]
    result: dict[str, Any] = {"server_args": model_args, "requests_per_run": n, "concurrency": concurrency,
                              "inputs": {"photos": [p[0] for p in photos], "recognize": "bttr_x2_plus_1.png"},
                              "runs": {}}
    for label, max_batch in (("batched", 8), ("unbatched", 1)):
        proc, url = _start_server(model_args, max_batch, threads)
        try:
            health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
            result["models"] = health["models"]
            idle = _proc_status(proc.pid)
            load_once(url, 4, 2, photos, math)  # warm-up (first-call allocations), not counted
            warm = _proc_status(proc.pid)
            stats = load_once(url, n, concurrency, photos, math, bad_every=8)
            after = _proc_status(proc.pid)
            workers = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())["workers"]
            if label == "batched":
                try:
                    result["large_uploads"] = large_upload_peak(url, proc.pid, n=16)
                except RuntimeError as exc:  # no /proc/PID/clear_refs (not Linux, or not allowed)
                    result["large_uploads"] = {"skipped": str(exc)}
        finally:
            _stop(proc)
        stats["memory_mib"] = {"rss_after_load_models": idle["VmRSS"], "rss_after_warmup": warm["VmRSS"],
                               "peak_rss": after["VmHWM"], "rss_after_run": after["VmRSS"]}
        stats["max_batch"] = max_batch
        stats["batches"] = {k: {"batches": w["batches"], "items": w["items"], "max_batch_seen": w["max_batch_seen"]}
                            for k, w in workers.items()}
        result["runs"][label] = stats
    result["total_errors"] = sum(r["errors"] for r in result["runs"].values())
    if not quick:
        result["attack"] = run_attack(model_args, threads)
        result["held_uploads"] = run_held(model_args, threads)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the server (default: torch's choice)")
    p.add_argument("--untrained", action="store_true", help="serve the tiny untrained models even if defaults exist")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--attack-only", action="store_true",
                   help="only the attack (noise images + slow uploads): writes serve_attack.json")
    p.add_argument("--noise-side", type=int, default=300, help="side of the noise images of the attack (default 300)")
    p.add_argument("--held-only", action="store_true",
                   help="only the held uploads (64 stalled 5 MB strokes bodies + 16 heavy requests): serve_held.json")
    a = p.parse_args(argv)
    if a.attack_only:
        return _main_attack(a)
    if a.held_only:
        return _main_held(a)
    res = run(requests=a.requests, concurrency=a.concurrency, threads=a.threads,
              model_args=["--untrained"] if a.untrained else None)
    record = {"suite": "serve_load", "machine": machine(),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "results": res}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "serve_load.json", record)
    for label, r in res["runs"].items():
        print(f"{label}: {r['throughput_rps']} req/s ({r['bad_requests']['sent']} bad), "
              f"p50 {r['latency'].get('p50_ms')} ms, p99 {r['latency'].get('p99_ms')} ms, "
              f"errors {r['errors']}, peak RSS {r['memory_mib']['peak_rss']} MiB")
    big = res.get("large_uploads")
    if big and "skipped" not in big:
        print(f"{big['uploads']} concurrent {big['upload_bytes']:,}-byte 16-bit 4000x4000 PNGs: "
              f"RSS {big['rss_before_mib']} -> peak {big['peak_rss_mib']} MiB, statuses {big['status_counts']}")
    print(f"wrote {out / 'serve_load.json'}")
    return 0 if res["total_errors"] == 0 else 1


def _main_attack(a) -> int:
    res = run_attack(["--untrained"] if a.untrained else None, a.threads, side=a.noise_side)
    record = {"suite": "serve_attack", "machine": machine(),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": res}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "serve_attack.json", record)
    print(attack_summary(res))
    print(f"wrote {out / 'serve_attack.json'}")
    return 0


def _main_held(a) -> int:
    res = run_held(["--untrained"] if a.untrained else None, a.threads)
    record = {"suite": "serve_held", "machine": machine(),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": res}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "serve_held.json", record)
    m = res["memory_mib"]
    print(f"held uploads: peak RSS {m['peak_rss']} MiB = idle {m['idle_rss']} + {m['peak_over_idle']} MiB; "
          f"{ {k: v for k, v in m.items() if k.startswith('rss_over_idle')} }; held answers {res['held']['answers']}; "
          f"mixed {res['mixed']['statuses']}")
    print(f"wrote {out / 'serve_held.json'}")
    return 0


def attack_summary(res: dict[str, Any]) -> str:
    m, n, s, q = res["memory_mib"], res["normal_requests"], res["slow_uploads"], res["noise_images"]
    return (f"attack: peak RSS {m['peak_rss']} MiB = idle {m['idle_rss']} + {m['peak_over_idle']} MiB, after "
            f"{m['rss_after_attack']} MiB over idle; noise answers {q['statuses']}; slow uploads cut after "
            f"{s['cut_after_s']} s ({s['answers']}); normal requests {n['statuses']}, p50 "
            f"{n['latency'].get('p50_ms')} ms, max {n['latency'].get('max_ms')} ms")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
