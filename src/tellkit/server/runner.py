"""Run the app with uvicorn, bound to loopback by default: ``serve`` (``tellkit serve``) and
:class:`ServerThread` (tests, load benchmark) use the same HTTP protocol settings.

    with ServerThread(app) as srv:
        urllib.request.urlopen(srv.url + "/health")

The HTTP/1.1 protocol is uvicorn's h11 implementation with two changes (:func:`protocol_class`):
a request whose line and headers are not complete within ``header_timeout_s`` of the connection
opening (or of the previous response on a kept-alive connection) is answered 408 and closed
(a client that drips bytes is not kept forever), a malformed request is answered with the
API's JSON error body instead of plain text, and at shutdown a client whose headers have partly
arrived gets a JSON 503 instead of a closed connection. Body timeouts are enforced by the app's guard.
"""
from __future__ import annotations

import errno
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid

from tellkit.errors import TellkitError
from tellkit.server.limits import Limits

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _raw_json_response(status: int, reason: str, code: str, detail: str) -> bytes:
    body = json.dumps({"error": code, "detail": detail}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


_SHUTTING_DOWN = _raw_json_response(503, "Service Unavailable", "shutting_down",
                                    "the server is shutting down; retry after it restarts")


def protocol_class(header_timeout_s: float):
    """uvicorn's h11 protocol with a header timeout and JSON protocol errors."""
    import h11  # optional
    from uvicorn.protocols.http.h11_impl import H11Protocol  # optional

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc):
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_header_timer()  # a kept-alive connection: the next request's headers

        def send_400_response(self, msg: str) -> None:
            self._cancel_header_timer()
            detail = msg.rstrip(".") + " (malformed HTTP/1.1 request line, headers or body framing)"
            self.transport.write(_raw_json_response(400, "Bad Request", "bad_request", detail))
            self.transport.close()

        def shutdown(self) -> None:  # a client mid-headers gets JSON, not a closed connection
            if self.cycle is None and self.conn.trailing_data[0] and not self.transport.is_closing():
                self._cancel_header_timer()
                self.transport.write(_SHUTTING_DOWN)
                self.transport.close()
                return
            super().shutdown()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.trailing_data[0]:  # part of a request arrived, not all of its headers
                self.transport.write(_raw_json_response(
                    408, "Request Timeout", "request_timeout",
                    f"the request headers did not arrive within {header_timeout_s:g} s"))
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, limits=None, **kwargs):
    """A ``uvicorn.Config`` for ``app`` with tellkit's protocol (header timeout from ``limits``,
    else the app's ``state.limits``, else the defaults)."""
    import uvicorn  # optional

    limits = limits or getattr(getattr(app, "state", None), "limits", None) or Limits()
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits.header_timeout_s), **kwargs)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a port in use or an address this machine does not
    have is a one-line TellkitError (uvicorn would log a traceback-like block and exit)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise TellkitError(f"--host {host}: cannot be resolved ({exc.strerror or exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise TellkitError(f"port {port} on {host} is already in use; stop what holds it or pass "
                               "--port N") from None
        raise TellkitError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve(app, host: str, port: int, limits=None, log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Run until interrupted (``tellkit serve``) on ``sock`` (from :func:`bind`; bound here when None)."""
    import uvicorn  # optional

    sock = sock or bind(host, port)
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level=log_level,
                                  timeout_graceful_shutdown=5)).run(sockets=[sock])


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0):
        import uvicorn  # optional

        if host not in LOOPBACK:
            raise ValueError("ServerThread binds loopback only")
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, name="tellkit-test-server", daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> ServerThread:
        self._thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            if time.monotonic() - t0 > self.start_timeout:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def encode_multipart(fields: dict[str, str] | None = None,
                     files: dict[str, tuple[str, bytes, str]] | None = None) -> tuple[bytes, str]:
    """-> (body, content type) of a multipart/form-data request (standard library only)."""
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in (fields or {}).items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                     + value.encode() + b"\r\n")
    for name, (filename, data, ctype) in (files or {}).items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: {ctype}\r\n\r\n".encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def post(url: str, fields=None, files=None, timeout: float = 60.0) -> tuple[int, dict]:
    """POST a multipart form -> (status, parsed JSON body); never raises for HTTP error statuses."""
    body, ctype = encode_multipart(fields, files)
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": "not_json", "detail": raw[:200].decode(errors="replace")}
