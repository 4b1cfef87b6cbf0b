"""How a photo goes into the captioner: squashed whole to the encoder's square (``image_fit:
squash``) or resized by its short side and centre-cropped (``crop``). Flickr8k's photos were
squashed to squares before training, so a model trained on them has only seen squashed
photos; a user's photo has its own aspect ratio.

The originals are not available, so the suite gives each Flickr8k dev photo an aspect ratio
again (``aspect`` = width / height, 4:3 landscape and 3:4 portrait by default, the common
camera shapes) by stretching the square, then captions it both ways with the default
captioner (or ``checkpoint``) and scores CIDEr-D / BLEU-4 / METEOR against the dev references
(lower-cased, the Flickr8k convention). The square itself, as trained, is the reference row.
Needs ``$TELLKIT_SHARED_DATA/flickr8k``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tellkit.data.flickr8k import load_flickr8k
from tellkit.encoders.preprocess import load_image
from tellkit.errors import TellkitError
from tellkit.metrics.caption import score_captions
from tellkit.pipelines.captioning import CaptioningPipeline

ASPECTS = (4 / 3, 3 / 4)


def _dev(n: int) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    root = os.environ.get("TELLKIT_SHARED_DATA", "").strip()
    folder = Path(root) / "flickr8k" if root else None
    if folder is None or not folder.is_dir():
        raise TellkitError("bench caption_fit needs the Flickr8k data: set TELLKIT_SHARED_DATA to the folder "
                           "holding flickr8k/")
    refs: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for s in load_flickr8k(folder, "val"):
        refs.setdefault(s.image_id, []).append(s.caption)
        paths[s.image_id] = s.image_path
    ids = sorted(refs)[:n]
    return ids, {i: refs[i] for i in ids}, {i: paths[i] for i in ids}


def _captions(pipe: CaptioningPipeline, images: list, batch: int = 16) -> list[str]:
    out = []
    for k in range(0, len(images), batch):
        out += [r["text"] for r in pipe(images[k:k + batch], details=False)]
    return out


def run(quick: bool = False, device: str = "cpu", checkpoint: str | None = None) -> dict[str, Any]:
    n = 100 if quick else 1000
    ids, refs, paths = _dev(n)
    pipe = CaptioningPipeline.load(checkpoint, device=device)
    transform = pipe.processor.bundle.image_encoder.preprocess
    squares = [load_image(paths[i]) for i in ids]
    rows: dict[str, Any] = {}

    def score(name: str, images: list, fit: str) -> None:
        transform.fit = fit  # the one setting that differs between the rows
        t0 = time.perf_counter()
        preds = dict(zip(ids, _captions(pipe, images)))
        rows[name] = {**{k: round(v, 2) for k, v in score_captions(preds, refs, ["bleu", "meteor", "cider"],
                                                                   lowercase=True).items()},
                      "fit": fit, "seconds": round(time.perf_counter() - t0, 1)}

    trained_fit = transform.fit
    score("square, as trained", squares, trained_fit)
    for aspect in ASPECTS:
        w, h = squares[0].size
        shape = (round(w * aspect), h) if aspect >= 1 else (w, round(h / aspect))
        stretched = [im.resize(shape) for im in squares]
        for fit in ("squash", "crop"):
            score(f"{shape[0]}x{shape[1]} ({aspect:.2f}), {fit}", stretched, fit)
    transform.fit = trained_fit
    return {"images": len(ids), "split": "Flickr8k dev", "checkpoint": str(checkpoint or "packaged default"),
            "encoder": pipe.processor.bundle.config.image, "rows": rows}
