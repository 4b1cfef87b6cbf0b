"""BTTR speed: approximate joint search batched with a key/value cache versus the reference's
way (one image at a time, every prefix recomputed). Returns a JSON-able dict; the outputs of
both ways are compared (they must be the same expressions).

Also home of the project's own sample expression (``assets/samples/bttr_x2_plus_1.png``), drawn
from hand-made pen strokes by :func:`draw_sample`, so it can be redistributed with the code.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from tellkit.data.crohme import render_square
from tellkit.errors import TellkitError
from tellkit.pipelines.recognition import ASSETS, SAMPLE_LATEX, SAMPLE_PATH, RecognitionPipeline  # noqa: F401 - re-exported
from tellkit.recipes import PACKAGED_DEFAULTS


def _wobble(points, amp=0.6, seed=0.0):
    """A slight deterministic tremor, so the strokes look hand-drawn rather than ruled."""
    return [(x + amp * math.sin(1.7 * i + seed), y + amp * math.cos(1.3 * i + 2 * seed))
            for i, (x, y) in enumerate(points)]


def _line(a, b, n=12, bow=0.0):
    (x0, y0), (x1, y1) = a, b
    nx, ny = -(y1 - y0), x1 - x0
    norm = math.hypot(nx, ny) or 1.0
    return [(x0 + (x1 - x0) * t + bow * math.sin(math.pi * t) * nx / norm,
             y0 + (y1 - y0) * t + bow * math.sin(math.pi * t) * ny / norm) for t in (i / (n - 1) for i in range(n))]


def _arc(cx, cy, r, a0, a1, n=16):
    return [(cx + r * math.cos(math.radians(a0 + (a1 - a0) * i / (n - 1))),
             cy + r * math.sin(math.radians(a0 + (a1 - a0) * i / (n - 1)))) for i in range(n)]


def sample_strokes() -> list[list[tuple[float, float]]]:
    """Pen strokes of "x^2 + 1" (y grows downwards), made up here point by point."""
    two = _arc(37, -9, 6, 190, 370) + _line((43, -8), (30, 5), 8)[1:] + _line((30, 5), (46, 4), 6)[1:]
    strokes = [
        _line((0, 2), (24, 32), bow=2.5), _line((23, 1), (1, 31), bow=-2.0),  # x
        two,  # superscript 2
        _line((55, 17), (79, 16), bow=0.8), _line((67, 5), (68, 28), bow=-0.8),  # +
        _line((89, 7), (96, 0), 6) + _line((96, 0), (96, 32), 14)[1:],  # 1
    ]
    return [_wobble(s, seed=k) for k, s in enumerate(strokes)]


def draw_sample(path: str | Path | None = None):
    """Render :func:`sample_strokes` like the shared CROHME images; save it when ``path`` is given."""

    im = render_square(sample_strokes())
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        im.save(path, optimize=True)
    return im


def bench_bttr(checkpoint: str | Path | None = None, images: list[str | Path] | None = None, n_images: int = 32,
               batch_size: int = 16, beam_size: int | None = None, max_len: int | None = None,
               threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """Images/s of the joint search: batched + cached against one-by-one + uncached.

    ``checkpoint``: default model of ``tellkit recognize``; ``images``: default the first
    ``n_images`` of the CROHME 2014 test set under ``$TELLKIT_SHARED_DATA``, else the packaged
    sample repeated."""
    import torch  # heavy

    if threads:
        torch.set_num_threads(threads)
    rec = RecognitionPipeline.load(checkpoint, device=device, beam_size=beam_size, max_len=max_len)
    if images is None:
        images = _default_images(n_images)
        source = ("the packaged sample, repeated" if images and images[0] == SAMPLE_PATH
                  else f"the first {len(images)} PNGs of CROHME 2014 test (TELLKIT_SHARED_DATA)")
    else:
        source = "given"
    tensors = rec.prepare(images)
    kw = {"beam_size": rec.generation.beam_size, "max_len": rec.generation.max_len}

    t0 = time.perf_counter()
    fast = []
    for i in range(0, len(tensors), batch_size):
        fast += rec.forward(rec.preprocess(tensors[i : i + batch_size]), use_cache=True)["tokens"]
    t_fast = time.perf_counter() - t0

    t0 = time.perf_counter()
    slow = []
    for t in tensors:
        slow += rec.forward(rec.preprocess([t]), use_cache=False)["tokens"]
    t_slow = time.perf_counter() - t0

    n = len(tensors)
    return {
        "model": "bttr",
        "checkpoint": checkpoint_label(rec.info["checkpoint"]),
        "images_from": source,
        "device": device,
        "threads": torch.get_num_threads(),
        "images": n,
        "beam_size": kw["beam_size"],
        "max_len": kw["max_len"],
        "batch_size": batch_size,
        "batched_cached_images_per_s": n / t_fast,
        "one_by_one_uncached_images_per_s": n / t_slow,
        "speedup": t_slow / t_fast,
        "same_outputs": fast == slow,
        "mean_output_tokens": sum(len(t) for t in fast) / max(n, 1),
    }


def checkpoint_label(path) -> str:
    """The packaged default by name (results files hold no machine paths), else the path given."""
    default = PACKAGED_DEFAULTS["recognize"]
    if Path(path).resolve() == default.resolve():
        return f"packaged default ({default.name})"
    return str(path)


def _default_images(n: int) -> list[Path]:
    """The first ``n`` of ``$TELLKIT_SHARED_DATA/crohme/test/2014/*.png``; the packaged sample
    repeated when the variable is unset."""
    env = os.environ.get("TELLKIT_SHARED_DATA", "").strip()
    if not env:
        return [SAMPLE_PATH] * n
    d = Path(env).expanduser() / "crohme" / "test" / "2014"
    files = sorted(d.glob("*.png"))
    if not files:
        raise TellkitError(f"bench bttr: no PNG images in {d} (TELLKIT_SHARED_DATA is set; unset it to time "
                           "the packaged sample)")
    return files[:n]


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """``tellkit bench bttr``: the joint search with the default recognition checkpoint."""
    return bench_bttr(n_images=8 if quick else 32, batch_size=8 if quick else 16, device=device)
