"""A small line chart drawn with Pillow (no plotting library needed): training curves for
docs and reports (``tellkit curve``)."""
from __future__ import annotations

import math

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def nice_ticks(lo: float, hi: float, target: int = 6, integer: bool = False) -> list[float]:
    """Round tick values (steps of 1, 2 or 5 x 10^k; whole steps with ``integer``) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("tick range must be finite")
    if hi <= lo:
        lo, hi = lo - 1.0, hi + 1.0
    raw = (hi - lo) / max(target - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, round(step))
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t < hi + step * 0.5:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _label(v: float) -> str:
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.3g}"


def line_chart(series: dict[str, list[tuple[float, float]]], *, title: str = "", xlabel: str = "",
               ylabel: str = "", size: tuple[int, int] = (760, 440)):
    """A PIL image with one line (and point markers) per series of (x, y) points."""
    from PIL import Image, ImageDraw, ImageFont  # heavy

    points = [p for pts in series.values() for p in pts]
    if not points:
        raise ValueError("nothing to plot: every series is empty")
    W, H = size
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 70, 20 + (150 if len(series) > 1 else 0), 52, 55
    whole = all(float(p[0]).is_integer() for p in points)
    xs = nice_ticks(min(p[0] for p in points), max(p[0] for p in points), integer=whole)
    ys = nice_ticks(min(p[1] for p in points), max(p[1] for p in points))
    x0, x1, y0, y1 = xs[0], xs[-1], ys[0], ys[-1]

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (W - left - right),
                H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom))

    for x in xs:  # grid and tick labels
        a, _ = px(x, y0)
        d.line([(a, top), (a, H - bottom)], fill=(230, 230, 230))
        d.text((a, H - bottom + 6), _label(x), fill="black", font=small, anchor="ma")
    for y in ys:
        _, b = px(x0, y)
        d.line([(left, b), (W - right, b)], fill=(230, 230, 230))
        d.text((left - 6, b), _label(y), fill="black", font=small, anchor="rm")
    d.rectangle([left, top, W - right, H - bottom], outline="black")
    d.text((W / 2, 12), title, fill="black", font=font, anchor="ma")
    d.text(((left + W - right) / 2, H - 22), xlabel, fill="black", font=font, anchor="ma")
    d.text((left, top - 4), ylabel, fill="black", font=small, anchor="ld")
    for i, (name, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        xy = [px(x, y) for x, y in sorted(pts)]
        if len(xy) > 1:
            d.line(xy, fill=colour, width=2)
        for a, b in xy:
            d.ellipse([a - 3, b - 3, a + 3, b + 3], fill=colour)
        if len(series) > 1:  # legend
            ly = top + 8 + 20 * i
            d.line([(W - right + 12, ly), (W - right + 32, ly)], fill=colour, width=2)
            d.text((W - right + 38, ly), name, fill="black", font=small, anchor="lm")
    return img
