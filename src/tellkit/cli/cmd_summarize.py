"""`tellkit summarize --transcript FILE --features FILE.npy --checkpoint DIR`: one How2-style
summary from a transcript and its video features with a trained VG-BART / VG-T5 (or a text-only
model, which needs no --features). The work is ``tellkit.pipelines.summarization.Summarizer``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tellkit.cli import read_text_file
from tellkit.errors import TellkitError

NAME = "summarize"
DEFAULT_RUN = "runs/how2_bart"
HELP = "summarize a video transcript (+ video features .npy) with a trained VG-BART / VG-T5 checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--transcript", required=True, help="text file with the transcript (lines are joined)")
    p.add_argument("--features", help="video features .npy, float32 (T, 2048); needed unless the model is text-only")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder or run folder from `tellkit train configs/vg/...` (its best checkpoint); "
                   f"default {DEFAULT_RUN} (where `tellkit train configs/vg/how2_bart.yaml` writes)")
    p.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's eval.beam_size (5)")
    p.add_argument("--max-len", type=int, default=None, help="maximum summary tokens (default: eval.max_len, 64)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the bare summary")


def run(args) -> int:
    from tellkit.pipelines.summarization import Summarizer  # heavy

    tpath = Path(args.transcript)
    transcript = read_text_file(tpath, "--transcript")
    if not transcript.split():
        raise TellkitError(f"--transcript: {tpath} is empty")
    if args.checkpoint is None and not Path(DEFAULT_RUN).exists():
        raise TellkitError(
            f"no --checkpoint given and no {DEFAULT_RUN}/ here: train one with "
            "`tellkit train configs/vg/how2_bart.yaml` or pass --checkpoint DIR"
        )
    summarizer = Summarizer.load(args.checkpoint or DEFAULT_RUN, device=args.device,
                                 beam_size=args.beam_size, max_len=args.max_len)
    if summarizer.uses_video and not args.features:
        raise TellkitError("this model fuses video: pass --features FILE.npy (float32, shape (T, 2048))")
    out = summarizer.summarize(transcript, args.features)
    if out["video_ignored"]:
        print("tellkit summarize: note: the model is text-only, --features is ignored", file=sys.stderr)
    if args.json:
        print(json.dumps({"summary": out["summary"], "checkpoint": summarizer.info["checkpoint"],
                          "frames": out["frames"]}))
    else:
        print(out["summary"])
    return 0
