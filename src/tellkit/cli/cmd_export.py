"""`tellkit export SRC --format safetensors|onnx|reference --out OUT`: a checkpoint (or a run
folder's best) written out in another form, one module of :mod:`tellkit.export` per format.

- ``safetensors`` (default): a compact inference checkpoint: weights (float16 unless --float32
  or --int8), config and recipe sections, no optimizer or trainer state. This is how packaged
  default models are made.
- ``onnx``: the checkpoint with its model as ONNX graphs (the encoder, one decoder step with its
  state as inputs and outputs; BTTR and Show, Attend and Tell) for `--runtime onnx`.
- ``reference``: the reference implementation's checkpoint file (BTTR's Lightning ``.ckpt``)."""
from __future__ import annotations

import argparse
import sys

from tellkit.errors import TellkitError
from tellkit.export import FORMATS
from tellkit.utils.files import check_output_path
from tellkit.utils.runlock import pruned_while_reading, reading_states

NAME = "export"
HELP = ("write a checkpoint (or a run's best) as a compact inference checkpoint (float16 weights), "
        "as ONNX graphs, or as the reference implementation's .ckpt")
OLD_FORMATS = {"checkpoint": "safetensors"}  # accepted with a deprecation line, never listed


def export_format(text: str) -> str:
    """A --format value: one of FORMATS (what --help lists), or a deprecated name of one."""
    if text in FORMATS or text in OLD_FORMATS:
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(FORMATS)})")


def add_arguments(p) -> None:
    p.add_argument("src", help="a checkpoint folder, or a run folder of tellkit train (its best checkpoint)")
    p.add_argument("--format", type=export_format, metavar="{" + ",".join(FORMATS) + "}", default="safetensors",
                   help="safetensors (default): a compact tellkit checkpoint folder; onnx: the checkpoint as it is, "
                        "with its model as ONNX graphs for --runtime onnx (needs the onnx extra); reference: the "
                        "reference implementation's checkpoint file (BTTR), --out names the new .ckpt")
    p.add_argument("--ema", action="store_true",
                   help="export the moving average of the weights the state carries (train.ema) instead of "
                        "its raw weights (--format safetensors)")
    add_output_arguments(p)


def add_output_arguments(p) -> None:
    """--out, --float32 / --int8 (args.weights), --note and --replace (shared with tellkit average)."""
    p.add_argument("--out", required=True, help="the new checkpoint folder (must not exist or be empty); "
                   "with --format reference, the new .ckpt file")
    dtype = p.add_mutually_exclusive_group()  # one stored weights type, float16 unless one of these
    p.set_defaults(weights="float16")
    dtype.add_argument("--float32", dest="weights", action="store_const", const="float32",
                       help="keep float32 weights (twice the size)")
    dtype.add_argument("--int8", dest="weights", action="store_const", const="int8",
                       help="weight matrices as int8 with one float32 scale per row (about half of float16; "
                       "loading restores float32; check the model's scores after)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                   help="provenance stored under 'note' in config.json, repeatable (e.g. trained_on=crohme)")
    p.add_argument("--replace", action="store_true",
                   help="replace an existing checkpoint folder at --out (swapped in once written; "
                   "its other files, e.g. a README, are kept)")


def notes_from(items: list[str]) -> dict[str, str]:
    notes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TellkitError(f"--note {item!r}: expected KEY=VALUE")
        notes[key.strip()] = value
    return notes


def run(args) -> int:
    from tellkit.checkpoint import resolve_checkpoint  # heavy
    from tellkit.export.folder import write_checkpoint_folder  # heavy
    from tellkit.export.safetensors import export_safetensors  # heavy

    fmt = OLD_FORMATS.get(args.format, args.format)
    if fmt != args.format:
        print(f"tellkit: --format {args.format} is now --format {fmt}", file=sys.stderr)
    notes = notes_from(args.note)
    if args.ema and fmt != "safetensors":
        raise TellkitError("--ema: the averaged weights export with --format safetensors")
    if fmt == "reference":
        return export_reference_file(args, notes)
    out = check_output_path(args.out, "--out", folder=True)  # a looping link, /proc, a file: before any work
    with reading_states(args.src):  # a run being trained prunes no state meanwhile
        src = resolve_checkpoint(args.src)
        try:
            if fmt == "onnx":
                return export_onnx_folder(args, src, out, notes)
            kept = write_checkpoint_folder(
                out, lambda d: export_safetensors(src, d, weights=args.weights, note=notes or None,
                                                  average=args.ema),
                replace=args.replace, sources=[src])
        except TellkitError as exc:
            raise pruned_while_reading(src, exc) or exc from None
    report(out, src, args.weights, kept)
    return 0


def export_reference_file(args, notes) -> int:
    from tellkit.checkpoint import resolve_checkpoint  # heavy
    from tellkit.export.reference import export_reference  # heavy

    if args.weights != "float16" or notes or args.replace:
        raise TellkitError("--format reference writes the checkpoint's weights as the reference stores them "
                           "(--float32, --int8, --note and --replace are for --format safetensors)")
    out = check_output_path(args.out, "--out")
    with reading_states(args.src):  # a run being trained prunes no state meanwhile
        src = resolve_checkpoint(args.src)
        try:
            print(f"wrote {export_reference(src, out)}")
        except TellkitError as exc:
            raise pruned_while_reading(src, exc) or exc from None
    return 0


def report(out, made_from, weights: str, kept: list[str]) -> None:
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB, {weights} weights) from {made_from}")
    if kept:
        print(f"kept from the replaced folder: {', '.join(kept)} (they may describe the old model)")


def export_onnx_folder(args, src, out, notes) -> int:
    from tellkit.checkpoint import read_checkpoint_config  # heavy
    from tellkit.export.folder import write_checkpoint_folder  # heavy
    from tellkit.export.onnx import check_exportable, export_onnx  # heavy

    if args.weights != "float16" or notes:
        raise TellkitError("--format onnx keeps the checkpoint's weights and notes as they are "
                           "(--float32, --int8 and --note are for --format safetensors)")
    check_exportable(read_checkpoint_config(src), str(src))
    kept = write_checkpoint_folder(out, lambda d: export_onnx(src, d), replace=args.replace, sources=[src])
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.suffix == ".onnx")
    print(f"wrote {out} (ONNX graphs {size / 1e6:.1f} MB, and the checkpoint) from {src}")
    if kept:
        print(f"kept from the replaced folder: {', '.join(kept)} (they may describe the old model)")
    return 0
