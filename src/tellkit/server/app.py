"""The HTTP JSON API and the demo page (FastAPI): ``create_app({"caption": captioner, "recognize": reader}, limits)``.

    GET  /                 the page (static/index.html; KaTeX from static/vendor, no CDN)
    GET  /health           status, which models are served (checkpoint, trained or not), queues
    GET  /api/samples      the packaged sample photos and handwritten formula the page offers
    GET  /samples/NAME     one of those samples (only the listed names)
    POST /api/caption      multipart: image (file), article (text, optional) -> caption + attention
    POST /api/recognize    multipart: image (file) -> LaTeX
    GET  /openapi.json     the schema (the Swagger/ReDoc pages are off: they load from a CDN)

Each model runs on its own :class:`~tellkit.server.batching.BatchWorker` thread, so concurrent
requests share forward passes and the event loop never runs a model; uploads are decoded on
``max_decoding`` threads by :mod:`tellkit.utils.images`. A guard in front of the app
(:class:`_RequestGuard`) enforces the body limits while the body arrives. Errors are JSON
``{"error": code, "detail": message}`` with a 4xx status for anything the client can fix
(400 unreadable or non-UTF-8, 408 too slow, 413 oversize body / image / article, 415 wrong type,
422 bad or blank input), 503 for a model that is not loaded or a full server, 504 past the
per-request timeout. docs/server.md lists every limit and code.
"""
# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are
# imported lazily inside create_app.
import asyncio
import codecs
import contextlib
import gc
import inspect
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tellkit import __version__
from tellkit.data.inkml import MAX_COORDINATE
from tellkit.errors import TellkitError
from tellkit.pipelines.recognition import Strokes
from tellkit.server.backends import batch_function, bound_generation, public_info, served_models
from tellkit.server.batching import BatchWorker, MemoryBudget, PriorityPool, QueueFull
from tellkit.server.budget import FIXED_BYTES, Cost, PrepareOnce, preparer
from tellkit.server.limits import (
    Limits,
    RequestError,
    check_article,
    check_framing,
    check_range,
    decode_image,
    multipart_boundary,
)
from tellkit.server.samples import sample_file, sample_index
from tellkit.utils.memory import release_memory
from tellkit.utils.optional import require

STATIC_DIR = Path(__file__).resolve().parent / "static"
VENDOR_FILES = ("vendor/katex/katex.min.js", "vendor/katex/katex.min.css")
log = logging.getLogger("tellkit.server")


def check_static() -> None:
    """The page's files, KaTeX included (copied into static/vendor by ``make setup``)."""
    missing = [f for f in ("index.html", "app.js", "style.css", *VENDOR_FILES) if not (STATIC_DIR / f).is_file()]
    if missing:
        raise TellkitError(
            f"the demo page's files are missing under {STATIC_DIR}: {', '.join(missing)}. KaTeX is installed by "
            "`make setup` from the npm registry; run it, or start with --api-only")


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
        self.seen, self.done, self.t0 = 0, False, None
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
        try:
            if end <= now:
                raise asyncio.TimeoutError()
            return await asyncio.wait_for(self._receive(), end - now)
        except asyncio.TimeoutError:
            if end >= total:
                raise TimeoutError(f"the request body did not arrive within {lim.body_timeout_s:g} s") from None
            if end >= rate:
                raise TimeoutError(f"the request body arrived at under {lim.min_body_rate:,} bytes/s ({self.seen:,} "
                                   f"bytes in {time.monotonic() - self.t0:.0f} s)") from None
            raise TimeoutError(f"no request data for {lim.body_idle_timeout_s:g} s") from None

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
            self.refuse(RequestError(408, "request_timeout", str(exc)), discard_rest=False)
        if msg["type"] != "http.request":
            self.done = True
            return msg
        chunk = msg.get("body", b"")
        if self.held["buffered"] + len(chunk) > self.limits.max_buffered_bytes:
            self.refuse(RequestError(503, "busy", f"the server holds {self.limits.max_buffered_mb} MiB of request "
                                     "bodies; retry shortly", retry_after=5), discard_rest=True)
        self.seen += len(chunk)
        self.held["buffered"] += len(chunk)  # given back by release() when the request ends
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


class _RequestGuard:
    """ASGI middleware in front of the app. Every request: HTTP/1.0 or 1.1 only (505); a body over
    ``max_upload_bytes`` is refused with 413 (from Content-Length when given, else counted while
    streaming); a body that stalls (``body_idle_timeout_s``), drags (``body_timeout_s``) or
    arrives under ``min_body_rate`` gets 408; text fields of a form must be UTF-8 (400) and within
    their character limits (413). POST /api/* requests are admitted once their body is in, at
    most ``max_inflight`` at once (:class:`_Slot`; 503 with Retry-After beyond). The rest of a
    refused body is read and dropped (bounded) before the JSON answer, so every client can read it."""

    def __init__(self, app, limits: Limits, counters: dict):
        self.app, self.limits, self.counters = app, limits, counters
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
                gc.collect()
                release_memory()
            if slot is not None:
                slot.leave()
        if body.refusal is not None and not started:
            if body.discard_rest:
                await body.discard()
            await _send_error(send, body.refusal)


def create_app(models: Mapping[str, Any] | None = None, limits: Limits | None = None, max_batch: int = 8,
               max_wait_ms: float = 10.0, serve_page: bool = True):
    """Build the app around already-loaded pipelines, ``{task: pipeline}`` (see
    :mod:`tellkit.server.backends`); a task left out (or None) answers 503 and /health says so.
    The parts: :class:`_RequestGuard` (limits before the app), :func:`add_error_handlers`,
    :class:`ModelRunner` and :class:`ImageReader` (the work of a request), :func:`response_models`
    (the schemas) and :func:`add_routes`."""
    fastapi = require("fastapi", "server", "tellkit serve")
    require("python_multipart", "server", "file uploads (python-multipart)")

    limits = limits or Limits()
    if serve_page:
        check_static()
    workers: dict[str, BatchWorker] = {}
    costs: dict[str, InputCost] = {}
    budget = MemoryBudget(limits.memory_budget_bytes)  # shared: the batches of every model together
    served = served_models(models)
    for name, backend in served.items():
        if backend is not None:  # the search bounded, and fewer images per pass for a wide beam
            batch = max(1, min(max_batch, limits.max_search_rows // bound_generation(backend, limits)))
            # cheap inputs (drawings) may run beside a large one
            small = limits.memory_budget_bytes // 4 if getattr(backend, "small_lane", False) else None
            workers[name] = BatchWorker(name, batch_function(name, backend), batch, max_wait_ms / 1000,
                                        limits.max_queue, budget=budget, small_lane_bytes=small)
            costs[name] = InputCost(backend)
    models = {name: public_info(backend) for name, backend in served.items()}
    reader = ImageReader(limits)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for w in workers.values():  # stop the model threads when the server stops
            w.close()
        reader.close()

    extra = {}
    if "form_limits" in inspect.signature(fastapi.FastAPI).parameters:
        # a text field may use up to 4 UTF-8 bytes per character; the guard counts characters
        part = max(4 * limits.max_article_chars, limits.max_stroke_chars) + 4
        extra["form_limits"] = {"max_part_size": part, "max_files": 4, "max_fields": 16}
    # redirect_slashes off: starlette builds the redirect of /api/caption/ from the Host header
    app = fastapi.FastAPI(title="tellkit", version=_version(), docs_url=None, redoc_url=None, lifespan=lifespan,
                          redirect_slashes=False,
                          description="Transform and Tell captions and BTTR handwritten-math recognition.", **extra)
    app.state.workers, app.state.limits, app.state.models, app.state.budget = workers, limits, models, budget
    counters = {"inflight": 0, "receiving": 0, "buffered": 0}
    add_error_handlers(app, limits)
    add_routes(app, models, workers, counters, ModelRunner(workers, limits, costs), reader, serve_page)
    app.add_middleware(_RequestGuard, limits=limits, counters=counters)
    return app


class InputCost:
    """What one request's item costs its model (:meth:`tellkit.pipelines.base.Pipeline.cost`),
    worked out on the decoding threads before the item is queued: the input of a model that
    ``prepares_early`` is prepared there (once: the pipeline reuses the result), so the cost can
    follow from the prepared input."""

    def __init__(self, backend):
        self.backend = backend
        owner = preparer(backend) if getattr(backend, "prepares_early", False) else None
        self.prepare = PrepareOnce(owner) if owner is not None else None
        self.cost = getattr(backend, "cost", None)

    def __call__(self, item) -> Cost:
        prepared = self.prepare.early(item) if self.prepare is not None else None
        return self.cost(item, prepared) if self.cost is not None else Cost(FIXED_BYTES, 1.0)


def add_error_handlers(app, limits: Limits) -> None:
    """Every error answers JSON ``{"error": code, "detail": text}`` with its status."""
    from fastapi.exceptions import RequestValidationError  # optional
    from fastapi.responses import JSONResponse  # optional
    from starlette.exceptions import HTTPException as StarletteHTTPException  # optional

    @app.exception_handler(RequestError)
    async def _request_error(_req, exc: RequestError):
        return JSONResponse({"error": exc.code, "detail": exc.message}, status_code=exc.status,
                            headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse({"error": "invalid_request", "detail": "; ".join(parts) or "invalid request"},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and detail.startswith("Field exceeded maximum size"):  # urlencoded
            return JSONResponse({"error": "field_too_long", "detail": "a form field is over the limit of "
                                 f"{limits.max_article_chars:,} characters"}, status_code=413)
        if exc.status_code == 400 and detail.startswith("Part exceeded maximum size"):
            # the form parser's own text-field cap (a FastAPI without form_limits)
            return JSONResponse({"error": "article_too_long", "detail": f"the article is over the limit of "
                                 f"{limits.max_article_chars:,} characters"}, status_code=413)
        code = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": code, "detail": detail}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_req, exc: Exception):
        log.error("internal error", exc_info=exc)
        return JSONResponse({"error": "internal_error", "detail": f"{type(exc).__name__} (logged on the server)"},
                            status_code=500)


class ModelRunner:
    """Costs one request's input (:class:`InputCost`, on the decoding threads), hands it to its
    model's batching worker and waits for the answer within the request timeout; every failure
    becomes a :class:`RequestError` (503 with Retry-After when the worker would not answer in time)."""

    def __init__(self, workers: dict[str, BatchWorker], limits: Limits, costs: dict[str, InputCost] | None = None):
        self.workers, self.limits, self.costs = workers, limits, costs or {}

    def worker(self, name: str) -> BatchWorker:
        worker = self.workers.get(name)
        if worker is None:
            raise RequestError(503, "model_not_loaded", f"no {name} model is loaded on this server "
                               f"(start it with --model {name}=DIR or --untrained)")
        return worker

    async def cost(self, name: str, item: Any, reader: "ImageReader") -> Cost:
        self.worker(name)
        costing = self.costs.get(name)
        if costing is None:
            return Cost(0, 1.0)
        size = getattr(item[0] if isinstance(item, tuple) else item, "size", None)
        pixels = size[0] * size[1] if isinstance(size, tuple) and len(size) == 2 else 0
        try:
            return await reader.call(costing, item, pixels=pixels)
        except TellkitError as exc:
            raise RequestError(422, "bad_input", str(exc)) from None

    async def run(self, name: str, item: Any, t0: float, cost: Cost | None = None):
        worker, limits, cost = self.worker(name), self.limits, cost or Cost(0, 1.0)
        left = limits.request_timeout_s - (time.perf_counter() - t0)
        try:
            fut = worker.submit(item, cost.bytes, cost.work, deadline_s=left)
        except QueueFull as exc:
            raise RequestError(503, "busy", f"{exc}; retry shortly", retry_after=exc.retry_after) from None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=max(left, 0.001))
        except asyncio.TimeoutError:
            fut.cancel()  # (wait_for cancels it too) dropped by the worker if it has not started yet
            raise RequestError(504, "timeout", f"the request took longer than {limits.request_timeout_s:g} s") from None
        except TellkitError as exc:
            raise RequestError(422, "bad_input", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - an internal failure, reported without a traceback
            log.exception("%s model failed", name)
            raise RequestError(500, "model_error", f"the {name} model failed: {type(exc).__name__}: {exc}") from None


class ImageReader:
    """Decodes uploaded images on ``limits.max_decoding`` dedicated threads: at most that many
    full-size bitmaps exist at once, and only those threads' malloc arenas ever hold one (on a
    shared pool of 40 threads each arena keeps its own freed bitmap: measured 466 vs 166 MiB peak
    growth for 8 concurrent 16 M-pixel uploads). The upload is read from the form parser's
    spooled file (on disk past 1 MiB), not copied into memory first. The threads take the job due
    first (:class:`~tellkit.server.batching.PriorityPool`), weighted by its size, so a burst of
    large uploads does not hold up a small one."""

    # seconds of patience per byte of upload / per pixel of a decoded image (1 MB or 50 k pixels: 1 s)
    WEIGHT_PER_BYTE, WEIGHT_PER_PIXEL = 1e-6, 2e-5
    HEAVY_PIXELS = 320_000  # preparing more than this (ink analysis in Python): one such job at a time

    def __init__(self, limits: Limits):
        self.limits = limits
        self.pool = PriorityPool(limits.max_decoding, "tellkit-decode")

    def _decode(self, upload, max_side: int):
        upload.file.seek(0)
        return decode_image(upload.file, self.limits, upload.content_type, max_side)

    async def read(self, upload, max_side: int) -> Any:
        weight = (getattr(upload, "size", None) or 0) * self.WEIGHT_PER_BYTE
        return await asyncio.wrap_future(self.pool.submit(self._decode, upload, max_side, weight_s=weight))

    async def call(self, fn, *args, pixels: int = 0) -> Any:
        """``fn(*args)`` on the decoding threads (parsing strokes, preparing an input of ``pixels``)."""
        return await asyncio.wrap_future(self.pool.submit(fn, *args, weight_s=pixels * self.WEIGHT_PER_PIXEL,
                                                          heavy=pixels > self.HEAVY_PIXELS))

    def close(self) -> None:
        self.pool.shutdown()


def response_models() -> dict[str, type]:
    """The API's JSON schemas (pydantic models): error, caption and recognition responses."""
    from pydantic import BaseModel  # optional

    class ErrorBody(BaseModel):
        error: str
        detail: str

    class Token(BaseModel):
        id: int
        text: str
        attention: dict[str, list[float]]  # context -> weights (image cells / article tokens / faces)

    class Grid(BaseModel):
        rows: int
        cols: int
        box: list[float]  # [x0, y0, x1, y1] of the image the grid covers

    class Face(BaseModel):
        box: list[float]
        score: float

    class ArticleToken(BaseModel):
        text: str
        start: int
        end: int

    class CaptionResponse(BaseModel):
        caption: str
        tokens: list[Token]
        score: float | None  # log-probability; null when not finite
        confidence: float | None = None  # 0..1 (tellkit.decoding.confidence); null: the model has no calibration
        unsure: bool = False  # low confidence, or a runaway / empty answer
        image_size: list[int]
        resized_from: list[int] | None
        grid: Grid
        faces: list[Face]
        article_text: str
        article_tokens: list[ArticleToken]
        objects: dict[str, Any] | None = None  # models that read objects: count, source, note
        model: dict[str, Any]
        elapsed_ms: float

    class RecognizeResponse(BaseModel):
        latex: str
        tokens: list[str]
        score: float | None
        confidence: float | None = None
        unsure: bool = False
        resized_from: list[int] | None
        model: dict[str, Any]
        elapsed_ms: float

    return {"error": ErrorBody, "caption": CaptionResponse, "recognize": RecognizeResponse}


ERROR_TEXT = {400: "unreadable image", 413: "body, image or article over a limit", 415: "not an accepted image",
              422: "missing field or input the model refuses", 503: "model not loaded or server busy",
              504: "timed out"}


def add_routes(app, models: dict, workers: dict, counters: dict, runner: ModelRunner, reader: ImageReader,
               serve_page: bool) -> None:
    """/health, /api/caption, /api/recognize and (``serve_page``) the demo page."""
    from fastapi import File, Form, UploadFile  # optional

    limits, schemas = app.state.limits, response_models()
    errors = {c: {"model": schemas["error"], "description": ERROR_TEXT[c]} for c in (400, 413, 415, 422, 503, 504)}

    @app.get("/health", tags=["status"], summary="Server status and the models it serves")
    def health() -> dict:
        return {"status": "ok", "version": _version(), "models": models,
                "workers": {k: w.snapshot() for k, w in workers.items()}, "inflight": counters["inflight"],
                "receiving": counters["receiving"], "buffered_bytes": counters["buffered"],
                "memory_budget": _budget_info(app.state.budget),
                "limits": {k: getattr(limits, k) for k in limits.__dataclass_fields__}}

    @app.post("/api/caption", tags=["models"], summary="Caption an image, optionally in the context of an article",
              responses=errors, response_model=schemas["caption"])
    async def caption(image: UploadFile = File(..., description="PNG, JPEG, WebP, BMP or GIF"),
                      article: str | None = Form(None, description="article text (optional)")) -> dict:
        t0 = time.perf_counter()
        text = check_article(article, limits)
        img, original = await reader.read(image, limits.caption_max_side)
        cost = await runner.cost("caption", (img, text), reader)
        res = await runner.run("caption", (img, text), t0, cost)
        return {**res, "resized_from": original, "model": models["caption"],
                "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}

    @app.post("/api/recognize", tags=["models"], summary="Recognise a handwritten math expression as LaTeX",
              responses=errors, response_model=schemas["recognize"])
    async def recognize(
            image: UploadFile | None = File(None, description="dark ink on a light background, or the reverse"),
            strokes: str | None = Form(None, description="pen strokes instead of an image: JSON "
                                       "[[[x, y], ...], ...], y pointing down (the page's drawing pad)")) -> dict:
        t0 = time.perf_counter()
        if (image is None) == (strokes is None):
            raise RequestError(422, "invalid_request", "send exactly one of 'image' (a file) or 'strokes' (JSON)")
        if strokes is not None:
            item, original = await reader.call(parse_strokes, strokes, limits, pixels=len(strokes) // 4), None
        else:
            item, original = await reader.read(image, limits.math_max_side)
        cost = await runner.cost("recognize", item, reader)
        res = await runner.run("recognize", item, t0, cost)
        return {**res, "resized_from": original, "model": models["recognize"],
                "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}

    if serve_page:
        add_page(app)


def add_page(app) -> None:
    """The demo page, its files, and the packaged samples it offers (``/api/samples`` lists
    them, ``/samples/NAME`` serves one; nothing else is reachable through that route)."""
    from fastapi.responses import FileResponse  # optional
    from fastapi.staticfiles import StaticFiles  # optional

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/samples", tags=["status"], summary="The packaged sample photos and handwritten formula")
    def samples() -> dict:
        return sample_index()

    @app.get("/samples/{name}", include_in_schema=False)
    def sample(name: str):
        found = sample_file(name)
        if found is None:
            raise RequestError(404, "not_found", f"no sample called {name!r}; GET /api/samples lists them")
        return FileResponse(found[0], media_type=found[1])

    @app.get("/favicon.ico", include_in_schema=False)  # where browsers and bookmarks look without a <link>
    def favicon():
        return FileResponse(STATIC_DIR / "favicon.ico", media_type="image/x-icon")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a coordinate")


def parse_strokes(text: str, limits: Limits | None = None):
    """The drawing pad's JSON strokes -> :class:`tellkit.pipelines.recognition.Strokes` (rendered by
    the same renderer as the model's InkML training data), or a 422 with what is wrong (413 past
    the point limit). Numbers of any length are read as floats (a 400-digit integer is a huge
    coordinate, refused like 1e300), NaN and Infinity are not JSON numbers."""
    limits = limits or Limits()
    try:
        data = json.loads(text, parse_int=float, parse_constant=_no_constant)
    except ValueError:
        raise RequestError(422, "bad_input", "'strokes' is not valid JSON of finite numbers") from None
    except RecursionError:
        raise RequestError(422, "bad_input", "'strokes' is nested too deeply: expected [[[x, y], ...], ...]") from None
    if not isinstance(data, list) or not data or len(data) > limits.max_stroke_count:
        raise RequestError(422, "bad_input", f"'strokes' must be a list of 1 to {limits.max_stroke_count:,} strokes")
    out, n = [], 0
    for s in data:
        if not isinstance(s, list) or not s:
            raise RequestError(422, "bad_input", "each stroke must be a non-empty list of [x, y] points")
        n += len(s)
        if n > limits.max_stroke_points:
            raise RequestError(413, "too_many_points", f"more than {limits.max_stroke_points:,} points in 'strokes'")
        pts = []
        for p in s:
            if (not isinstance(p, list) or len(p) < 2 or not all(isinstance(v, float) and math.isfinite(v)
                                                                 and abs(v) <= MAX_COORDINATE for v in p[:2])):
                raise RequestError(422, "bad_input", f"each point must be [x, y] with finite numbers of at most "
                                   f"{MAX_COORDINATE:g} in magnitude")
            pts.append((p[0], p[1]))
        out.append(pts)
    return Strokes(out)


def _budget_info(budget: MemoryBudget) -> dict:
    return {"total_mib": budget.total >> 20, "used_mib": budget.used >> 20, "peak_mib": budget.peak >> 20}


def _version() -> str:

    return __version__
