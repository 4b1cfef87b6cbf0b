"""`tellkit recognize INPUT... [--model CKPT] [--json] [--lines]`: handwritten math -> LaTeX (BTTR).

Inputs are bitmaps or InkML files, folders of them, or glob patterns, read through
:class:`tellkit.pipelines.recognition.RecognitionPipeline` (the processor and search
``tellkit evaluate`` runs, with the checkpoint's whole stored search setting) in size-sorted
batches. One input prints its LaTeX (and, on standard error, how sure the model is), several
print ``PATH<TAB>LaTeX<TAB>CONFIDENCE`` lines (:mod:`tellkit.cli.answers`); ``--json`` prints one
JSON object per input (``input``, ``text``, ``tokens``, ``score``, ``confidence``, ``unsure``).
A runaway output (one token or a few repeated over and over, as for a photo) is stopped early and
flagged unsure. ``--lines``: each image is a page of several lines; its lines are found
(:mod:`tellkit.data.page_lines`) and read, one answer a line, top to bottom (``--json`` adds
``line``, ``top`` and ``bottom``)."""
from __future__ import annotations

import json

from tellkit.cli import (
    IMAGE_SUFFIXES,
    add_model_arguments,
    add_runtime_argument,
    display,
    expand_inputs,
    note_dtype,
    positive_float,
)
from tellkit.errors import TellkitError

NAME = "recognize"
HELP = "recognise handwritten math expressions (images, InkML files, folders) and print their LaTeX (BTTR)"


def add_arguments(p) -> None:
    p.add_argument("images", nargs="+", metavar="INPUT",
                   help="image files (PNG/JPEG/BMP; dark ink on a light background or the reverse), InkML files, "
                        "folders of them, or glob patterns")
    add_model_arguments(p, "the packaged model")
    add_runtime_argument(p)
    p.add_argument("--json", action="store_true",
                   help="one JSON object per input: input, text (LaTeX), tokens, score, confidence, unsure")
    p.add_argument("--beam-size", type=int, default=None,
                   help="beam size per direction (default: the checkpoint's, 10)")
    p.add_argument("--max-len", type=int, default=None, help="maximum output tokens (default: the checkpoint's, 200)")
    p.add_argument("--lines", action="store_true",
                   help="each image is a page of several lines (a scan of notes): find its lines and read each, "
                        "one answer a line, top to bottom")
    p.add_argument("--stroke-size", type=positive_float, default=None, metavar="PX",
                   help="read at this median stroke size in pixels (default: the checkpoint's "
                        "data.render.stroke_size; the packaged model's is 22)")


def run(args) -> int:
    from tellkit.cli.answers import print_plain  # heavy
    from tellkit.pipelines.recognition import RecognitionPipeline  # heavy

    if args.beam_size is not None and args.beam_size < 1:
        raise TellkitError("--beam-size must be >= 1")
    if args.max_len is not None and args.max_len < 1:
        raise TellkitError("--max-len must be >= 1")
    if args.lines:
        paths = expand_inputs(args.images, IMAGE_SUFFIXES, "images of pages")
    else:
        paths = expand_inputs(args.images, (*IMAGE_SUFFIXES, ".inkml"), "images or InkML files")
    pipe = RecognitionPipeline.load(args.model, device=args.device, dtype=args.dtype, runtime=args.runtime,
                                    stroke_size=args.stroke_size, beam_size=args.beam_size, max_len=args.max_len)
    note_dtype(NAME, pipe.info)
    if args.lines:
        return _pages(pipe, paths, args)
    results = pipe(paths, batch_size=args.batch_size)
    for path, r in zip(paths, results):
        if args.json:
            print(json.dumps({"input": display(path), **r}, ensure_ascii=False))
        else:
            print_plain(display(path), r, len(paths) > 1)
    return 0


def _pages(pipe, paths, args) -> int:
    """``--lines``: one answer a line of each page (``PATH:LINE`` names a line when there are several pages)."""
    from tellkit.cli.answers import print_plain  # heavy

    for path in paths:
        for r in pipe.read_page(path, batch_size=args.batch_size):
            if args.json:
                print(json.dumps({"input": path, **r}, ensure_ascii=False))
            elif len(paths) > 1:
                print_plain(f"{path}:{r['line']}", r, True)
            else:
                print(r["text"])
    return 0
