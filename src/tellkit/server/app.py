"""The HTTP JSON API and the demo page (FastAPI): ``create_app(captioner, recognizer, limits)``.

    GET  /                 the page (static/index.html; KaTeX from static/vendor, no CDN)
    GET  /health           status, which models are served (checkpoint, trained or not), queues
    POST /api/caption      multipart: image (file), article (text, optional) -> caption + attention
    POST /api/recognize    multipart: image (file) -> LaTeX
    GET  /openapi.json     the schema (the Swagger/ReDoc pages are off: they load from a CDN)

Each model runs on its own :class:`~tellkit.server.batching.BatchWorker` thread, so concurrent
requests share forward passes and the event loop never runs a model. Errors are JSON
``{"error": code, "detail": message}`` with a 4xx status for anything the client can fix
(413 oversize body / image / article, 415 wrong type, 422 bad or blank input), 503 for a model
that is not loaded or a full queue, 504 past the per-request timeout.
"""
# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are
# imported lazily inside create_app.
import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError
from tellkit.server.batching import BatchWorker, QueueFull
from tellkit.server.limits import Limits, RequestError, check_article, decode_image, fit_side

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


class _BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` with 413, from Content-Length
    when given and by counting streamed chunks otherwise (so chunked uploads are capped too)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        too_big = RequestError(413, "request_too_large", f"request body over the limit of {self.max_bytes:,} bytes")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_error(send, RequestError(400, "bad_content_length", "invalid Content-Length"))
            if n > self.max_bytes:
                return await _send_error(send, too_big)
        seen = 0
        started = exceeded = False

        async def counting_receive():
            nonlocal seen, exceeded
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise _TooLarge()
            return msg

        async def guarded_send(msg):
            # once the body is over the limit, whatever the app answers (a parse error) is
            # replaced by the 413 below
            nonlocal started
            if exceeded and not started:
                return
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except _TooLarge:
            pass
        if exceeded and not started:
            await _send_error(send, too_big)


class _TooLarge(Exception):
    pass


async def _send_error(send, err: RequestError):
    import json

    body = json.dumps({"error": err.code, "detail": err.message}).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def create_app(captioner=None, recognizer=None, limits: Limits | None = None, max_batch: int = 8,
               max_wait_ms: float = 10.0, serve_page: bool = True):
    """Build the app around already-loaded backends (see :mod:`tellkit.server.backends`).
    ``captioner`` / ``recognizer`` may be None: their endpoint then answers 503 and /health says so."""
    from tellkit.utils.optional import require

    fastapi = require("fastapi", "server", "tellkit serve")
    require("python_multipart", "server", "file uploads (python-multipart)")
    from fastapi import File, Form, UploadFile
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    limits = limits or Limits()
    if serve_page:
        check_static()
    workers: dict[str, BatchWorker] = {}
    if captioner is not None:
        workers["caption"] = BatchWorker("caption", captioner.caption, max_batch, max_wait_ms / 1000, limits.max_queue)
    if recognizer is not None:
        workers["math"] = BatchWorker("math", recognizer.recognize, max_batch, max_wait_ms / 1000, limits.max_queue)
    models = {"caption": captioner.info if captioner is not None else None,
              "math": recognizer.info if recognizer is not None else None}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for w in workers.values():  # stop the model threads when the server stops
            w.close()

    app = fastapi.FastAPI(title="tellkit", version=_version(), docs_url=None, redoc_url=None, lifespan=lifespan,
                          description="Transform and Tell captions and BTTR handwritten-math recognition.")
    app.state.workers, app.state.limits, app.state.models = workers, limits, models

    # -- errors ---------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(_req, exc: RequestError):
        return JSONResponse({"error": exc.code, "detail": exc.message}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse({"error": "invalid_request", "detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": code, "detail": str(exc.detail)}, status_code=exc.status_code)

    async def run_model(name: str, item: Any, t0: float):
        worker = workers.get(name)
        if worker is None:
            what = "captioning" if name == "caption" else "math recognition"
            raise RequestError(503, "model_not_loaded", f"no {what} model is loaded on this server "
                               f"(start it with --checkpoint {name}=DIR or --untrained)")
        try:
            fut = worker.submit(item)
        except QueueFull as exc:
            raise RequestError(503, "busy", f"{exc}; retry shortly") from None
        left = limits.request_timeout_s - (time.perf_counter() - t0)
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

    def prepare(data: bytes, content_type: str | None, max_side: int):
        return fit_side(decode_image(data, limits, content_type), max_side)

    async def read_image(upload, max_side: int) -> Any:
        data = await upload.read()
        return await run_in_threadpool(prepare, data, upload.content_type, max_side)

    inflight = {"n": 0}

    @contextlib.contextmanager
    def admitted():
        """Bound the requests being decoded, queued or run at once (memory stays bounded)."""
        if inflight["n"] >= limits.max_inflight:
            raise RequestError(503, "busy", f"the server is handling {limits.max_inflight} requests; retry shortly")
        inflight["n"] += 1  # the event loop is single-threaded: no lock needed
        try:
            yield
        finally:
            inflight["n"] -= 1

    from pydantic import BaseModel

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
        image_size: list[int]
        resized_from: list[int] | None
        grid: Grid
        faces: list[Face]
        article_text: str
        article_tokens: list[ArticleToken]
        model: dict[str, Any]
        elapsed_ms: float

    class RecognizeResponse(BaseModel):
        latex: str
        tokens: list[str]
        score: float | None
        resized_from: list[int] | None
        model: dict[str, Any]
        elapsed_ms: float

    def errors(*codes: int) -> dict:
        text = {400: "unreadable image", 413: "body, image or article over a limit", 415: "not an accepted image",
                422: "missing field or input the model refuses", 503: "model not loaded or server busy",
                504: "timed out"}
        return {c: {"model": ErrorBody, "description": text[c]} for c in codes}

    # -- routes ---------------------------------------------------------------------------------
    @app.get("/health", tags=["status"], summary="Server status and the models it serves")
    def health() -> dict:
        return {"status": "ok", "version": _version(), "models": models,
                "workers": {k: w.snapshot() for k, w in workers.items()}, "inflight": inflight["n"],
                "limits": {k: getattr(limits, k) for k in limits.__dataclass_fields__}}

    @app.post("/api/caption", tags=["models"], summary="Caption an image, optionally in the context of an article",
              responses=errors(400, 413, 415, 422, 503, 504), response_model=CaptionResponse)
    async def caption(image: UploadFile = File(..., description="PNG, JPEG, WebP, BMP or GIF"),
                      article: str | None = Form(None, description="article text (optional)")) -> dict:
        t0 = time.perf_counter()
        with admitted():
            text = check_article(article, limits)
            img, original = await read_image(image, limits.caption_max_side)
            res = await run_model("caption", (img, text), t0)
        return {**res, "resized_from": original, "model": models["caption"],
                "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}

    @app.post("/api/recognize", tags=["models"], summary="Recognise a handwritten math expression as LaTeX",
              responses=errors(400, 413, 415, 422, 503, 504), response_model=RecognizeResponse)
    async def recognize(image: UploadFile = File(..., description="dark ink on a light background, or the reverse")) -> dict:
        t0 = time.perf_counter()
        with admitted():
            img, original = await read_image(image, limits.math_max_side)
            res = await run_model("math", img, t0)
        return {**res, "resized_from": original, "model": models["math"],
                "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}

    if serve_page:
        @app.get("/", include_in_schema=False)
        def index():
            return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})

        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    app.add_middleware(_BodyLimit, max_bytes=limits.max_upload_bytes)
    return app


def _version() -> str:
    from tellkit import __version__

    return __version__
