"""The ``tellkit`` command. Subcommands live in ``tellkit/cli/cmd_<name>.py`` and are found
automatically; each module defines::

    NAME = "model-info"                 # the subcommand
    HELP = "one line for --help"
    def add_arguments(parser): ...     # argparse options
    def run(args) -> int: ...          # heavy imports go inside run()

A :class:`tellkit.errors.TellkitError` raised anywhere becomes a one-line message on stderr
and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import errno
import glob
import importlib
import math
import os
import pkgutil
import sys
from pathlib import Path

# PyTorch reads this switch once, as it starts (the command imports torch only after this line):
# CPU tensors of 2 MB and more are then allocated on 2 MB boundaries and marked for transparent
# huge pages. Writing a fresh large tensor (a context's keys/values, an activation) then takes
# about a quarter of the page faults' time, and reading it misses the TLB less. A value already
# in the environment (0 to turn it off) is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tellkit._version import __version__
from tellkit.errors import TellkitError
from tellkit.utils.files import read_text


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


MAX_TEXT_BYTES = 64 * 2**20


def read_text_file(path, what: str) -> str:
    """A regular UTF-8 text file named by option ``what`` (not a folder, FIFO or device; at most
    64 MiB), or a one-line :class:`TellkitError`."""
    return read_text(path, what, MAX_TEXT_BYTES)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
GLOB_CHARS = set("*?[")


def expand_inputs(args: list[str], suffixes: tuple[str, ...], what: str = "inputs") -> list[str]:
    """The input files named on the command line, in order: a file as given, a folder's files
    whose suffix is one of ``suffixes`` (sorted by name), a glob pattern's matches (sorted).
    A folder without such files or a pattern without matches is a one-line error."""
    out: list[str] = []
    for arg in args:
        try:
            out += _expand_one(arg, suffixes, what)
        except OSError as exc:  # a name too long, a folder that cannot be listed
            raise TellkitError(f"{display(arg)}: cannot read ({exc.strerror or exc})") from None
    if not out:
        raise TellkitError(f"no {what} given")
    return out


def display(path) -> str:
    """A path (or a message naming one) as text that prints anywhere and is valid UTF-8 JSON:
    bytes that are not UTF-8 (a file name from another system's encoding, which Python keeps as
    surrogates) shown as U+FFFD."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # other lone surrogates
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _expand_one(arg: str, suffixes: tuple[str, ...], what: str) -> list[str]:
    p = Path(arg)
    if p.is_dir():
        found = sorted(str(f) for f in p.iterdir() if f.is_file() and f.suffix.lower() in suffixes)
        if not found:
            raise TellkitError(f"{display(arg)}: no {what} in this folder ({', '.join(suffixes)})")
        return found
    if GLOB_CHARS & set(arg) and not p.exists():
        found = sorted(f for f in glob.glob(arg) if Path(f).is_file())
        if not found:
            raise TellkitError(f"{display(arg)}: no file matches this pattern")
        return found
    return [arg]


def add_model_arguments(p, default_help: str, dtype: bool = True) -> None:
    """``--model`` (and the hidden ``--checkpoint``), ``--device``, ``--dtype``, ``--batch-size``."""
    p.add_argument("--model", metavar="DIR", help=f"checkpoint or run folder (default: {default_help})")
    p.add_argument("--checkpoint", dest="model", help=argparse.SUPPRESS)
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    if dtype:
        add_dtype_argument(p)
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="inputs per batch (default: the checkpoint's evaluation batch size)")


def add_encoder_argument(p) -> None:
    p.add_argument("--encoder", action="append", default=[], metavar="KEY=VALUE",
                   help="replace a key of the checkpoint's encoders section, e.g. article=DIR (a local RoBERTa-large "
                        "folder), image_weights=FILE, face_weights=FILE (repeatable)")


def encoder_overrides(values: list[str]) -> dict[str, str]:
    """``--encoder KEY=VALUE`` flags -> {key: value} (the encoders section refuses unknown keys)."""
    out: dict[str, str] = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep or not key.strip() or not value.strip() or "." in key:
            raise TellkitError(f"--encoder expects KEY=VALUE (e.g. article=DIR), got '{v}'")
        out[key.strip()] = value.strip()
    return out


def add_dtype_argument(p) -> None:
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="bf16: search in bfloat16 autocast where the device computes it natively (float32 "
                        "elsewhere, with a note); default fp32")


def add_runtime_argument(p) -> None:
    p.add_argument("--runtime", choices=("torch", "onnx"), default=None,
                   help="onnx: run the model's ONNX graphs with ONNX Runtime (CPU, float32; same processor and "
                        "search; a checkpoint that is not a `tellkit export --format onnx` folder is exported once "
                        "into ~/.cache/tellkit/onnx; needs the onnx extra); default torch")


def note_dtype(command: str, info: dict) -> None:
    """The reason a requested dtype was not granted, on stderr."""
    if info.get("dtype_note"):
        print(f"tellkit {command}: note: {info['dtype_note']}", file=sys.stderr)


# what the file system answers about a path a person named (never a fault of tellkit's own)
_FILE_ERRORS = {errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ELOOP}


def _commands():
    mods = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            mods.append(importlib.import_module(f"tellkit.cli.{info.name}"))
    return mods


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse's own convention)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tellkit", description="Transformers that write text from images in context.")
    parser.add_argument("--version", action="version", version=f"tellkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for mod in _commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides may also follow the options: `evaluate CK --data D data.test=2016`
        all_overrides = all("=" in e and not e.startswith("-") for e in extra)
        if isinstance(getattr(args, "overrides", None), list) and all_overrides:
            args.overrides = args.overrides + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except TellkitError as exc:
        print(f"tellkit {args.command}: error: {display(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in _FILE_ERRORS:
            raise
        # a path the person named that the system refuses: too long, no permission, read-only
        where = f"{display(exc.filename)}: " if exc.filename else ""
        print(f"tellkit {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tellkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
