"""`tellkit caption --image IMG [--article TXT] [--checkpoint DIR] [--json]`: caption one image.

Without ``--checkpoint`` the packaged default model is used; any captioning checkpoint works
(Transform and Tell, Show and Tell, Show-Attend-and-Tell, the LSTM captioner); it runs through
:class:`tellkit.pipelines.captioning.CaptioningPipeline`. Decoding follows the checkpoint's
generation settings (its recipe's ``eval:`` section) unless ``--beam-size`` / ``--max-len`` say
otherwise. ``--json`` prints the caption with the detected faces and, for every generated token,
its attention (mean over heads and layers) over the image grid cells, the article tokens and the
faces (and, for models that read objects, how many object vectors there were: none for a new
image, as no object detector ships). The image is decoded by
:func:`tellkit.utils.images.open_image` (through ``encoders.preprocess.load_image``): format and
pixel count are checked from the header, so a decompression bomb or an EPS file is refused
before any pixel is decoded or any model loads. Bad input (missing, empty, corrupt or truncated
image, a directory, a refused format, more pixels than ``TELLKIT_MAX_IMAGE_PIXELS``, an empty or
non-UTF-8 article) is a one-line error with exit status 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tellkit.errors import TellkitError

NAME = "caption"
HELP = "caption an image (optionally with its article) with a Transform and Tell or baseline checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--image", required=True, help="the image file (JPEG, PNG, ...)")
    p.add_argument("--article", help="a UTF-8 text file with the article (title and paragraphs)")
    p.add_argument("--checkpoint", help="checkpoint or run folder (default: the packaged default model)")
    p.add_argument("--json", action="store_true", help="print JSON: caption, faces, per-token attention")
    p.add_argument("--beam-size", type=int, default=None,
                   help="beam width, 1 = greedy (default: the checkpoint's eval.beam_size)")
    p.add_argument("--max-len", type=int, default=None, help="most caption tokens (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def read_article(path: str) -> str:
    p = Path(path)
    if not p.exists():
        raise TellkitError(f"{p}: article not found")
    if p.is_dir():
        raise TellkitError(f"{p}: is a directory, expected a text file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TellkitError(f"{p}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise TellkitError(f"{p}: cannot read ({exc.strerror})") from None
    text = text.lstrip("\ufeff")
    if not text.strip():
        raise TellkitError(f"{p}: the article is empty")
    return text


def resolve_default(checkpoint: str | None):
    from tellkit.recipes import packaged_default  # heavy

    if checkpoint:
        return checkpoint
    default = packaged_default("caption")
    if default is None:
        raise TellkitError("no default captioning model is installed; pass --checkpoint DIR (train one: tellkit "
                           "train configs/baselines/flickr8k_papers/show_attend_tell_banded.yaml data.root=DIR)")
    return str(default)


def run(args) -> int:
    from tellkit.encoders.preprocess import load_image  # heavy

    if (args.beam_size is not None and args.beam_size < 1) or (args.max_len is not None and args.max_len < 1):
        raise TellkitError("--beam-size and --max-len must be at least 1")
    # check every input before the (slow) model and encoders load
    image = load_image(args.image)
    article = read_article(args.article) if args.article else ""
    checkpoint = resolve_default(args.checkpoint)

    from tellkit.pipelines.captioning import CaptioningPipeline  # heavy

    captioner = CaptioningPipeline.load(checkpoint, device=args.device, beam_size=args.beam_size, max_len=args.max_len)
    result = captioner.caption([(image, article)])[0]
    if args.json:
        print(json.dumps({"image": args.image, "article": args.article, "checkpoint": checkpoint,
                          "model": captioner.info, **result}, ensure_ascii=False))
    else:
        print(result["caption"])
        if "objects" in result and result["objects"]["count"] == 0:
            print(f"note: {result['objects'].get('note', 'the objects context is empty')}", file=sys.stderr)
    return 0
