"""`tellkit recognize IMAGE [IMAGE ...] [--model CKPT] [--json]`: handwritten math -> LaTeX (BTTR)."""
from __future__ import annotations

import json

from tellkit.cli import positive_float, positive_int
from tellkit.errors import TellkitError

NAME = "recognize"
HELP = "recognise handwritten math expression images and print their LaTeX (BTTR)"


def add_arguments(p) -> None:
    p.add_argument("images", nargs="+",
                   help="image files (PNG/JPEG/BMP; dark ink on a light background or the reverse)")
    p.add_argument("--model", help="BTTR checkpoint or run folder (default: the packaged model)")
    p.add_argument("--json", action="store_true", help="one JSON object per image: image, latex, tokens, score")
    p.add_argument("--beam-size", type=int, default=None,
                   help="beam size per direction (default: the checkpoint's, 10)")
    p.add_argument("--max-len", type=int, default=None, help="maximum output tokens (default 200)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="images per search batch (default 8)")
    p.add_argument("--stroke-size", type=positive_float, default=None, metavar="PX",
                   help="read at this median stroke size in pixels (default: the checkpoint's "
                        "data.render.stroke_size; the packaged model's is 22)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def run(args) -> int:
    from tellkit.pipelines.recognition import Recognizer  # heavy

    if args.beam_size is not None and args.beam_size < 1:
        raise TellkitError("--beam-size must be >= 1")
    if args.max_len is not None and args.max_len < 1:
        raise TellkitError("--max-len must be >= 1")
    rec = Recognizer.load(args.model, device=args.device, stroke_size=args.stroke_size)
    results = rec.recognize(args.images, batch_size=max(1, args.batch_size), beam_size=args.beam_size,
                            max_len=args.max_len)
    for path, r in zip(args.images, results):
        if args.json:
            print(json.dumps({"image": path, **r}, ensure_ascii=False))
        elif len(args.images) > 1:
            print(f"{path}\t{r['latex']}")
        else:
            print(r["latex"])
    return 0
