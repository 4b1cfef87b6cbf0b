"""InkML pen strokes (the official CROHME format): reading, and rendering to offline images.

Reading (:func:`read_inkml`) accepts what real files contain: the InkML namespace or none,
2- or 3-channel points (``X Y`` or ``X Y T``; only X and Y are used), traces listed flat or
inside trace groups, commas and whitespace in any mix. A file that cannot be used raises
:class:`InkMLError` with a short reason (``malformed XML``, ``no traces``, ``no truth``);
:func:`scan_folder` skips such files and counts the reasons instead of stopping. The symbol
segmentation that CROHME training files carry (a trace group per symbol: its label and the ids
of its traces) comes back as :attr:`InkExpression.symbols` (empty when a file has none); stroke
augmentation (:mod:`tellkit.data.ink_augment`) redraws symbols with it.

Rendering (:func:`render_strokes`) turns strokes into the kind of bitmap the offline HMER papers
(WAP, DenseWAP, BTTR, CoMER) trained on: black ink on white, tight around the expression,
aspect ratio kept, at a resolution set by the handwriting itself. Coordinates come in each
device's own units (tablet dots, whiteboard millimetres, screen pixels), so they are
normalised first: the scale makes the median size of a stroke (the longer side of its bounding
box) ``RenderConfig.stroke_size`` pixels, so that symbols come out about the same size whatever
the device. Strokes are drawn ``line_width`` pixels wide, anti-aliased by drawing at
``supersample`` times the size and averaging down. An expression that would exceed
``max_pixels`` (the reference's cap on training images) is scaled down to fit rather than
dropped. The same renderer serves training, ``tellkit evaluate`` on an InkML folder,
``tellkit recognize file.inkml`` and the strokes that the web page's math canvas sends.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tellkit.errors import TellkitError

# Bump when the drawing code changes in a way that changes pixels: cached renders are keyed by
# this and by the RenderConfig, so a changed renderer never reuses stale images.
RENDERER_VERSION = 1

_XML_ID = "{http://www.w3.org/XML/1998/namespace}id"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_NOT_FINITE = re.compile(r"(?i)(?<![a-z])(?:nan|inf)")
# the largest coordinate magnitude a trace may have: beyond it scaling to pixels loses all
# precision (1e308 overflows to inf and NaN)
MAX_COORDINATE = 1e9


class InkMLError(TellkitError):
    """A file that cannot be used; ``reason`` is a short key for counting skipped files."""

    def __init__(self, path: str | os.PathLike, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{path}: {reason}" + (f" ({detail})" if detail else ""))


STRIDE = 16


@dataclass(frozen=True)
class InkSymbol:
    """One symbol of an expression's segmentation: its label as the file writes it (``x``,
    ``\\alpha``, ``-``) and the indices of its strokes in :attr:`InkExpression.strokes`."""

    label: str
    strokes: tuple[int, ...]
    ref: str | None = None  # the id of its node in the file's MathML (annotationXML href)


@dataclass
class InkExpression:
    id: str
    path: Path
    strokes: list[np.ndarray]  # each [n, 2] float64 (x, y), y pointing down as written
    truth: str | None = None  # the LaTeX of <annotation type="truth">, $...$ stripped
    writer: str | None = None
    # the symbol segmentation (one trace group per symbol); empty when the file has none or
    # an unusable one (a stroke claimed by two symbols)
    symbols: list[InkSymbol] = field(default_factory=list)
    # the file's MathML truth (annotationXML) as nested (tag, id, text, children) tuples, or None
    mathml: tuple | None = None
    # the document's own annotations, type -> text (the first of each type; MathWriting keeps
    # its truth in ``normalizedLabel`` and ``label``)
    annotations: dict[str, str] = field(default_factory=dict)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _parse_points(text: str) -> np.ndarray:
    """``"x y [t], x y [t], ..."`` -> [n, 2]; points are comma separated, channels by spaces."""
    if _NOT_FINITE.search(text):
        raise ValueError("a coordinate is NaN or infinite")
    rows = []
    for part in text.split(","):
        vals = _NUMBER.findall(part)
        if len(vals) >= 2:
            rows.append((float(vals[0]), float(vals[1])))
    pts = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    check_coordinates(pts)
    return pts


def check_coordinates(pts: np.ndarray) -> None:
    """Refuse NaN, infinite and huge (over :data:`MAX_COORDINATE`) coordinates (ValueError)."""
    if pts.size and not np.isfinite(pts).all():
        raise ValueError("a coordinate is NaN or infinite")
    if pts.size and float(np.abs(pts).max()) > MAX_COORDINATE:
        raise ValueError(f"a coordinate is over {MAX_COORDINATE:g} in magnitude")


def _strip_math(truth: str) -> str:
    """Drop the ``$`` math delimiters (some files also have one in the middle) and fold spaces."""
    return " ".join(truth.replace("\\$", "\0").replace("$", " ").replace("\0", "\\$").split())


def parse_inkml(data: bytes | str, path: str | os.PathLike = "<inkml>", require_truth: bool = False) -> InkExpression:
    """Parse InkML text or bytes (see :func:`read_inkml`)."""
    if not (data.strip() if isinstance(data, str) else data.strip()):
        raise InkMLError(path, "empty file")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        root = None
        if isinstance(data, bytes):  # some writers store Latin-1 bytes in a UTF-8 document
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                text = re.sub(r"^\s*<\?xml[^>]*\?>", "", data.decode("cp1252", errors="replace"))
                try:
                    root = ET.fromstring(text)
                except ET.ParseError:
                    root = None
        if root is None:
            raise InkMLError(path, "malformed XML", str(exc)) from None
    strokes: list[np.ndarray] = []
    trace_index: dict[str, int] = {}  # trace id -> index in strokes (traces with points only)
    groups = []
    truth = writer = mathml = None
    for el in root.iter():
        tag = _local(el.tag) if isinstance(el.tag, str) else ""
        if tag == "trace":
            try:
                pts = _parse_points(el.text or "")
            except ValueError as exc:
                raise InkMLError(path, "bad coordinates", str(exc)) from None
            if len(pts):
                tid = el.get("id") or el.get(_XML_ID)
                if tid is not None:
                    trace_index.setdefault(tid.strip(), len(strokes))
                strokes.append(pts)
        elif tag == "traceGroup":
            groups.append(el)
        elif tag == "annotationXML" and mathml is None and len(el) and \
                (el.get("type") or "").strip().lower() == "truth":
            mathml = _mathml_tree(el[0])
        elif tag == "annotation":
            kind = (el.get("type") or "").strip().lower()
            if kind == "truth" and truth is None and (el.text or "").strip():
                truth = _strip_math(el.text or "")
            elif kind == "writer" and writer is None:
                writer = (el.text or "").strip() or None
    if not strokes:
        raise InkMLError(path, "no traces")
    if require_truth and not truth:
        raise InkMLError(path, "no truth")
    p = Path(path)
    notes: dict[str, str] = {}
    for el in root:
        if isinstance(el.tag, str) and _local(el.tag) == "annotation" and el.get("type"):
            notes.setdefault(el.get("type", "").strip(), " ".join((el.text or "").split()))
    return InkExpression(id=p.stem, path=p, strokes=strokes, truth=truth, writer=writer,
                         symbols=_segmentation(groups, trace_index), mathml=mathml, annotations=notes)


def _mathml_tree(el, depth: int = 0) -> tuple | None:
    """A MathML element -> ``(tag, xml:id, text, children)`` (text stripped, "" if none)."""
    if depth > 200 or not isinstance(el.tag, str):
        return None
    kids = tuple(t for t in (_mathml_tree(c, depth + 1) for c in el) if t is not None)
    return (_local(el.tag), el.get(_XML_ID) or el.get("id"), (el.text or "").strip(), kids)


def _segmentation(groups, trace_index: dict[str, int]) -> list[InkSymbol]:
    """Symbols from trace groups that label their strokes directly (``<annotation
    type="truth">`` and ``<traceView traceDataRef=...>`` children; the enclosing
    "Segmentation" group has neither). A symbol naming a trace that is not in the file is
    left out; a stroke claimed by two symbols makes the whole segmentation unusable."""
    symbols: list[InkSymbol] = []
    seen: set[int] = set()
    for g in groups:
        label, refs, href = None, [], None
        for ch in g:
            tag = _local(ch.tag) if isinstance(ch.tag, str) else ""
            if tag == "annotation" and (ch.get("type") or "").strip().lower() == "truth" and label is None:
                label = " ".join((ch.text or "").split()) or None
            elif tag == "traceView" and ch.get("traceDataRef") is not None:
                refs.append(ch.get("traceDataRef", "").strip().lstrip("#"))
            elif tag == "annotationXML" and href is None and ch.get("href"):
                href = ch.get("href", "").strip().lstrip("#") or None
        if not label or not refs:
            continue
        if any(r not in trace_index for r in refs):
            continue
        idx = tuple(dict.fromkeys(trace_index[r] for r in refs))
        if seen.intersection(idx):
            return []
        seen.update(idx)
        symbols.append(InkSymbol(label, idx, href))
    return symbols


def read_inkml(path: str | os.PathLike, require_truth: bool = False) -> InkExpression:
    """One InkML file -> its strokes and truth. Raises :class:`InkMLError` (a TellkitError)."""
    p = Path(path)
    if not p.is_file():  # a device or FIFO is never opened: it could block or never end
        raise TellkitError(f"InkML file not found: {p}" if not p.exists()
                           else f"{p}: not a regular file, expected an InkML file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InkMLError(p, "unreadable", str(exc)) from None
    return parse_inkml(data, p, require_truth=require_truth)


@dataclass
class ScanResult:
    expressions: list[InkExpression]
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def _read_or_reason(path: Path, require_truth: bool) -> InkExpression | str:
    try:
        return read_inkml(path, require_truth=require_truth)
    except InkMLError as exc:
        return exc.reason


def _read_chunk(paths: list[Path], require_truth: bool) -> list[InkExpression | str]:
    return [_read_or_reason(p, require_truth) for p in paths]


#: folders with at least this many files are read by several processes (where there are cores)
PARALLEL_FILES = 400


def scan_folder(folder: str | os.PathLike, require_truth: bool = True, workers: int | None = None) -> ScanResult:
    """Every ``*.inkml`` under ``folder`` (recursively, sorted). Unusable files are skipped and
    counted by reason, never raised. ``workers``: processes that read the files (default: one
    per available core for a folder of at least :data:`PARALLEL_FILES` files, else 1); the
    result does not depend on it."""
    d = Path(folder)
    if not d.is_dir():
        raise TellkitError(f"InkML folder not found: {d}")
    files = sorted(d.rglob("*.inkml"))
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if len(files) >= PARALLEL_FILES else 1
    if workers > 1 and len(files) > 1:
        from concurrent.futures import ProcessPoolExecutor  # heavy

        size = max(16, len(files) // (8 * workers))
        chunks = [files[i : i + size] for i in range(0, len(files), size)]
        with ProcessPoolExecutor(min(workers, len(chunks))) as pool:
            read = [x for part in pool.map(_read_chunk, chunks, [require_truth] * len(chunks)) for x in part]
    else:
        read = [_read_or_reason(f, require_truth) for f in files]
    res = ScanResult([])
    for f, got in zip(files, read):
        if isinstance(got, str):
            res.skipped[got] += 1
            res.skipped_files.append((str(f), got))
        else:
            res.expressions.append(got)
    return res


# --- rendering ----------------------------------------------------------------------------------
MAX_STROKE_SIZE = 256  # pixels: models read 16-32; a stroke larger than a whole training image is a mistake


@dataclass(frozen=True)
class RenderConfig:
    stroke_size: float = 32.0  # pixels for the median stroke's longer bounding-box side
    line_width: float = 3.0  # pen width in pixels
    margin: int = 4  # white border in pixels
    supersample: int = 4  # anti-aliasing: draw this many times larger, then average down
    max_pixels: int = 320_000  # larger expressions are scaled down to fit (0: no cap)
    max_side: int = 0  # optional cap on the longer side (0: none)

    def __post_init__(self):
        # a bad size would draw an empty or unreadable image, or fail deep inside PIL
        for name, least, strict in (("stroke_size", 0, True), ("line_width", 0, True), ("margin", 0, False),
                                    ("supersample", 1, False), ("max_pixels", 0, False), ("max_side", 0, False)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < least or (strict and v == least):
                need = f"> {least}" if strict else f">= {least}"
                raise TellkitError(f"data.render.{name} must be a finite number {need}, got {v!r}")
        if self.stroke_size > MAX_STROKE_SIZE:  # the renderer would draw an image of gigapixels first
            raise TellkitError(f"data.render.stroke_size must be at most {MAX_STROKE_SIZE} pixels, "
                               f"got {self.stroke_size:g}")

    def key(self) -> str:
        """Identifies the renderer and its settings (for render caches)."""
        blob = json.dumps({"version": RENDERER_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _as_arrays(strokes: Iterable) -> list[np.ndarray]:
    out = []
    for s in strokes:
        a = np.asarray(s, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] < 2:
            raise TellkitError("a stroke must be a list of (x, y) points")
        a = a[:, :2]
        try:
            check_coordinates(a)
        except ValueError as exc:
            raise TellkitError(f"strokes: {exc}") from None
        if len(a):
            out.append(a)
    if not out:
        raise TellkitError("no strokes to draw")
    return out


def stroke_scale(strokes: Sequence[np.ndarray]) -> float:
    """The median stroke size in the strokes' own units (longer side of each stroke's box;
    dots are ignored); falls back to the whole expression's size."""
    allp = np.concatenate(strokes)
    ext = float(np.ptp(allp, axis=0).max())
    sizes = [float(np.ptp(s, axis=0).max()) for s in strokes if len(s) > 1]
    sizes = [v for v in sizes if v > ext * 1e-9]  # a stroke a billionth of the expression's size is a dot
    if sizes:
        return float(np.median(sizes))
    return ext if ext > 0 else 1.0


def _layout(arrs: Sequence[np.ndarray], c: RenderConfig) -> tuple[np.ndarray, float, int, int]:
    """Where the strokes go: their top-left corner in device units, the pixels per device
    unit, and the image's width and height in pixels."""
    allp = np.concatenate(arrs)
    lo = allp.min(0)
    ext = np.ptp(allp, axis=0)
    scale = stroke_scale(arrs)
    with np.errstate(over="ignore", invalid="ignore"):
        f = c.stroke_size / scale  # pixels per device unit
        if not (math.isfinite(f) and np.isfinite(ext * f).all()):  # strokes of 1e-300 units, say
            raise TellkitError(f"strokes: too small to draw (the median stroke spans {scale:.3g} units)")

    def size_at(f: float) -> tuple[int, int]:
        return (int(math.ceil(ext[0] * f + c.line_width)) + 2 * c.margin,
                int(math.ceil(ext[1] * f + c.line_width)) + 2 * c.margin)

    w, h = size_at(f)
    if c.max_side and max(w, h) > c.max_side:
        f *= (c.max_side - 2 * c.margin - c.line_width) / max(ext[0] * f, ext[1] * f, 1e-9)
        w, h = size_at(f)
    if c.max_pixels and w * h > c.max_pixels:
        for _ in range(50):  # shrink until it fits (the border and pen width do not shrink)
            f *= math.sqrt(c.max_pixels / (w * h)) * 0.995
            w, h = size_at(f)
            if w * h <= c.max_pixels:
                break
    return lo, f, w, h


def rendered_shape(strokes: Iterable, config: RenderConfig | None = None) -> tuple[int, int]:
    """(H, W) of the model input that :func:`render_strokes` and :func:`image_to_tensor` make of
    ``strokes``, without drawing them (for size-sorted batches)."""
    _, _, w, h = _layout(_as_arrays(strokes), config or RenderConfig())
    return h + (-h) % STRIDE, w + (-w) % STRIDE


def render_strokes(strokes: Iterable, config: RenderConfig | None = None):
    """Strokes (sequences of (x, y) points, y down) -> a PIL ``L`` image, black ink on white."""
    from PIL import Image, ImageDraw  # heavy

    c = config or RenderConfig()
    arrs = _as_arrays(strokes)
    lo, f, w, h = _layout(arrs, c)
    ss = max(1, int(c.supersample))
    off = c.margin + c.line_width / 2
    im = Image.new("L", (w * ss, h * ss), 255)
    draw = ImageDraw.Draw(im)
    pen = max(1, int(round(c.line_width * ss)))
    r = pen / 2
    for a in arrs:
        # the same arithmetic, element by element, as a per-point Python loop (same pixels), faster
        xy = [tuple(p) for p in ((a - lo) * f * ss + off * ss).tolist()]
        if len(xy) > 1:
            draw.line(xy, fill=0, width=pen, joint="curve")
        for x, y in (xy[0], xy[-1]) if len(xy) > 1 else xy:  # round caps (and dots)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=0)
    if ss > 1:
        im = im.resize((w, h), Image.BOX)
    return im


def pad_to_stride(img: torch.Tensor, stride: int = STRIDE) -> torch.Tensor:
    """Pad [.., H, W] with zeros (no ink) at the bottom and right to multiples of ``stride``."""
    h, w = img.shape[-2:]
    ph, pw = (-h) % stride, (-w) % stride
    return torch.nn.functional.pad(img, (0, pw, 0, ph)) if ph or pw else img


def image_to_tensor(im):
    """A rendered PIL image (black on white) -> float [1, H, W], ink 1, padded to the encoder's
    stride (:func:`pad_to_stride`)."""
    a = 1.0 - np.asarray(im, dtype=np.float32) / 255.0
    return pad_to_stride(torch.from_numpy(np.ascontiguousarray(a))[None])


class RenderCache:
    """Rendered expressions on disk: ``<root>/<renderer key>/<relative path>.png``.

    The key covers the renderer version and its settings; an entry is also tied to its
    source file's size and modification time, so an edited InkML file is rendered anew."""

    def __init__(self, root: str | os.PathLike, config: RenderConfig):
        self.config = config
        self.dir = Path(root).expanduser() / config.key()

    def _paths(self, src: Path, rel: str) -> tuple[Path, Path]:
        base = self.dir / rel
        return base.with_suffix(".png"), base.with_suffix(".json")

    def get(self, src: Path, rel: str, strokes_fn):
        """The cached render of ``src`` (``rel``: its path relative to the data root), or a
        new one from ``strokes_fn()``, written atomically."""
        from PIL import Image  # heavy

        png, meta = self._paths(src, rel)
        st = src.stat()
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if png.is_file() and meta.is_file():
            try:
                if json.loads(meta.read_text()) == stamp:
                    with Image.open(png) as im:
                        return im.convert("L")
            except (OSError, ValueError):
                pass  # unreadable entry: render again
        im = render_strokes(strokes_fn(), self.config)
        png.parent.mkdir(parents=True, exist_ok=True)
        tmp = png.with_name(png.name + f".tmp{os.getpid()}")
        im.save(tmp, format="PNG")
        os.replace(tmp, png)
        tmp = meta.with_name(meta.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, meta)
        return im


def default_cache_dir() -> Path:
    """``$TELLKIT_CACHE/renders``, else ``$XDG_CACHE_HOME/tellkit/renders`` (``~/.cache/...``)."""
    if os.environ.get("TELLKIT_CACHE"):
        return Path(os.environ["TELLKIT_CACHE"]).expanduser() / "renders"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tellkit" / "renders"


class InkRenderer:
    """InkML files (or raw strokes) -> model input tensors, through an optional disk cache.

    ``root``: the data root, so cache entries are named by the path relative to it."""

    def __init__(self, config: RenderConfig | None = None, cache_dir: str | os.PathLike | None = None,
                 root: str | os.PathLike | None = None):
        self.config = config or RenderConfig()
        self.cache = RenderCache(cache_dir, self.config) if cache_dir else None
        self.root = Path(root).resolve() if root else None

    def _rel(self, path: Path) -> str:
        p = path.resolve()
        if self.root is not None:
            try:
                return str(p.relative_to(self.root))
            except ValueError:
                pass
        return "abs/" + hashlib.sha1(str(p).encode()).hexdigest()

    def image(self, path: str | os.PathLike, ink: InkExpression | None = None):
        """The rendered PIL image (black on white) of one InkML file (``ink``: its strokes,
        when they have been read already)."""
        p = Path(path)

        def strokes():
            return (ink if ink is not None else read_inkml(p)).strokes

        if self.cache is None:
            return render_strokes(strokes(), self.config)
        return self.cache.get(p, self._rel(p), strokes)

    def tensor(self, path: str | os.PathLike, ink: InkExpression | None = None):
        return image_to_tensor(self.image(path, ink))

    def strokes_tensor(self, strokes: Iterable):
        return image_to_tensor(render_strokes(strokes, self.config))

    def __call__(self, expr) -> object:
        """A :class:`tellkit.data.crohme.Expression` whose ``image`` is an InkML file."""
        return self.tensor(expr.image, getattr(expr, "ink", None))
