"""`tellkit caption IMAGE... [--article TXT] [--model DIR] [--encoder KEY=VALUE] [--json]`: caption photos.

Inputs are image files, folders (every image in them, by name) or glob patterns, read in
batches through :class:`tellkit.pipelines.captioning.CaptioningPipeline` (the processor and
search ``tellkit evaluate`` runs). Without ``--model`` the packaged default model is used; any
captioning checkpoint works (Transform and Tell, Show and Tell, Show-Attend-and-Tell, the LSTM
captioner). Decoding follows the checkpoint's generation settings (its recipe's ``eval:``
section) unless ``--beam-size`` / ``--max-len`` say otherwise. ``--encoder KEY=VALUE`` replaces a key
of the checkpoint's ``encoders:`` section (``article=DIR``: a local RoBERTa-large for a converted
official checkpoint; ``face_weights=FILE``, ``image_weights=FILE``). One input prints its caption
(and, on standard error, how sure the model is), several print ``PATH<TAB>caption<TAB>CONFIDENCE``
lines (:mod:`tellkit.cli.answers`); ``--json`` prints one JSON object per input: the caption
(``text``), its score, ``confidence`` and ``unsure``, the detected faces and, for every generated token, its attention
(mean over heads and layers) over the image grid cells, the article tokens and the faces (and,
for models that read objects, how many object vectors there were: none for a new image, as no
object detector ships). Images are decoded by :func:`tellkit.utils.images.open_image` (through
``encoders.preprocess.load_image``): format and pixel count are checked from the header, so a
decompression bomb or an EPS file is refused before any pixel is decoded; the first batch is
read before the model loads. Bad input (missing, empty, corrupt or truncated image, a refused
format, more pixels than ``TELLKIT_MAX_IMAGE_PIXELS``, an empty or non-UTF-8 article) is a
one-line error with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from tellkit.cli import (
    IMAGE_SUFFIXES,
    add_encoder_argument,
    add_model_arguments,
    add_runtime_argument,
    display,
    encoder_overrides,
    expand_inputs,
    note_dtype,
)
from tellkit.errors import TellkitError

NAME = "caption"
HELP = "caption photos (files, folders, globs), optionally with an article, with the default or a trained captioner"
CHUNK = 64  # images decoded and held at once
MAX_ARTICLE_BYTES = 4 * 2**20


def add_arguments(p) -> None:
    p.add_argument("inputs", nargs="*", metavar="IMAGE", help="image files, folders of images, or glob patterns")
    p.add_argument("--image", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--article", help="a UTF-8 text file with the article (title and paragraphs); one image only")
    add_model_arguments(p, "the packaged default captioner")
    add_runtime_argument(p)
    add_encoder_argument(p)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per image: caption (text), score, confidence, unsure, faces, "
                        "per-token attention")
    p.add_argument("--beam-size", type=int, default=None,
                   help="beam width, 1 = greedy (default: the checkpoint's eval.beam_size)")
    p.add_argument("--max-len", type=int, default=None, help="most caption tokens (default: the checkpoint's)")


def read_article(path: str) -> str:
    """A regular UTF-8 text file (not a folder, FIFO or device; at most MAX_ARTICLE_BYTES)."""
    from tellkit.utils.files import read_text  # heavy

    text = read_text(path, "--article", MAX_ARTICLE_BYTES).lstrip("\ufeff")
    if not text.strip():
        raise TellkitError(f"--article: {path}: the article is empty")
    return text


def run(args) -> int:
    from tellkit.cli.answers import print_plain  # heavy
    from tellkit.encoders.preprocess import load_image  # heavy

    if (args.beam_size is not None and args.beam_size < 1) or (args.max_len is not None and args.max_len < 1):
        raise TellkitError("--beam-size and --max-len must be at least 1")
    paths = expand_inputs([*args.inputs, *args.image], IMAGE_SUFFIXES, "images")
    encoders = encoder_overrides(args.encoder)
    article = read_article(args.article) if args.article else ""
    if args.article and len(paths) > 1:
        raise TellkitError("--article goes with one image; caption the others without it")
    # the first batch is read (and checked) before the model loads
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    images = [load_image(p) for p in chunks[0]]

    from tellkit.pipelines.captioning import CaptioningPipeline  # heavy

    pipe = CaptioningPipeline.load(args.model, device=args.device, dtype=args.dtype, runtime=args.runtime,
                                   beam_size=args.beam_size, max_len=args.max_len, encoders=encoders)
    note_dtype(NAME, pipe.info)
    for k, chunk in enumerate(chunks):
        if k:
            images = [load_image(p) for p in chunk]
        results = pipe([{"image": im, "article": article} for im in images], batch_size=args.batch_size,
                       details=args.json)
        for path, res in zip(chunk, results):
            if args.json:
                print(json.dumps({"input": display(path), **({"article": args.article} if args.article else {}), **res,
                                  "model": pipe.info}, ensure_ascii=False))
            else:
                print_plain(display(path), res, len(paths) > 1)
        sys.stdout.flush()
    if "objects" in pipe.contexts:
        print(f"tellkit caption: note: {pipe.info['objects']}", file=sys.stderr)
    return 0
