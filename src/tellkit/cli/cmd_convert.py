"""`tellkit convert SRC --out DIR`: import a reference implementation's checkpoint.

``--to reference`` (export a tellkit checkpoint to the reference's format) is a deprecated
spelling of ``tellkit export --format reference``: it still works and says so."""
from __future__ import annotations

import sys

from tellkit.errors import TellkitError

NAME = "convert"
HELP = "import an official checkpoint (BTTR or CoMER Lightning .ckpt, Transform and Tell best.th) into a tellkit folder"


def add_arguments(p) -> None:
    p.add_argument("src", help="the reference checkpoint file (.ckpt, .th, .pt or .safetensors); with "
                   "--to reference, a tellkit checkpoint folder")
    p.add_argument("--out", required=True, help="new tellkit checkpoint folder (must not exist or be empty); with "
                   "--to reference, a new .ckpt file")
    p.add_argument("--to", choices=["tellkit", "reference"], default="tellkit",
                   help="direction: into tellkit (default); reference: deprecated, use tellkit export --format "
                        "reference")
    p.add_argument("--family", help="model family (default: recognised from the tensor names)")
    p.add_argument("-o", "--option", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a converter option, repeatable (BTTR: dictionary=dictionary.txt, nhead=8)")


def run(args) -> int:
    from tellkit.config import parse_overrides  # heavy
    from tellkit.convert import convert_checkpoint  # heavy

    if args.to == "reference":
        from tellkit.export.reference import export_reference  # heavy

        print("tellkit: convert --to reference is deprecated; use tellkit export --format reference", file=sys.stderr)
        if args.options or args.family:
            raise TellkitError("--to reference takes no -o options or --family (all is read from the checkpoint)")
        print(f"wrote {export_reference(args.src, args.out)}")
        return 0

    out = convert_checkpoint(args.src, args.out, family=args.family, **parse_overrides(args.options))
    print(f"wrote {out}")
    return 0
