"""Peak memory of the server while it decodes concurrent large uploads, measured on a real server
process (its own VmHWM, reset before the uploads), with stub models so only the HTTP side and the
image decoder are measured. A 16-bit 4000x4000 PNG (~40 KB) used to cost ~300 MB per request."""
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")

from tellkit.bench.serve_load import large_png, large_upload_peak, reset_peak  # noqa: E402
from tellkit.server.runner import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import stop, wait_for_health  # noqa: E402

SERVER = r"""
import sys
from tellkit.server.app import create_app
from tellkit.server.limits import Limits
from tellkit.server.runner import serve


class Caption:
    info = {"name": "stub-caption", "trained": False, "checkpoint": None}
    task, api_text = "caption", "caption"

    def __call__(self, items):
        return [{"text": "x", "tokens": [], "score": 0.0, "image_size": list(im.size),
                 "grid": {"rows": 1, "cols": 1, "box": [0, 0, *im.size]}, "faces": [], "article_text": t,
                 "article_tokens": []} for im, t in items]


class Math:
    info = {"name": "stub-math", "trained": False, "checkpoint": None}
    task, api_text = "recognize", "latex"

    def __call__(self, images):
        return [{"text": "x", "tokens": ["x"], "score": 0.0} for _ in images]


app = create_app({"caption": Caption(), "recognize": Math()}, Limits(), serve_page=False)
serve(app, "127.0.0.1", int(sys.argv[1]), log_level="warning")
"""

UPLOADS = 8
# Bound: max_decoding (2) decodes of ~72 MiB each (a 32 MB 16-bit bitmap, strips, the shrunk
# copy) plus UPLOADS shrunk images (1600x1600, 4 bytes a pixel in PIL) on their way to the model.
# Measured 166 MiB above idle; the decoder before utils.images took 2,508 MiB for the same.
MAX_GROWTH_MIB = 350


@pytest.fixture(scope="module")
def stub_server():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux /proc to read the server's peak memory")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 60)
        if not reset_peak(proc.pid):
            pytest.skip("this kernel does not allow resetting a process's peak memory (/proc/PID/clear_refs)")
        yield url, proc.pid
    finally:
        stop(proc)


def test_concurrent_large_uploads_keep_peak_memory_bounded(stub_server):
    url, pid = stub_server
    data = large_png()
    assert len(data) < 100_000  # a small file ...
    res = large_upload_peak(url, pid, n=UPLOADS, path="/api/caption", data=data)  # ... of 16 M pixels each
    assert res["statuses"] == [200], res
    assert res["peak_growth_mib"] < MAX_GROWTH_MIB, res


# --- 16 concurrent requests of every kind, on `tellkit serve` with a hostile checkpoint ------------
# The checkpoint stores the widest, longest search the recipe caps allow (beam 256, 1,024 tokens);
# the server lowers it to its serving caps (--max-beam-size 16, --max-gen-len 256) and sizes its
# batches by beam x images (max_search_rows), so its peak stays bounded whatever the checkpoint says.
MIXED_GROWTH_MIB = 512


def _mixed_requests():
    import json

    from tellkit.pipelines.recognition import SAMPLE_PATH
    from tellkit.server.runner import encode_multipart

    ink = SAMPLE_PATH.read_bytes()
    strokes = json.dumps([[[x, (x * 7) % 40] for x in range(0, 200, 5)], [[10, 0], [10, 60]]])
    kinds = [
        ("/api/recognize", None, {"image": ("x.png", ink, "image/png")}),
        ("/api/recognize", {"strokes": strokes}, None),
        ("/api/recognize", None, {"image": ("big.png", large_png(), "image/png")}),
        ("/api/recognize", {"strokes": "[" * 1500 + "]" * 1500}, None),
        ("/api/recognize", {"strokes": "[[[1e308, 1], [-1e308, 2]]]"}, None),
        ("/api/caption", None, {"image": ("x.png", ink, "image/png")}),
        ("/api/caption", {"article": "x" * 30_000}, {"image": ("x.png", ink, "image/png")}),
        ("/api/recognize", None, {"image": ("x.txt", b"not an image", "text/plain")}),
    ]
    return [(path, *encode_multipart(fields, files)) for path, fields, files in kinds * 2]


def test_sixteen_mixed_requests_on_a_hostile_checkpoint_stay_within_512_mib(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tellkit.recipes import MAX_BEAM_SIZE, MAX_GENERATION_LEN
    from tellkit.registry import create_model

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux /proc to read the server's peak memory")
    ckpt = create_model("bttr/tiny").save_pretrained(
        tmp_path / "wide", extra={"data": {"layout": "inkml"},
                                  "eval": {"beam_size": MAX_BEAM_SIZE, "max_len": MAX_GENERATION_LEN}})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tellkit", "serve", "--api-only", "--port", str(port),
                             "--checkpoint", f"math={ckpt}", "--untrained", "--threads", "2",
                             "--timeout", "300", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        health = wait_for_health(proc, url, 180, pause=0.3)
        assert health["models"]["recognize"]["served_with"]["beam_size"] == 16
        requests = _mixed_requests()
        if not reset_peak(proc.pid):
            pytest.skip("this kernel does not allow resetting a process's peak memory (/proc/PID/clear_refs)")
        idle = _status_mib(proc.pid)["VmRSS"]

        def send(req):
            path, body, ctype = req
            r = urllib.request.Request(url + path, data=body, method="POST", headers={"Content-Type": ctype})
            try:
                with urllib.request.urlopen(r, timeout=600) as resp:
                    return resp.status
            except urllib.error.HTTPError as e:
                return e.code

        with ThreadPoolExecutor(len(requests)) as pool:
            statuses = list(pool.map(send, requests))
        peak = _status_mib(proc.pid)["VmHWM"]
    finally:
        stop(proc)
    print(f"server idle {idle} MiB, peak {peak} MiB under {len(requests)} concurrent requests")
    assert sorted(set(statuses)) == [200, 413, 415, 422], statuses
    assert peak - idle < MIXED_GROWTH_MIB, (idle, peak)


def _status_mib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) // 1024
    return out


def test_the_load_benchmark_counts_a_reset_connection_instead_of_crashing():
    import socket
    import threading

    from tellkit.bench.serve_load import post

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def reset_each():
        for _ in range(2):
            conn, _ = srv.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # linger 0: the client sees a reset, not a reply

    t = threading.Thread(target=reset_each, daemon=True)
    t.start()
    try:
        for _ in range(2):
            status, body = post(f"http://127.0.0.1:{port}/api/recognize", fields={"strokes": "[]" * 100_000}, timeout=5)
            assert status == 0 and body["error"] in ("ConnectionResetError", "RemoteDisconnected", "BrokenPipeError")
    finally:
        t.join(5)
        srv.close()


def test_an_answered_exception_lets_go_of_what_its_frames_held():
    """A form parser refused midway keeps its buffer in a frame of the exception's traceback, in a
    reference cycle (the raising frame's local names the exception): cleared, the buffer is freed
    at once, with no garbage collection."""
    import gc
    import weakref

    from tellkit.server.app import drop_frames

    class Buffer:
        pass

    def parse(buf):
        raise ValueError("the body was cut")

    def handle():
        buf = Buffer()
        try:
            parse(buf)
        except ValueError as e:
            err = RuntimeError("there was an error parsing the body")
            try:
                raise err from e
            except RuntimeError as caught:
                return caught, weakref.ref(buf)

    gc.disable()
    try:
        kept, kept_ref = handle()
        del kept
        assert kept_ref() is not None  # the cycle keeps it (this test's premise)
        exc, ref = handle()
        drop_frames(exc)
        del exc
        assert ref() is None
    finally:
        gc.enable()
        gc.collect()
