"""Augmentation of handwritten expressions in pen-stroke space, before they are rendered.

The CROHME training set is pen strokes (InkML), so a distortion can be applied where it is free
and exact: to the trajectories, before :func:`tellkit.data.inkml.render_strokes` draws them.
Each switch of :class:`InkAugment` is off by default; the recipe turns them on under
``data.augment`` (beside the image-space keys of :class:`tellkit.data.crohme.ImageAugment`),
and :func:`tellkit.data.recognition.parse_augment` reads and validates both when the recipe is read.

Sizes are relative to the expression's own handwriting: ``S`` below is the median stroke size
(:func:`tellkit.data.inkml.stroke_scale`, the same measure the renderer normalises by).

* ``render_scale: [lo, hi]``: the rendered size (the renderer's ``stroke_size``) times
  k ~ U(lo, hi), CoMER's ``scale_aug`` with (0.7, 1.4); the pixel cap still applies.
* ``ink_rotate`` (degrees) and ``ink_shear`` (slant, x += shear * y): the whole expression,
  each drawn uniformly in [-value, value].
* ``stroke_shift`` (x S), ``stroke_scale`` (relative) and ``stroke_rotate`` (degrees): each
  stroke moved, resized and turned about its own centre, independently of the others.
* ``elastic`` (x S) with ``elastic_wavelength`` (x S): a smooth random displacement field, a
  sum of a few sinusoidal plane waves, added to every point.
* ``pen_width: [lo, hi]``: the pen width in pixels drawn uniformly (instead of the renderer's).
* ``substitute`` (a probability per symbol): symbols of the file's segmentation are redrawn
  with the strokes of the same symbol from another training file (another writer where the
  files say who wrote them), fitted to the original symbol's box; the label is unchanged.
  Files without a segmentation keep their symbols.
* ``subexpr`` (a probability per item): the item becomes one of its well-formed parts, the
  numerator or denominator of a fraction or the argument of a root, with that part's own label
  (:func:`subexpressions`; files without a reliable link between strokes and MathML stay whole).

Randomness comes only from the ``numpy.random.Generator`` passed in, so a seed reproduces a
sample exactly; :class:`tellkit.data.crohme.CrohmeDataset` derives one per sample from torch's
generator, which the training loop seeds, checkpoints and varies per epoch and worker.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tellkit.config import from_dict
from tellkit.data.inkml import (
    InkExpression,
    InkMLError,
    InkSymbol,
    RenderConfig,
    read_inkml,
    render_strokes,
    stroke_scale,
)
from tellkit.data.latex import normalize
from tellkit.errors import TellkitError

WHERE = "data.augment"


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TellkitError(f"{WHERE}.{name}: expected a number in [{lo:g}, {hi:g}], got {value!r}")
    if not lo <= value <= hi:
        raise TellkitError(f"{WHERE}.{name}: expected a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _range(name: str, value: Any, lo: float, hi: float, allow_zero: bool = False) -> tuple[float, float]:
    msg = f"{WHERE}.{name}: expected [low, high] with {lo:g} < low <= high <= {hi:g}"
    if not isinstance(value, (list, tuple)) or len(value) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in value):
        raise TellkitError(f"{msg}, got {value!r}")
    a, b = float(value[0]), float(value[1])
    if allow_zero and a == b == 0:
        return (0.0, 0.0)
    if not lo < a <= b <= hi:
        raise TellkitError(f"{msg}, got {value!r}")
    return (a, b)


@dataclass
class InkAugment:
    """The stroke-space switches of ``data.augment`` (module docstring); all off by default."""

    render_scale: tuple[float, float] = (1.0, 1.0)
    ink_rotate: float = 0.0
    ink_shear: float = 0.0
    stroke_shift: float = 0.0
    stroke_scale: float = 0.0
    stroke_rotate: float = 0.0
    elastic: float = 0.0
    elastic_wavelength: float = 4.0
    pen_width: tuple[float, float] = (0.0, 0.0)  # (0, 0): the renderer's pen
    substitute: float = 0.0
    subexpr: float = 0.0

    def __post_init__(self):
        self.render_scale = _range("render_scale", self.render_scale, 0.0, 3.0)
        self.ink_rotate = _number("ink_rotate", self.ink_rotate, 0, 30)
        self.ink_shear = _number("ink_shear", self.ink_shear, 0, 1)
        self.stroke_shift = _number("stroke_shift", self.stroke_shift, 0, 1)
        self.stroke_scale = _number("stroke_scale", self.stroke_scale, 0, 0.5)
        self.stroke_rotate = _number("stroke_rotate", self.stroke_rotate, 0, 45)
        self.elastic = _number("elastic", self.elastic, 0, 1)
        self.elastic_wavelength = _number("elastic_wavelength", self.elastic_wavelength, 0.5, 100)
        self.pen_width = _range("pen_width", self.pen_width, 0.0, 20.0, allow_zero=True)
        self.substitute = _number("substitute", self.substitute, 0, 1)
        self.subexpr = _number("subexpr", self.subexpr, 0, 1)

    @property
    def active(self) -> bool:
        return bool(self.render_scale != (1.0, 1.0) or self.ink_rotate or self.ink_shear or self.stroke_shift
                    or self.stroke_scale or self.stroke_rotate or self.elastic or self.pen_width != (0.0, 0.0)
                    or self.substitute or self.subexpr)


# --- the symbol bank ------------------------------------------------------------------------------
@dataclass
class _Donor:
    source: int  # index of the expression it comes from
    writer: str | None
    strokes: list[np.ndarray]
    scale: float  # the median stroke size of its expression


@dataclass
class SymbolBank:
    """Every segmented symbol of a set of expressions, by label."""

    by_label: dict[str, list[_Donor]] = field(default_factory=dict)

    def add(self, source: int, expr: InkExpression) -> None:
        if not expr.symbols:
            return
        s = stroke_scale(expr.strokes)
        for sym in expr.symbols:
            self.by_label.setdefault(sym.label, []).append(
                _Donor(source, expr.writer, [expr.strokes[i] for i in sym.strokes], s))

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_label.values())

    def draw(self, label: str, rng: np.random.Generator, source: int | None, writer: str | None,
             tries: int = 8) -> _Donor | None:
        """A random version of ``label`` from another expression (and another writer when both
        are known), or None when a few draws find none."""
        pool = self.by_label.get(label)
        if not pool:
            return None
        for _ in range(tries):
            d = pool[int(rng.integers(len(pool)))]
            if source is not None and d.source == source:
                continue
            if writer is not None and d.writer == writer:
                continue
            return d
        return None


def fit_to_box(strokes: Sequence[np.ndarray], lo: np.ndarray, hi: np.ndarray, target_scale: float,
               donor_scale: float) -> list[np.ndarray] | None:
    """Move and resize ``strokes`` (a donor symbol) onto the box ``lo``-``hi`` of the symbol
    it replaces, centred. Both sides are fitted when both symbols have a real width and height
    (the aspect ratio changes by at most 1.5, so the result stays inside the box); a thin
    symbol (one side under a fifth of the other: ``-``, ``1``, ``|``) is scaled by its long
    side, and its thin side keeps the donor's thickness relative to the donor's handwriting;
    a dot (smaller than a quarter of a stroke) keeps its size relative to the handwriting."""
    pts = np.concatenate(strokes)
    dlo, dhi = pts.min(0), pts.max(0)
    dext, text = dhi - dlo, hi - lo
    rel = target_scale / donor_scale
    if text.max() < 0.25 * target_scale:
        sx = sy = rel
    else:
        thin_t = text < 0.2 * text.max()
        thin_d = dext < 0.2 * dext.max() if dext.max() > 0 else np.array([True, True])
        if thin_t.any() or thin_d.any():
            long_axis = int(np.argmax(text))
            if dext[long_axis] <= 0:
                return None
            s = text[long_axis] / dext[long_axis]
            sc = np.array([s, s])
            short = 1 - long_axis
            sc[short] = min(s, max(rel, text[short] / dext[short] if dext[short] > 0 else 0.0))
            sx, sy = float(sc[0]), float(sc[1])
        else:
            sx, sy = float(text[0] / dext[0]), float(text[1] / dext[1])
            if sx > 1.5 * sy:
                sx = 1.5 * sy
            elif sy > 1.5 * sx:
                sy = 1.5 * sx
    k = np.array([sx, sy])
    c_d, c_t = (dlo + dhi) / 2, (lo + hi) / 2
    return [(a - c_d) * k + c_t for a in strokes]


# --- sub-expressions ----------------------------------------------------------------------------
_LEAVES = ("mi", "mn", "mo", "mtext")
_DRAWN = (*_LEAVES, "mfrac", "msqrt", "mroot")  # elements that stand for a written symbol


class _Unsupported(ValueError):
    pass


def mathml_latex(node: tuple) -> str:
    """A MathML tree (:attr:`InkExpression.mathml`) -> LaTeX (for :func:`tellkit.data.latex.normalize`).
    Raises ``ValueError`` for elements it does not know."""
    tag, _, text, kids = node
    if tag in _LEAVES:
        if not text:
            raise _Unsupported(tag)
        return text
    a = [mathml_latex(k) for k in kids]
    n = len(a)
    if tag in ("math", "mrow", "mstyle"):
        return " ".join(a)
    if tag == "msqrt":
        return "\\sqrt{" + " ".join(a) + "}"
    if n == 2 and tag == "mfrac":
        return "\\frac{" + a[0] + "}{" + a[1] + "}"
    if n == 2 and tag == "mroot":
        return "\\sqrt[" + a[1] + "]{" + a[0] + "}"
    if n == 2 and tag in ("msup", "mover"):
        return "{" + a[0] + "}^{" + a[1] + "}"
    if n == 2 and tag in ("msub", "munder"):
        return "{" + a[0] + "}_{" + a[1] + "}"
    if n == 3 and tag in ("msubsup", "munderover"):
        return "{" + a[0] + "}_{" + a[1] + "}^{" + a[2] + "}"
    raise _Unsupported(tag)


@dataclass(frozen=True)
class SubExpression:
    tokens: tuple[str, ...]  # its normalised label
    symbols: tuple[int, ...]  # indices into the expression's symbols


def _drawn_ids(node: tuple, out: list) -> list:
    tag, nid, _, kids = node
    if tag in _DRAWN:
        out.append(nid)
    for k in kids:
        _drawn_ids(k, out)
    return out


def subexpressions(expr: InkExpression, min_symbols: int = 2) -> list[SubExpression]:
    """Well-formed parts of ``expr`` that make samples of their own: the numerator and the
    denominator of every fraction and the argument of every root, with at least
    ``min_symbols`` symbols, each with its strokes (through the segmentation's links into the
    file's MathML) and its label (the MathML part written as LaTeX and normalised).

    Only files whose MathML, written as LaTeX, normalises to exactly the file's truth label
    and whose every segmented symbol and every written MathML element are linked one to one
    qualify (most files; those whose MathML disagrees with the truth are left out)."""

    tree, symbols = expr.mathml, expr.symbols
    if tree is None or not symbols or not expr.truth:
        return []
    try:
        if normalize(mathml_latex(tree)) != normalize(expr.truth):
            return []
    except (_Unsupported, TellkitError):
        return []
    by_ref = {s.ref: j for j, s in enumerate(symbols)}
    drawn = _drawn_ids(tree, [])
    if None in by_ref or len(by_ref) != len(symbols) or sorted(map(str, drawn)) != sorted(by_ref):
        return []
    parts: list[tuple] = []

    def walk(node: tuple) -> None:
        tag, _, _, kids = node
        if tag == "mfrac" and len(kids) == 2:
            parts.extend(kids)
        elif tag == "msqrt" and kids:
            parts.append(("mrow", None, "", kids))
        elif tag == "mroot" and len(kids) == 2:
            parts.append(kids[0])
        for k in kids:
            walk(k)

    walk(tree)
    out: dict[tuple[str, ...], SubExpression] = {}
    for part in parts:
        ids = _drawn_ids(part, [])
        if len(ids) < min_symbols:
            continue
        try:
            toks = tuple(normalize(mathml_latex(part)))
        except (_Unsupported, TellkitError):
            continue
        if toks and toks not in out:
            out[toks] = SubExpression(toks, tuple(sorted(by_ref[i] for i in ids)))
    return list(out.values())


# --- the augmenter ------------------------------------------------------------------------------
@dataclass
class AugmentedInk:
    strokes: list[np.ndarray]
    symbols: list[InkSymbol]
    scale: float = 1.0  # times the renderer's stroke_size
    line_width: float | None = None  # the pen in pixels (None: the renderer's)
    substituted: list[int] = field(default_factory=list)  # indices into symbols
    tokens: list[str] | None = None  # the label of a sub-expression (None: the expression's own)

    def render_config(self, base: RenderConfig) -> RenderConfig:
        if self.scale == 1.0 and self.line_width is None:
            return base
        kw: dict[str, Any] = {"stroke_size": base.stroke_size * self.scale}
        if self.line_width is not None:
            kw["line_width"] = self.line_width
        return dataclasses.replace(base, **kw)

    def render(self, base: RenderConfig):

        return render_strokes(self.strokes, self.render_config(base))


def _rot(deg: float) -> np.ndarray:
    a = math.radians(deg)
    return np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])


class InkAugmenter:
    """Applies an :class:`InkAugment` to expressions: ``augmenter(expr, rng) -> AugmentedInk``.

    ``bank``: the symbols that substitution draws from (needed only for ``substitute``)."""

    def __init__(self, config: InkAugment, bank: SymbolBank | None = None, vocab: Iterable[str] | None = None):
        self.config = config
        self.bank = bank
        self.vocab = set(vocab) if vocab is not None else None  # sub-expression labels must be in it
        self._subs: dict[int, list[SubExpression]] = {}
        if config.substitute and bank is None:
            raise TellkitError(f"{WHERE}.substitute: needs a bank of symbols (InkML training data)")

    def subexpressions(self, expr: InkExpression, source: int | None = None) -> list[SubExpression]:
        """:func:`subexpressions` of ``expr`` whose labels are in the vocabulary (kept per source)."""
        if source is not None and source in self._subs:
            return self._subs[source]
        subs = [x for x in subexpressions(expr) if self.vocab is None or all(t in self.vocab for t in x.tokens)]
        if source is not None:
            self._subs[source] = subs
        return subs

    def __call__(self, expr: InkExpression, rng: np.random.Generator, source: int | None = None) -> AugmentedInk:
        c = self.config
        strokes = list(expr.strokes)
        symbols = list(expr.symbols)
        out = AugmentedInk(strokes, symbols)
        if c.subexpr and rng.random() < c.subexpr:
            subs = self.subexpressions(expr, source)
            if subs:
                sub = subs[int(rng.integers(len(subs)))]
                keep = [i for j in sub.symbols for i in symbols[j].strokes]
                new_index = {i: k for k, i in enumerate(keep)}
                out = AugmentedInk([strokes[i] for i in keep],
                                   [InkSymbol(symbols[j].label, tuple(new_index[i] for i in symbols[j].strokes),
                                              symbols[j].ref) for j in sub.symbols], tokens=list(sub.tokens))
                strokes = out.strokes
        S = stroke_scale(strokes)
        if c.substitute and symbols and self.bank is not None:
            self._substitute(out, rng, S, source, expr.writer)
        if c.stroke_shift or c.stroke_scale or c.stroke_rotate:
            out.strokes = [self._jitter(a, rng, S) for a in out.strokes]
        if c.elastic:
            out.strokes = self._elastic(out.strokes, rng, S)
        if c.ink_rotate or c.ink_shear:
            ang = rng.uniform(-c.ink_rotate, c.ink_rotate) if c.ink_rotate else 0.0
            sh = rng.uniform(-c.ink_shear, c.ink_shear) if c.ink_shear else 0.0
            m = _rot(ang) @ np.array([[1.0, sh], [0.0, 1.0]])
            allp = np.concatenate(out.strokes)
            ctr = (allp.min(0) + allp.max(0)) / 2
            out.strokes = [(a - ctr) @ m.T + ctr for a in out.strokes]
        if c.render_scale != (1.0, 1.0):
            out.scale = float(rng.uniform(*c.render_scale))
        if c.pen_width != (0.0, 0.0):
            out.line_width = float(rng.uniform(*c.pen_width))
        return out

    def _jitter(self, a: np.ndarray, rng: np.random.Generator, S: float) -> np.ndarray:
        c = self.config
        u = rng.uniform(-1.0, 1.0, size=4)  # shift x, shift y, rotation, scale
        ctr = (a.min(0) + a.max(0)) / 2
        m = _rot(u[2] * c.stroke_rotate) * (1.0 + u[3] * c.stroke_scale)
        return (a - ctr) @ m.T + ctr + u[:2] * (c.stroke_shift * S)

    def _elastic(self, strokes: list[np.ndarray], rng: np.random.Generator, S: float,
                 waves: int = 3) -> list[np.ndarray]:
        c = self.config
        wl = c.elastic_wavelength * S
        # per axis of displacement: `waves` plane waves of random direction, wavelength
        # (0.7-1.4 x wl), phase and weight; their sum has a standard deviation of about amp
        theta = rng.uniform(0, 2 * math.pi, size=(2, waves))
        k = 2 * math.pi / (wl * rng.uniform(0.7, 1.4, size=(2, waves)))
        kv = np.stack([np.cos(theta) * k, np.sin(theta) * k], -1)  # [2, waves, 2]
        phase = rng.uniform(0, 2 * math.pi, size=(2, waves))
        weight = rng.normal(size=(2, waves)) * (c.elastic * S * math.sqrt(2.0 / waves))
        out = []
        for a in strokes:
            arg = np.einsum("nd,awd->naw", a, kv) + phase  # [n, 2, waves]
            out.append(a + (np.sin(arg) * weight).sum(-1))
        return out

    def _substitute(self, out: AugmentedInk, rng: np.random.Generator, S: float, source: int | None,
                    writer: str | None) -> None:
        p = self.config.substitute
        draws = rng.random(len(out.symbols))
        new_strokes: list[np.ndarray] = []
        placed: dict[int, list[int]] = {}  # old stroke index -> new indices (for unchanged strokes)
        replaced: dict[int, list[np.ndarray]] = {}  # symbol index -> its new strokes
        for j, sym in enumerate(out.symbols):
            if draws[j] >= p:
                continue
            donor = self.bank.draw(sym.label, rng, source, writer)
            if donor is None:
                continue
            pts = np.concatenate([out.strokes[i] for i in sym.strokes])
            fitted = fit_to_box(donor.strokes, pts.min(0), pts.max(0), S, donor.scale)
            if fitted is not None:
                replaced[j] = fitted
        if not replaced:
            return
        gone = {i for j in replaced for i in out.symbols[j].strokes}
        for i, a in enumerate(out.strokes):
            if i not in gone:
                placed[i] = [len(new_strokes)]
                new_strokes.append(a)
        symbols = []
        for j, sym in enumerate(out.symbols):
            if j in replaced:
                idx = tuple(range(len(new_strokes), len(new_strokes) + len(replaced[j])))
                new_strokes.extend(replaced[j])
                out.substituted.append(j)
            else:
                idx = tuple(placed[i][0] for i in sym.strokes)
            symbols.append(InkSymbol(sym.label, idx, sym.ref))
        out.strokes, out.symbols = new_strokes, symbols


def load_inks(paths: Iterable[str | os.PathLike]) -> list[InkExpression]:
    """The strokes and segmentation of InkML files (for augmenting them afresh each epoch)."""
    out = []
    for p in paths:
        try:
            out.append(read_inkml(p))
        except InkMLError as exc:
            raise TellkitError(f"{WHERE}: cannot read {p} for augmentation ({exc.reason})") from None
    return out


def build_bank(inks: Sequence[InkExpression]) -> SymbolBank:
    bank = SymbolBank()
    for i, e in enumerate(inks):
        bank.add(i, e)
    return bank


def measure(root: str | os.PathLike, augment: Mapping[str, Any], render: Mapping[str, Any] | None = None,
            n: int = 200, bank_files: int = 2000, seed: int = 0) -> dict[str, float]:
    """Milliseconds per expression for ``n`` training files of the InkML ``root``: read from a
    render cache, rendered as they are, and augmented with ``augment`` (a ``data.augment``
    mapping) and rendered, the symbol bank built from ``bank_files`` files (strokes are read
    beforehand, as the dataset does)."""
    from PIL import Image  # heavy

    files = sorted((Path(root) / "train").rglob("*.inkml"))
    if not files:
        raise TellkitError(f"no InkML training files under {root}/train")
    rs = np.random.default_rng(seed)
    pick = sorted(rs.choice(len(files), min(len(files), max(n, bank_files)), replace=False).tolist())
    inks = []
    for i in pick:
        try:
            inks.append(read_inkml(files[i]))
        except InkMLError:
            continue
    ink_keys = {f.name for f in dataclasses.fields(InkAugment)}  # the image-space keys are not timed here
    cfg = from_dict(InkAugment, {k: v for k, v in dict(augment).items() if k in ink_keys}, WHERE)
    if not cfg.active:
        raise TellkitError(f"{WHERE}: no stroke-space switch is on")
    aug = InkAugmenter(cfg, build_bank(inks) if cfg.substitute else None)
    base = from_dict(RenderConfig, dict(render or {}), "data.render")
    sample = inks[:n]
    t0 = time.perf_counter()
    plain = [render_strokes(e.strokes, base) for e in sample]
    t1 = time.perf_counter()
    for i, e in enumerate(sample):
        aug(e, np.random.default_rng([seed, i]), source=i).render(base)
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # what an unaugmented epoch reads: the render cache
        for i, im in enumerate(plain):
            im.save(f"{tmp}/{i}.png")
        t3 = time.perf_counter()
        for i in range(len(plain)):
            with Image.open(f"{tmp}/{i}.png") as im:
                im.convert("L")
        t4 = time.perf_counter()
    ms = 1e3 / len(sample)
    return {"n": len(sample), "cached_ms": round((t4 - t3) * ms, 2), "render_ms": round((t1 - t0) * ms, 2),
            "augmented_ms": round((t2 - t1) * ms, 2)}


if __name__ == "__main__":  # python -m tellkit.data.ink_augment DATA_ROOT RECIPE
    import json
    import sys

    from tellkit.config import load_yaml

    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tellkit.data.ink_augment CROHME_INKML_ROOT RECIPE.yaml")
    recipe = load_yaml(sys.argv[2])
    data = recipe.get("data") or {}
    print(json.dumps(measure(sys.argv[1], data.get("augment") or {}, data.get("render")), indent=1))
