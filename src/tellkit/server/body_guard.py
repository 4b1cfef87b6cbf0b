"""The ASGI guard in front of the app: request bodies are bounded while they arrive.

:class:`RequestGuard` refuses what the headers alone refuse (505, bad framing, oversize
Content-Length, a bad Range), then reads the body through :class:`_Body`, which enforces the
idle and total body timeouts and the minimum rate (408), the byte limit (413), the text fields'
UTF-8 and character limits (:class:`_FormScanner`: 400 / 413) and the cap on bytes buffered by
all connections together (503 with Retry-After). An API request is admitted to the models only
once its whole body is in (:class:`_Slot`: at most ``max_inflight``, 503 beyond). After the last
large body of a burst has gone, and once the API has been quiet for a second after any request
(:class:`IdleRelease`), freed memory is returned to the system. At shutdown a request not yet
answered gets a JSON 503. Every refusal is ``{"error": code, "detail": message}``.
"""
from __future__ import annotations

import asyncio
import codecs
import gc
import json
import time

from tellkit.server.limits import Limits, RequestError, check_framing, check_range, multipart_boundary
from tellkit.utils.memory import release_memory

ROOM_WAIT_S = 2.0  # seconds a chunk waits for room in a full body buffer before its request gets 503


class _Refused(Exception):
    """Raised into the app when the request body is refused (the guard answers instead)."""


class _FormScanner:
    """Streams a multipart/form-data body beside the app's own parser, keeping no data: every
    text field (a part without a filename) must be UTF-8 and at most ``max_chars`` characters
    (``field_chars``: another limit for the fields it names, e.g. the strokes of a drawing).
    A broken body is left to the app's parser to report."""

    def __init__(self, boundary: bytes, max_chars: int, field_chars: dict[str, int] | None = None):
        from python_multipart.multipart import MultipartParser  # optional

        self.max_chars, self.field_chars, self.error, self.broken = max_chars, field_chars or {}, None, False
        self._reset()
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._reset, "on_header_field": self._header_field, "on_header_value": self._header_value,
            "on_header_end": self._header_end, "on_headers_finished": self._headers_finished,
            "on_part_data": self._data, "on_part_end": self._end})

    def feed(self, chunk: bytes) -> RequestError | None:
        if chunk and not self.broken and self.error is None:
            try:
                self.parser.write(chunk)
            except _Refused:
                pass
            except Exception:  # noqa: BLE001 - malformed multipart: the form parser answers 400
                self.broken = True
        return self.error

    # -- parser callbacks
    def _reset(self):
        self.field, self.value, self.disposition, self.name = b"", b"", b"", None
        self.decoder, self.bytes, self.chars = None, 0, 0

    def _header_field(self, data, start, end):
        self.field += data[start:end]

    def _header_value(self, data, start, end):
        self.value += data[start:end]

    def _header_end(self):
        if self.field.lower() == b"content-disposition":
            self.disposition = self.value
        self.field, self.value = b"", b""

    def _headers_finished(self):
        from python_multipart.multipart import parse_options_header  # optional

        _, options = parse_options_header(self.disposition)
        self.name = options.get(b"name", b"").decode("utf-8", "replace")
        if b"filename" not in options:  # a text field
            self.decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def _data(self, data, start, end):
        if self.decoder is not None:
            self._decode(data[start:end], final=False)

    def _end(self):
        if self.decoder is not None:
            self._decode(b"", final=True)

    def _decode(self, raw: bytes, final: bool):
        try:
            self.chars += len(self.decoder.decode(raw, final))
        except UnicodeDecodeError as exc:
            at = self.bytes + exc.start
            byte = exc.object[exc.start]
            self._fail(400, "not_utf8", f"the '{self.name}' field is not valid UTF-8 (byte 0x{byte:02x} near offset "
                       f"{at:,}); send the text encoded as UTF-8")
        self.bytes += len(raw)
        limit = self.field_chars.get(self.name, self.max_chars)
        if self.chars > limit:
            code = "article_too_long" if self.name == "article" else "field_too_long"
            self._fail(413, code, f"the '{self.name}' field has more than {limit:,} characters, over the limit")

    def _fail(self, status, code, message):
        self.error = RequestError(status, code, message)
        raise _Refused()


class _Body:
    """The request body as the app reads it, with the guard's bounds: the idle and total body
    timeouts, the minimum transfer rate, the byte limit and the text-field checks. ``refusal`` is
    set when one is hit. ``admit`` is called once, when the last byte of the body has arrived
    (a RequestError it returns refuses the request then)."""

    def __init__(self, receive, limits: Limits, content_type: bytes | None, admit=None, held: dict | None = None):
        self._receive, self.limits, self.admit = receive, limits, admit
        self.held = held if held is not None else {"buffered": 0}  # bytes of bodies held, all connections
        self.seen, self.done, self.t0, self.last = 0, False, None, time.monotonic()
        self.waiter: asyncio.Future | None = None  # the pending receive, while waiting for data
        self.evicted = False  # cut to make room in a full body buffer (see _room)
        self.refusal: RequestError | None = None
        self.discard_rest = False
        self.scanner = None
        if content_type and content_type.split(b";")[0].strip().lower() == b"multipart/form-data":
            boundary = multipart_boundary(content_type)
            if boundary:
                self.scanner = _FormScanner(boundary, limits.max_article_chars, {"strokes": limits.max_stroke_chars})

    async def _next(self):
        """The next message, within the whole-body timeout, the idle timeout and the minimum rate
        (after ``body_grace_s`` the body must have arrived at ``min_body_rate`` on average)."""
        lim, now = self.limits, time.monotonic()
        if self.t0 is None:
            self.t0 = now
        total = self.t0 + lim.body_timeout_s
        rate = self.t0 + lim.body_grace_s + self.seen / lim.min_body_rate
        end = min(total, rate, now + lim.body_idle_timeout_s)
        if end > now:
            self.waiter = fut = asyncio.ensure_future(self._receive())
            try:
                await asyncio.wait({fut}, timeout=end - now)
            finally:
                self.waiter = None
                if not fut.done():
                    fut.cancel()
            if fut.done() and not fut.cancelled():
                return fut.result()
        if self.evicted:
            raise TimeoutError(f"the request body stalled for {time.monotonic() - self.last:.1f} s while the "
                               f"server's {lim.max_buffered_mb} MiB of request bodies were full")
        if end >= total:
            raise TimeoutError(f"the request body did not arrive within {lim.body_timeout_s:g} s")
        if end >= rate:
            raise TimeoutError(f"the request body arrived at under {lim.min_body_rate:,} bytes/s ({self.seen:,} "
                               f"bytes in {time.monotonic() - self.t0:.0f} s)")
        raise TimeoutError(f"no request data for {lim.body_idle_timeout_s:g} s")

    async def _room(self, n: int) -> bool:
        """Wait (at most ``ROOM_WAIT_S``) until ``n`` more bytes fit under ``max_buffered_mb``,
        cutting (408) the bodies that have been silent for ``stalled_body_s`` (5 s) or longer, the
        longest silent first, as far as needed: a full buffer goes to the uploads that are
        arriving, not to the ones that stall. -> whether they fit."""
        cap, until = self.limits.max_buffered_bytes, time.monotonic() + ROOM_WAIT_S
        while True:
            bodies = self.held.get("bodies", ())
            leaving = sum(b.seen for b in bodies if b.evicted)  # cut, their bytes not yet given back
            if self.held["buffered"] + n <= cap:
                return True
            now = time.monotonic()
            if now >= until:
                return False
            over = self.held["buffered"] - leaving + n - cap
            silent = [b for b in bodies if b is not self and b.waiter is not None and not b.evicted and b.seen
                      and now - b.last >= self.limits.stalled_body_s]
            for body in sorted(silent, key=lambda b: b.last):
                if over <= 0:
                    break
                body.evict()
                over -= body.seen
            await asyncio.sleep(0.02)

    def evict(self) -> None:
        self.evicted = True
        if self.waiter is not None:
            self.waiter.cancel()

    def refuse(self, err: RequestError, discard_rest: bool):
        self.refusal, self.discard_rest = err, discard_rest
        raise _Refused()

    async def receive(self):
        if self.refusal is not None:
            raise _Refused()
        if self.done:  # after the body (waiting for a disconnect): no timeout
            return await self._receive()
        try:
            msg = await self._next()
        except TimeoutError as exc:
            # a body cut for room may yet resume: what it sends is read and dropped (it holds no
            # buffer then) so that the client reads the 408 instead of a reset connection
            self.refuse(RequestError(408, "request_timeout", str(exc)), discard_rest=self.evicted)
        if msg["type"] != "http.request":
            self.done = True
            return msg
        chunk = msg.get("body", b"")
        self.last = time.monotonic()
        if self.held["buffered"] + len(chunk) > self.limits.max_buffered_bytes and not await self._room(len(chunk)):
            self.refuse(RequestError(503, "busy", f"the server holds {self.limits.max_buffered_mb} MiB of request "
                                     "bodies; retry shortly", retry_after=5), discard_rest=True)
        self.seen += len(chunk)
        self.held["buffered"] += len(chunk)  # given back by release() when the request ends
        self.held.setdefault("bodies", set()).add(self)  # the bodies holding bytes (release() takes it out)
        self.done = not msg.get("more_body", False)
        if self.seen > self.limits.max_upload_bytes:
            self.refuse(_too_large(self.limits), discard_rest=True)
        if self.scanner is not None:
            err = self.scanner.feed(chunk)
            if err is not None:
                self.refuse(err, discard_rest=True)
        if self.done and self.admit is not None:  # the whole body is in: only now does it take a place
            err, self.admit = self.admit(), None
            if err is not None:
                self.refuse(err, discard_rest=False)
        return msg

    def release(self) -> int:
        """The request has ended: its body no longer counts against ``max_buffered_mb``; -> its bytes."""
        self.held["buffered"] -= self.seen
        self.held.get("bodies", set()).discard(self)
        seen, self.seen = self.seen, 0
        return seen

    async def discard(self) -> None:
        """Read and drop the rest of the body (at most ``max_discard_bytes``, within the body
        timeouts) so that a client that sends its whole body before reading gets the answer
        instead of a connection reset."""
        dropped = 0
        while not self.done and dropped <= self.limits.max_discard_bytes:
            try:
                msg = await self._next()
            except TimeoutError:
                return
            if msg["type"] != "http.request":
                return
            dropped += len(msg.get("body", b""))
            self.done = not msg.get("more_body", False)


async def _send_error(send, err: RequestError):
    body = json.dumps({"error": err.code, "detail": err.message}).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *extra]})
    await send({"type": "http.response.body", "body": body})


_LARGE_BODY = 1 << 20  # bytes of a body after which its end may leave freed pages worth returning


def _too_large(limits: Limits) -> RequestError:
    return RequestError(413, "request_too_large", f"request body over the limit of {limits.max_upload_bytes:,} bytes")


def _collect_and_release() -> None:
    gc.collect()  # refused requests' exceptions keep their frames (and inputs) in reference cycles
    release_memory()


class IdleRelease:
    """Gives the allocator's free pages back to the system once no API request has been arriving
    or running for ``quiet_s`` seconds. A request refused after decoding a large image, or one
    answered without a model batch, leaves its freed pages in the allocator's heaps, and a refusal's
    exception keeps its frames in a reference cycle; nothing else would return either after the
    burst. The collection and the trim run on a thread, at most once per quiet period."""

    def __init__(self, counters: dict, quiet_s: float = 1.0):
        self.counters, self.quiet_s = counters, quiet_s
        self._task: asyncio.Task | None = None
        self._last = 0.0

    def poke(self) -> None:
        """An API request has ended: start (or extend) the wait for a quiet period."""
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._wait())

    def _quiet(self) -> bool:
        return self.counters["inflight"] == 0 and self.counters["receiving"] == 0

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, self._last + self.quiet_s - loop.time()))
            if self._quiet() and loop.time() - self._last >= self.quiet_s:
                await asyncio.to_thread(_collect_and_release)
                return

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class _Slot:
    """One API request's places in the server: among the bodies still arriving (at most
    ``max_receiving``, counted from the headers), then, once the whole body is in, among the
    requests admitted to decoding and the models (at most ``max_inflight``). A slow upload thus
    holds a connection, never a place of the requests that are ready."""

    def __init__(self, counters: dict, limits: Limits):
        self.counters, self.limits, self.state = counters, limits, "receiving"
        counters["receiving"] += 1  # the event loop is single-threaded: no lock needed

    def admit(self) -> RequestError | None:
        self.counters["receiving"] -= 1
        self.state = "refused"
        if self.counters["inflight"] >= self.limits.max_inflight:
            return RequestError(503, "busy", f"the server is handling {self.limits.max_inflight} requests; "
                                "retry shortly", retry_after=2)
        self.counters["inflight"] += 1
        self.state = "admitted"
        return None

    def leave(self) -> None:
        if self.state == "receiving":
            self.counters["receiving"] -= 1
        elif self.state == "admitted":
            self.counters["inflight"] -= 1
        self.state = "left"


class RequestGuard:
    """ASGI middleware in front of the app. Every request: HTTP/1.0 or 1.1 only (505); a body over
    ``max_upload_bytes`` is refused with 413 (from Content-Length when given, else counted while
    streaming); a body that stalls (``body_idle_timeout_s``), drags (``body_timeout_s``) or
    arrives under ``min_body_rate`` gets 408; text fields of a form must be UTF-8 (400) and within
    their character limits (413). POST /api/* requests are admitted once their body is in, at
    most ``max_inflight`` at once (:class:`_Slot`; 503 with Retry-After beyond). The rest of a
    refused body is read and dropped (bounded) before the JSON answer, so every client can read it."""

    def __init__(self, app, limits: Limits, counters: dict, idle: IdleRelease | None = None):
        self.app, self.limits, self.counters, self.idle = app, limits, counters, idle
        counters.setdefault("receiving", 0)
        counters.setdefault("buffered", 0)

    def _refusal(self, scope, headers: dict, api: bool) -> RequestError | None:
        version = str(scope.get("http_version", "1.1"))
        if version not in ("1.0", "1.1"):
            return RequestError(505, "http_version_not_supported", f"HTTP/{version[:8]} is not served; use HTTP/1.1")
        refusal = check_framing(headers, self.limits) or check_range(scope, headers)
        if refusal is None and api and self.counters["receiving"] >= self.limits.max_receiving:
            refusal = RequestError(503, "busy", f"{self.limits.max_receiving} uploads are arriving; retry shortly",
                                   retry_after=5)
        return refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        api = scope.get("method") == "POST" and scope.get("path", "").startswith("/api/")
        refusal = self._refusal(scope, headers, api)
        slot = _Slot(self.counters, self.limits) if api and refusal is None else None
        body = _Body(receive, self.limits, headers.get(b"content-type") if refusal is None else None,
                     admit=slot.admit if slot is not None else None, held=self.counters)
        if refusal is not None:
            # a client waiting for "100 Continue" has not sent its body: answer at once; a body
            # whose framing is in doubt is not read (the connection closes after the answer)
            framing = refusal.code in ("bad_framing", "http_version_not_supported")
            if not framing and b"100-continue" not in headers.get(b"expect", b"").lower():
                await body.discard()
            return await _send_error(send, refusal)

        started = False

        async def guarded_send(msg):
            # once the body is refused, whatever the app answers (a parse error) is replaced
            nonlocal started
            if body.refusal is not None and not started:
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, body.receive, guarded_send)
        except asyncio.CancelledError:
            # the server is stopping and its grace period is over: a request not yet answered gets
            # a JSON refusal (not the server's plain-text 500) before its task ends
            if not started:
                started = True
                await _send_error(send, RequestError(503, "shutting_down", "the server is shutting down; retry "
                                                     "on another instance or after it restarts", retry_after=5))
            raise
        except Exception:  # noqa: BLE001
            if body.refusal is None:
                raise
        finally:
            if body.release() >= _LARGE_BODY and self.counters["buffered"] == 0:
                # the last large body has gone: free what refused requests keep in reference cycles
                # (an exception's traceback holds the frames that held the chunks), then give the
                # pages back to the system
                _collect_and_release()
            if slot is not None:
                slot.leave()
                if self.idle is not None:
                    self.idle.poke()
        if body.refusal is not None and not started:
            if body.discard_rest:
                await body.discard()
            await _send_error(send, body.refusal)
