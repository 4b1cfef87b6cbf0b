"""Peak memory of the server while it decodes concurrent large uploads, measured on a real server
process (its own VmHWM, reset before the uploads), with stub models so only the HTTP side and the
image decoder are measured. A 16-bit 4000x4000 PNG (~40 KB) used to cost ~300 MB per request."""
import os
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")

from tellkit.bench.serve_load import large_png, large_upload_peak, reset_peak  # noqa: E402
from tellkit.server.runner import free_port  # noqa: E402

SERVER = r"""
import sys
from tellkit.server.app import create_app
from tellkit.server.limits import Limits
from tellkit.server.runner import serve


class Caption:
    info = {"name": "stub-caption", "trained": False, "checkpoint": None}

    def caption(self, items):
        return [{"caption": "x", "tokens": [], "score": 0.0, "image_size": list(im.size),
                 "grid": {"rows": 1, "cols": 1, "box": [0, 0, *im.size]}, "faces": [], "article_text": t,
                 "article_tokens": []} for im, t in items]


class Math:
    info = {"name": "stub-math", "trained": False, "checkpoint": None}

    def recognize(self, images):
        return [{"latex": "x", "tokens": ["x"], "score": 0.0} for _ in images]


serve(create_app(Caption(), Math(), Limits(), serve_page=False), "127.0.0.1", int(sys.argv[1]), log_level="warning")
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
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"stub server exited: {proc.stderr.read()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if not reset_peak(proc.pid):
            pytest.skip("this kernel does not allow resetting a process's peak memory (/proc/PID/clear_refs)")
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_concurrent_large_uploads_keep_peak_memory_bounded(stub_server):
    url, pid = stub_server
    data = large_png()
    assert len(data) < 100_000  # a small file ...
    res = large_upload_peak(url, pid, n=UPLOADS, path="/api/caption", data=data)  # ... of 16 M pixels each
    assert res["statuses"] == [200], res
    assert res["peak_growth_mib"] < MAX_GROWTH_MIB, res
