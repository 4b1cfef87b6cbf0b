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
