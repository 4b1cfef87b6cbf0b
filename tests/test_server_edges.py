"""Smaller HTTP cases answer JSON with the right status: no redirect built from the Host header
(``POST /api/caption/``), an inverted byte range is 416, a 5 MB urlencoded field is 413."""
import http.client
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")

sys.path.insert(0, str(Path(__file__).parent))
from tellkit.server.app import create_app  # noqa: E402
from tellkit.server.limits import Limits  # noqa: E402
from tellkit.server.runner import ServerThread  # noqa: E402
from test_server_hostile import StubCaptioner, StubRecognizer  # noqa: E402


@pytest.fixture(scope="module")
def server():
    app = create_app({"caption": StubCaptioner(), "recognize": StubRecognizer()}, Limits(), serve_page=True)
    with ServerThread(app) as srv:
        yield srv


def ask(srv, method, path, body=None, headers=None):
    host, port = srv.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_a_trailing_slash_is_never_redirected_to_the_host_header(server):
    for method in ("POST", "GET"):
        status, headers, body = ask(server, method, "/api/caption/", b"" if method == "POST" else None,
                                    {"Host": "evil.example"})
        assert status == 404 and "Location" not in headers and b'"not_found"' in body, (status, headers)


def test_an_inverted_byte_range_is_416_json(server):
    status, headers, body = ask(server, "GET", "/static/app.js", headers={"Range": "bytes=100-1"})
    assert status == 416 and headers["content-type"] == "application/json" and b"range_not_satisfiable" in body
    status, headers, body = ask(server, "GET", "/static/app.js", headers={"Range": "bytes=0-9"})
    assert status == 206 and len(body) == 10


def test_a_5_mb_urlencoded_field_is_413(server):
    status, headers, body = ask(server, "POST", "/api/caption", b"article=" + b"a" * 5_000_000,
                                {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 413 and b"field_too_long" in body, body[:200]


def test_bodies_held_across_connections_are_capped_with_503_retry_after():
    import json
    import socket
    import time

    from tellkit.server.runner import encode_multipart, post

    # a held body is never cut for room here (stalled_body_s): the newcomer waits, then gets 503
    app = create_app({"recognize": StubRecognizer()}, Limits(max_buffered_mb=1, body_idle_timeout_s=5,
                                                             stalled_body_s=30), serve_page=False)
    with ServerThread(app) as srv:
        host, port = srv.url.split("//")[1].split(":")
        data, ctype = encode_multipart({"strokes": "x" * 700_000})
        head = (f"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        held = socket.create_connection((host, int(port)))
        held.sendall(head + data[:-200])  # 700 kB held, the last bytes never sent
        time.sleep(0.5)
        health = json.loads(ask(srv, "GET", "/health")[2])
        assert health["buffered_bytes"] >= 600_000, health
        status, headers, body = ask(srv, "POST", "/api/recognize", data, {"Content-Type": ctype})
        assert status == 503 and b'"busy"' in body and int(headers["retry-after"]) >= 1, (status, body[:200])
        held.close()
        time.sleep(0.5)
        assert json.loads(ask(srv, "GET", "/health")[2])["buffered_bytes"] == 0
        s, b = post(srv.url + "/api/recognize", files={"image": ("a.png", _png(), "image/png")})
        assert s == 200, b



def test_a_full_body_buffer_cuts_the_stalled_bodies_for_one_that_arrives():
    """Bodies that stall hold the buffer no longer than ``stalled_body_s`` once it is full: an
    upload arriving then waits, the longest silent body is cut with 408, and the upload is read
    and answered (it took a 503 for as long as the stalled bodies were let be)."""
    import json
    import socket
    import time

    from tellkit.server.runner import encode_multipart

    app = create_app({"recognize": StubRecognizer()}, Limits(max_buffered_mb=1, body_idle_timeout_s=10,
                                                             stalled_body_s=1), serve_page=False)
    with ServerThread(app) as srv:
        host, port = srv.url.split("//")[1].split(":")
        data, ctype = encode_multipart({"strokes": "x" * 700_000})
        head = (f"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        held = socket.create_connection((host, int(port)), timeout=20)
        held.sendall(head + data[:-200])  # 700 kB held, the last bytes never sent
        time.sleep(0.3)
        t0 = time.monotonic()
        status, _, body = ask(srv, "POST", "/api/recognize", data, {"Content-Type": ctype})
        took = time.monotonic() - t0
        assert status == 422 and b"bad_input" in body and took < 3, (status, body[:200], took)  # read, parsed
        cut = b""
        while b"}" not in cut:  # the 408's headers and JSON body, maybe in two segments
            part = held.recv(4096)
            if not part:
                break
            cut += part
        assert cut.startswith(b"HTTP/1.1 408") and b"stalled" in cut and b"request_timeout" in cut, cut[:300]
        held.close()
        time.sleep(0.3)
        assert json.loads(ask(srv, "GET", "/health")[2])["buffered_bytes"] == 0

def _png():
    import io

    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (64, 48), (120, 120, 120)).save(b, "PNG")
    return b.getvalue()


def test_a_request_still_running_at_shutdown_gets_json():
    import threading
    import time

    import uvicorn

    from tellkit.server.runner import free_port, post, uvicorn_config

    class Slow(StubRecognizer):
        def __call__(self, images):
            time.sleep(4.0)
            return super().__call__(images)

    app = create_app({"recognize": Slow()}, Limits(), serve_page=False)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=0.5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    out = {}
    client = threading.Thread(target=lambda: out.update(r=post(f"http://127.0.0.1:{port}/api/recognize",
                                                             files={"image": ("a.png", _png(), "image/png")},
                                                             timeout=30)))
    client.start()
    time.sleep(1.0)  # the request is with the model
    server.should_exit = True
    client.join(30)
    thread.join(30)
    status, body = out["r"]
    assert (status, body.get("error")) == (503, "shutting_down"), (status, body)


def test_a_client_mid_headers_at_shutdown_gets_json():
    import socket
    import threading
    import time

    import uvicorn

    from tellkit.server.runner import free_port, uvicorn_config

    app = create_app({"recognize": StubRecognizer()}, Limits(), serve_page=False)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=0.5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /api/recognize HTTP/1.1\r\nHost: x\r\nContent-Ty")  # headers not complete
        time.sleep(0.3)
        server.should_exit = True
        answer = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    thread.join(30)
    assert answer.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in answer, answer
