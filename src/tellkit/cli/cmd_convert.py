"""`tellkit convert SRC --out DIR`: import a reference implementation's checkpoint."""
from __future__ import annotations

from tellkit.errors import TellkitError

NAME = "convert"
HELP = ("import an official checkpoint (BTTR Lightning .ckpt, Transform and Tell best.th) into a tellkit folder, "
        "or (--to reference) export a tellkit BTTR as a reference .ckpt")


def add_arguments(p) -> None:
    p.add_argument("src", help="the reference checkpoint file (.ckpt, .th, .pt or .safetensors); with "
                   "--to reference, a tellkit checkpoint folder")
    p.add_argument("--out", required=True, help="new tellkit checkpoint folder (must not exist or be empty); with "
                   "--to reference, a new .ckpt file")
    p.add_argument("--to", choices=["tellkit", "reference"], default="tellkit",
                   help="direction: into tellkit (default) or out to the reference implementation's format")
    p.add_argument("--family", help="model family (default: recognised from the tensor names)")
    p.add_argument("-o", "--option", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a converter option, repeatable (BTTR: dictionary=dictionary.txt, nhead=8)")


def run(args) -> int:
    from tellkit.config import parse_overrides  # heavy
    from tellkit.convert import convert_checkpoint, export_checkpoint  # heavy

    if args.to == "reference":
        if args.options or args.family:
            raise TellkitError("--to reference takes no -o options or --family (all is read from the checkpoint)")
        print(f"wrote {export_checkpoint(args.src, args.out)}")
        return 0

    out = convert_checkpoint(args.src, args.out, family=args.family, **parse_overrides(args.options))
    print(f"wrote {out}")
    return 0
