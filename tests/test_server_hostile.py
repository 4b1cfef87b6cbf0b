"""Hostile and faulty clients against a real server socket (127.0.0.1): over-limit bodies from
clients that send everything before reading, slow clients, malformed HTTP, non-UTF-8 article
bytes. Stub models answer at once, so every test takes well under a few seconds."""
import http.client
import io
import json
import select
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("python_multipart")

from tellkit.server.app import create_app  # noqa: E402
from tellkit.server.limits import Limits  # noqa: E402
from tellkit.server.runner import ServerThread, encode_multipart, post  # noqa: E402


class StubCaptioner:
    """Echoes the article and the image size; ``delay`` seconds per batch."""

    info = {"name": "stub-caption", "trained": False, "checkpoint": None}
    task, api_text = "caption", "caption"

    def __init__(self, delay=0.0):
        self.delay = delay

    def __call__(self, items):
        time.sleep(self.delay)
        return [{"text": f"{im.width}x{im.height}", "tokens": [], "score": 0.0, "image_size": [im.width, im.height],
                 "grid": {"rows": 1, "cols": 1, "box": [0, 0, im.width, im.height]}, "faces": [],
                 "article_text": text, "article_tokens": []} for im, text in items]


class StubRecognizer:
    info = {"name": "stub-math", "trained": False, "checkpoint": None}
    task, api_text = "recognize", "latex"

    def __call__(self, images):
        return [{"text": f"w {im.width}", "tokens": ["w", str(im.width)], "score": 0.0} for im in images]


def png(w=64, h=48) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 120, np.uint8)).save(b, "PNG")
    return b.getvalue()


def send_all_then_read(url: str, path: str, body, headers: dict, timeout: float = 20.0):
    """http.client: the whole body is written before the response is read (as urllib does)."""
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        if isinstance(body, (bytes, bytearray)):
            conn.request("POST", path, body=body, headers=headers)
        else:  # an iterable: sent chunked, without Content-Length
            conn.request("POST", path, body=body, headers=headers, encode_chunked=True)
        r = conn.getresponse()
        return r.status, r.getheader("content-type"), json.loads(r.read())
    finally:
        conn.close()


@pytest.fixture()
def server():
    app = create_app({"caption": StubCaptioner(), "recognize": StubRecognizer()},
                     Limits(max_upload_bytes=300_000, max_image_pixels=400_000, max_article_chars=2_000,
                            header_timeout_s=0.5, body_idle_timeout_s=0.5, body_timeout_s=1.5),
                     serve_page=False)
    with ServerThread(app) as srv:
        yield srv


# --- every limit answers its JSON error, to a client that sends the whole body first ----------------
def test_body_over_limit_by_content_length_is_413_json_not_a_reset(server):
    data, ctype = encode_multipart(files={"image": ("a.png", b"\x89PNG" + b"0" * 1_000_000, "image/png")})
    status, ctype_out, body = send_all_then_read(server.url, "/api/caption", data, {"Content-Type": ctype})
    assert (status, body["error"]) == (413, "request_too_large") and ctype_out == "application/json"
    # urllib (the standard library's client, and the load runner's) too
    s, b = post(server.url + "/api/caption", files={"image": ("a.png", b"0" * 1_000_000, "image/png")})
    assert (s, b["error"]) == (413, "request_too_large")


def test_body_over_limit_while_streaming_chunked_is_413_json(server):
    data, ctype = encode_multipart(files={"image": ("a.png", b"0" * 4_000_000, "image/png")})
    chunks = (data[i:i + 65536] for i in range(0, len(data), 65536))
    status, _, body = send_all_then_read(server.url, "/api/recognize", chunks, {"Content-Type": ctype})
    assert (status, body["error"]) == (413, "request_too_large")


def test_every_limit_answers_its_json_error(server):
    cases = [  # (path, fields, files, status, code)
        ("/api/caption", {"article": "x" * 2_001}, {"image": ("a.png", png(), "image/png")}, 413, "article_too_long"),
        ("/api/caption", {"article": "é" * 2_001}, {"image": ("a.png", png(), "image/png")}, 413, "article_too_long"),
        ("/api/caption", {"note": "x" * 2_001}, {"image": ("a.png", png(), "image/png")}, 413, "field_too_long"),
        ("/api/caption", None, {"image": ("a.png", png(1000, 1000), "image/png")}, 413, "image_too_large"),
        ("/api/recognize", None, {"image": ("a.png", png(4, 4), "image/png")}, 422, "image_too_small"),
        ("/api/recognize", None, {"image": ("a.txt", b"hello", "text/plain")}, 415, "unsupported_media_type"),
        ("/api/recognize", None, {"image": ("a.png", b"", "image/png")}, 400, "empty_file"),
    ]
    for path, fields, files, status, code in cases:
        data, ctype = encode_multipart(fields, files)
        s, _, body = send_all_then_read(server.url, path, data, {"Content-Type": ctype})
        assert (s, body["error"]) == (status, code), (path, body)
        assert body["detail"] and "\n" not in body["detail"]


def test_article_between_1_and_8_mib_is_413_article_too_long():
    """The form parser's own 1 MiB text-field cap used to answer 400 http_error."""
    app = create_app({"caption": StubCaptioner()}, Limits(), serve_page=False)  # default limits: 8 MiB body
    with ServerThread(app) as srv:
        for size in (1_200_000, 3_000_000):
            data, ctype = encode_multipart({"article": "a" * size}, {"image": ("a.png", png(), "image/png")})
            s, _, body = send_all_then_read(srv.url, "/api/caption", data, {"Content-Type": ctype})
            assert (s, body["error"]) == (413, "article_too_long"), body
            assert "20,000" in body["detail"]
        s, b = post(srv.url + "/api/caption", fields={"article": "word " * 3_999},
                    files={"image": ("a.png", png(), "image/png")})
        assert s == 200 and b["article_text"] == ("word " * 3_999).strip()


def test_busy_answers_503_json_to_a_client_that_sends_everything_first():
    app = create_app({"caption": StubCaptioner(delay=1.0)}, Limits(max_inflight=1), serve_page=False)
    with ServerThread(app) as srv:
        first = threading.Thread(target=post, args=(srv.url + "/api/caption",),
                                 kwargs={"files": {"image": ("a.png", png(), "image/png")}})
        first.start()
        time.sleep(0.3)
        data, ctype = encode_multipart(files={"image": ("a.png", png() + b"\0" * 2_000_000, "image/png")})
        s, _, body = send_all_then_read(srv.url, "/api/caption", data, {"Content-Type": ctype})
        first.join(10)
    assert (s, body["error"]) == (503, "busy")


# --- slow clients and malformed HTTP -----------------------------------------------------------------
def _raw(url: str, payload: bytes, wait_s: float = 5.0, drip: list[bytes] | None = None, gap: float = 0.0):
    """Send ``payload`` (then each of ``drip`` every ``gap`` s) and read until the server closes;
    -> (seconds until closed, what came back)."""
    host, port = url.split("//")[1].split(":")
    t0 = time.monotonic()
    out = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(payload)
        for piece in drip or []:
            time.sleep(gap)
            if select.select([s], [], [], 0)[0]:  # an answer (or the close) is there: writing on may reset it
                break
            try:
                s.sendall(piece)
            except OSError:
                break
        while time.monotonic() - t0 < wait_s:
            try:
                got = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not got:
                break
            out += got
    return time.monotonic() - t0, out


def _json_response(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"application/json" in head.lower(), head
    return status, json.loads(body)


def test_partial_headers_then_silence_get_408_and_are_closed(server):
    took, raw = _raw(server.url, b"POST /api/recognize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: mul")
    assert raw, f"no answer within {took:.1f} s"
    status, body = _json_response(raw)
    assert (status, body["error"]) == (408, "request_timeout") and took < 3.0


def test_headers_dripped_byte_by_byte_are_cut_off(server):
    """Each byte resets no timer: the whole header has a deadline (slowloris)."""
    took, raw = _raw(server.url, b"GET /health HTTP/1.1\r\n", drip=[b"X-A: b\r\n"] * 20, gap=0.1)
    assert raw and _json_response(raw)[0] == 408 and took < 3.5


def test_stalled_body_gets_408(server):
    head = b"POST /api/recognize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=xx\r\n"
    took, raw = _raw(server.url, head + b"Content-Length: 5000\r\n\r\n--xx\r\n")
    status, body = _json_response(raw)
    assert (status, body["error"]) == (408, "request_timeout") and "no request data" in body["detail"]
    assert took < 3.0


def test_dripped_body_hits_the_total_body_timeout(server):
    head = b"POST /api/recognize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=xx\r\n"
    part = b'--xx\r\nContent-Disposition: form-data; name="note"\r\n\r\n'
    took, raw = _raw(server.url, head + b"Content-Length: 5000\r\n\r\n" + part, drip=[b"a"] * 30, gap=0.1, wait_s=5.0)
    status, body = _json_response(raw)
    assert (status, body["error"]) == (408, "request_timeout") and "within 1.5 s" in body["detail"]
    assert took < 4.0


def test_malformed_http_answers_json(server):
    _, raw = _raw(server.url, b"THIS IS NOT HTTP\r\n\r\n")
    status, body = _json_response(raw)
    assert (status, body["error"]) == (400, "bad_request") and body["detail"]
    _, raw = _raw(server.url, b"POST /api/caption HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n")
    assert _json_response(raw)[0] == 400


def test_a_good_keep_alive_connection_still_works(server):
    host, port = server.url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    for _ in range(3):
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        time.sleep(0.3)
    conn.close()


# --- article encoding ----------------------------------------------------------------------------------
def _form_with_raw_article(article: bytes) -> tuple[bytes, str]:
    data, ctype = encode_multipart(files={"image": ("a.png", png(), "image/png")})
    boundary = ctype.split("boundary=")[1]
    part = (f'--{boundary}\r\nContent-Disposition: form-data; name="article"\r\n\r\n'.encode() + article + b"\r\n")
    return part + data, ctype


@pytest.mark.parametrize("raw", [b"caf\xe9 au lait", b"\xff\xfe", b"ends mid-character \xc3"])
def test_non_utf8_article_is_refused_with_400(server, raw):
    data, ctype = _form_with_raw_article(raw)
    s, _, body = send_all_then_read(server.url, "/api/caption", data, {"Content-Type": ctype})
    assert (s, body["error"]) == (400, "not_utf8"), body
    assert "'article'" in body["detail"] and "UTF-8" in body["detail"]


def test_utf8_article_is_read_exactly(server):
    text = "Café in Zürich — 東京 🙂"
    data, ctype = _form_with_raw_article(text.encode("utf-8"))
    s, _, body = send_all_then_read(server.url, "/api/caption", data, {"Content-Type": ctype})
    assert s == 200 and body["article_text"] == text


@pytest.mark.parametrize("argv, msg", [
    (["--max-decoding", "0"], "--max-decoding must be a whole number from 1 to 64, got 0"),
    (["--header-timeout", "0"], "--header-timeout must be a number of seconds above 0 and at most 3600"),
    (["--body-timeout", "-1"], "--body-timeout must be a number of seconds above 0"),
])
def test_cli_refuses_bad_limits_in_one_line(argv, msg, capsys):
    from tellkit.cli import main

    assert main(["serve", "--api-only", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_an_unexpected_failure_is_a_json_500(monkeypatch):
    from tellkit.server import app as app_module

    def broken(*a, **k):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(app_module, "decode_image", broken)
    with ServerThread(create_app({"recognize": StubRecognizer()}, serve_page=False)) as srv:
        s, b = post(srv.url + "/api/recognize", files={"image": ("a.png", png(), "image/png")})
    assert (s, b["error"]) == (500, "internal_error") and "RuntimeError" in b["detail"]


def test_expect_100_continue_over_the_limit_is_refused_before_the_body(server):
    head = (b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=xx\r\n"
            b"Content-Length: 50000000\r\nExpect: 100-continue\r\n\r\n")
    took, raw = _raw(server.url, head, wait_s=5.0)
    assert not raw.startswith(b"HTTP/1.1 100")
    status, body = _json_response(raw)
    assert (status, body["error"]) == (413, "request_too_large") and took < 2.0
