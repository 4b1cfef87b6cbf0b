"""Run the app with uvicorn on a background thread, bound to loopback (tests, load benchmark).

    with ServerThread(app) as srv:
        urllib.request.urlopen(srv.url + "/health")
"""
from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0):
        import uvicorn

        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("ServerThread binds loopback only")
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{self.host}:{self.port}"
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="tellkit-test-server", daemon=True)
        self.start_timeout = start_timeout

    def __enter__(self) -> "ServerThread":
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
    import uuid

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
    import json
    import urllib.error
    import urllib.request

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
