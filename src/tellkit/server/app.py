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
(:class:`~tellkit.server.body_guard.RequestGuard`) enforces the body limits while the body arrives. Errors are JSON
``{"error": code, "detail": message}`` with a 4xx status for anything the client can fix
(400 unreadable or non-UTF-8, 408 too slow, 413 oversize body / image / article, 415 wrong type,
422 bad or blank input), 503 for a model that is not loaded or a full server, 504 past the
per-request timeout. docs/server.md lists every limit and code.
"""
# no `from __future__ import annotations`: FastAPI reads the route signatures, whose types are
# imported lazily inside create_app.
import asyncio
import contextlib
import inspect
import json
import logging
import math
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tellkit import __version__
from tellkit.data.inkml import MAX_COORDINATE
from tellkit.errors import TellkitError
from tellkit.pipelines.recognition import Strokes
from tellkit.server.backends import batch_function, bound_generation, public_info, served_models
from tellkit.server.batching import BatchWorker, MemoryBudget, PriorityPool, QueueFull
from tellkit.server.body_guard import IdleRelease, RequestGuard
from tellkit.server.budget import (
    FIXED_BYTES,
    Cost,
    InputBudget,
    InputHold,
    PrepareOnce,
    article_bytes,
    image_bytes,
    preparer,
    strokes_kept_bytes,
    strokes_parse_bytes,
)
from tellkit.server.limits import Limits, RequestError, check_article, decode_image
from tellkit.server.samples import sample_file, sample_index
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


def create_app(models: Mapping[str, Any] | None = None, limits: Limits | None = None, max_batch: int = 8,
               max_wait_ms: float = 10.0, serve_page: bool = True):
    """Build the app around already-loaded pipelines, ``{task: pipeline}`` (see
    :mod:`tellkit.server.backends`); a task left out (or None) answers 503 and /health says so.
    The parts: :class:`RequestGuard` (limits before the app), :func:`add_error_handlers`,
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
    inputs = InputBudget(limits.input_budget_bytes)  # decoded images, parsed strokes, articles
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
    counters = {"inflight": 0, "receiving": 0, "buffered": 0}
    idle = IdleRelease(counters)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        idle.close()
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
    app.state.inputs = inputs
    add_error_handlers(app, limits)
    add_routes(app, models, workers, counters, ModelRunner(workers, limits, costs), reader, serve_page)
    app.add_middleware(RequestGuard, limits=limits, counters=counters, idle=idle)
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


def drop_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames an answered exception (and each exception it came
    from) still holds. A request whose upload was refused midway leaves its form parser, with
    megabytes of body, in such a frame, and the frame in a reference cycle with the exception:
    without this, the memory waits for the next full garbage collection. Frames still running
    (the handler's callers) are left as they are."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def add_error_handlers(app, limits: Limits) -> None:
    """Every error answers JSON ``{"error": code, "detail": text}`` with its status; the
    exception's finished frames are cleared (:func:`drop_frames`)."""
    from fastapi.exceptions import RequestValidationError  # optional
    from fastapi.responses import JSONResponse  # optional
    from starlette.exceptions import HTTPException as StarletteHTTPException  # optional

    @app.exception_handler(RequestError)
    async def _request_error(_req, exc: RequestError):
        drop_frames(exc)
        return JSONResponse({"error": exc.code, "detail": exc.message}, status_code=exc.status,
                            headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        drop_frames(exc)
        parts = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        return JSONResponse({"error": "invalid_request", "detail": "; ".join(parts) or "invalid request"},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        drop_frames(exc)
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
        drop_frames(exc)
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

    def _decode(self, upload, max_side: int, hold: InputHold | None):
        upload.file.seek(0)
        if hold is None:
            return decode_image(upload.file, self.limits, upload.content_type, max_side)
        img, original = decode_image(upload.file, self.limits, upload.content_type, max_side,
                                     before_decoding=lambda w, h, out: hold.need(image_bytes(w, h, out), "image"))
        hold.need(image_bytes(*img.size), "image")  # the full-size bitmap has gone
        return img, original

    async def read(self, upload, max_side: int, hold: InputHold | None = None) -> Any:
        """The upload decoded (:func:`~tellkit.server.limits.decode_image`); with ``hold``, the
        memory of the decoding is taken from the input budget before any pixel is decoded."""
        weight = (getattr(upload, "size", None) or 0) * self.WEIGHT_PER_BYTE
        return await asyncio.wrap_future(self.pool.submit(self._decode, upload, max_side, hold, weight_s=weight))

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

    limits, schemas, inputs = app.state.limits, response_models(), app.state.inputs
    errors = {c: {"model": schemas["error"], "description": ERROR_TEXT[c]} for c in (400, 413, 415, 422, 503, 504)}
    refuse = input_refusal(inputs)

    @app.get("/health", tags=["status"], summary="Server status and the models it serves")
    def health() -> dict:
        return {"status": "ok", "version": _version(), "models": models,
                "workers": {k: w.snapshot() for k, w in workers.items()}, "inflight": counters["inflight"],
                "receiving": counters["receiving"], "buffered_bytes": counters["buffered"],
                "memory_budget": _budget_info(app.state.budget), "input_budget": _budget_info(inputs),
                "limits": {k: getattr(limits, k) for k in limits.__dataclass_fields__}}

    @app.post("/api/caption", tags=["models"], summary="Caption an image, optionally in the context of an article",
              responses=errors, response_model=schemas["caption"])
    async def caption(image: UploadFile = File(..., description="PNG, JPEG, WebP, BMP or GIF"),
                      article: str | None = Form(None, description="article text (optional)")) -> dict:
        t0 = time.perf_counter()
        text = check_article(article, limits)
        with InputHold(inputs, refuse) as hold:  # the inputs' memory, given back when the answer is in
            hold.need(article_bytes(text), "article")
            img, original = await reader.read(image, limits.caption_max_side, hold)
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
        with InputHold(inputs, refuse) as hold:
            if strokes is not None:
                item, original = await reader.call(parse_strokes_held, strokes, limits, hold,
                                                   pixels=len(strokes) // 4), None
            else:
                item, original = await reader.read(image, limits.math_max_side, hold)
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


def parse_strokes_held(text: str, limits: Limits, hold: InputHold):
    """:func:`parse_strokes` within the input budget: the parse's memory is taken first (503 past
    the budget), then only what the parsed drawing keeps."""
    hold.need(strokes_parse_bytes(text), "drawing")
    strokes = parse_strokes(text, limits)
    hold.need(strokes_kept_bytes(strokes), "drawing")
    return strokes


def input_refusal(budget: InputBudget):
    """``refuse(what, n)`` of an :class:`~tellkit.server.budget.InputHold`: a 503 busy."""

    def refuse(what: str, n: int) -> RequestError:
        return RequestError(503, "busy", f"the server holds {budget.used / (1 << 20):.0f} MiB of requests' inputs "
                            f"(budget {budget.total >> 20} MiB) and this {what} needs {n / (1 << 20):.1f} MiB; "
                            "retry shortly", retry_after=2)

    return refuse


def _budget_info(budget: MemoryBudget | InputBudget) -> dict:
    return {"total_mib": budget.total >> 20, "used_mib": budget.used >> 20, "peak_mib": budget.peak >> 20}


def _version() -> str:

    return __version__
