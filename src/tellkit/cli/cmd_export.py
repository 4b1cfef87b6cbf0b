"""`tellkit export SRC --out DIR`: a training checkpoint (or run folder) as a compact inference
checkpoint: weights (float16 unless --float32), config and recipe sections, no optimizer or
trainer state. This is how packaged default models are made."""
from __future__ import annotations

NAME = "export"
HELP = "write a training checkpoint (or a run's best) as a compact inference checkpoint (float16 weights)"


def add_arguments(p) -> None:
    p.add_argument("src", help="a checkpoint folder, or a run folder of tellkit train (its best checkpoint)")
    p.add_argument("--out", required=True, help="the new checkpoint folder (must not exist or be empty)")
    p.add_argument("--float32", action="store_true", help="keep float32 weights (twice the size)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                   help="provenance stored under 'note' in config.json, repeatable (e.g. trained_on=crohme)")
    p.add_argument("--replace", action="store_true",
                   help="replace an existing checkpoint folder at --out (swapped in once written; "
                   "its other files, e.g. a README, are kept)")


def _notes(items: list[str]) -> dict[str, str]:
    from tellkit.errors import TellkitError

    notes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TellkitError(f"--note {item!r}: expected KEY=VALUE")
        notes[key.strip()] = value
    return notes


def run(args) -> int:
    import shutil
    from pathlib import Path

    from tellkit.checkpoint import CONFIG_NAME, resolve_checkpoint
    from tellkit.errors import TellkitError
    from tellkit.training.export import export_checkpoint

    notes = _notes(args.note)
    src = resolve_checkpoint(args.src)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TellkitError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not args.replace:
            raise TellkitError(f"{out}: not empty (use --replace to replace a checkpoint folder)")
        if not (out / CONFIG_NAME).is_file():
            raise TellkitError(f"{out}: not a checkpoint folder (no {CONFIG_NAME}); refusing to replace it")
    if out.resolve() == src or src in out.resolve().parents:
        raise TellkitError(f"{out}: inside the checkpoint being exported")
    # write beside the target, then swap: an interrupted export leaves the old folder intact
    staging = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        export_checkpoint(src, staging, half=not args.float32, note=notes or None)
        kept = []
        if out.is_dir():  # files of the old folder that the export does not write (a README) stay
            for f in sorted(out.iterdir()):
                if not (staging / f.name).exists():
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, staging / f.name)
                    kept.append(f.name)
            old = out.with_name(out.name + ".export-old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1e6:.1f} MB, {'float32' if args.float32 else 'float16'} weights) from {src}")
    if kept:
        print(f"kept from the replaced folder: {', '.join(kept)} (they may describe the old model)")
    return 0
