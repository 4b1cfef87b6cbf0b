"""`tellkit summarize TRANSCRIPT... [--features FILE.npy] --model DIR`: How2-style summaries of
transcripts (and their video features) with a trained VG-BART / VG-T5 (or a text-only model,
which needs no features). Inputs are ``.txt`` transcripts, folders of them or glob patterns; a
transcript's video features are ``--features`` (one transcript) or the ``<name>.npy`` beside it.
The work is :class:`tellkit.pipelines.summarization.SummarizationPipeline` (the processor and
search ``tellkit evaluate`` runs)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tellkit.cli import add_model_arguments, display, expand_inputs, note_dtype, read_text_file
from tellkit.errors import TellkitError

NAME = "summarize"
DEFAULT_RUN = "runs/how2_bart"
HELP = "summarize video transcripts (+ video features .npy) with a trained VG-BART / VG-T5 checkpoint"


def add_arguments(p) -> None:
    p.add_argument("transcripts", nargs="*", metavar="TRANSCRIPT",
                   help="text files with transcripts (lines are joined), folders of .txt files, or glob patterns")
    p.add_argument("--transcript", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--features", help="video features .npy, float32 (T, 2048), for one transcript (default: the "
                                      "transcript's <name>.npy beside it); not needed by a text-only model")
    add_model_arguments(p, f"{DEFAULT_RUN}, where `tellkit train configs/vg/how2_bart.yaml --out {DEFAULT_RUN}` "
                           "writes; no summarizer is packaged")
    p.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's eval.beam_size (5)")
    p.add_argument("--max-len", type=int, default=None, help="maximum summary tokens (default: eval.max_len, 64)")
    p.add_argument("--json", action="store_true", help="one JSON object per transcript instead of the bare summary")


def run(args) -> int:
    from tellkit.pipelines.summarization import SummarizationPipeline  # heavy

    paths = expand_inputs([*args.transcripts, *args.transcript], (".txt",), "transcripts")
    if args.features and len(paths) > 1:
        raise TellkitError("--features goes with one transcript; give the others a <name>.npy beside them")
    texts = []
    for p in paths:
        text = read_text_file(p, "transcript")
        if not text.split():
            raise TellkitError(f"transcript: {p} is empty")
        texts.append(text)
    model = args.model
    if model is None:
        if not Path(DEFAULT_RUN).exists():
            raise TellkitError(f"no --model given and no {DEFAULT_RUN}/ here: train one with "
                               f"`tellkit train configs/vg/how2_bart.yaml --out {DEFAULT_RUN}` or pass --model DIR")
        model = DEFAULT_RUN
    pipe = SummarizationPipeline.load(model, device=args.device, dtype=args.dtype, beam_size=args.beam_size,
                                      max_len=args.max_len)
    note_dtype(NAME, pipe.info)
    inputs = []
    for p, text in zip(paths, texts):
        beside = Path(p).with_suffix(".npy")
        features = args.features or (str(beside) if pipe.uses_video and beside.is_file() else None)
        if pipe.uses_video and features is None:
            raise TellkitError(f"{p}: this model fuses video: pass --features FILE.npy (float32, shape (T, 2048)) "
                               "or put <name>.npy beside the transcript")
        inputs.append({"transcript": text, "features": features})
    results = pipe(inputs, batch_size=args.batch_size)
    if any(r["video_ignored"] for r in results):
        print("tellkit summarize: note: the model is text-only, the video features are ignored", file=sys.stderr)
    for p, r in zip(paths, results):
        if args.json:
            print(json.dumps({"input": display(p), "text": r["text"], "frames": r["frames"],
                              "checkpoint": pipe.info["checkpoint"]}, ensure_ascii=False))
        else:
            print(r["text"] if len(paths) == 1 else f"{display(p)}\t{r['text']}")
    return 0
