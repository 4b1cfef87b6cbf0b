"""`tellkit average SRC [SRC ...] --out DIR`: the element-wise mean of the weights of several
checkpoints of one model (checkpoint averaging / stochastic weight averaging) as a compact
inference checkpoint, like ``tellkit export`` writes. ``--last N`` takes the states of the N
newest saved steps of one run folder (train it with ``--keep-checkpoints`` so that they are kept)."""
from __future__ import annotations

from pathlib import Path

from tellkit.cli import positive_int
from tellkit.cli.cmd_export import add_output_arguments
from tellkit.errors import TellkitError
from tellkit.utils.files import check_output_path
from tellkit.utils.runlock import pruned_while_reading, reading_states

NAME = "average"
HELP = "average the weights of several checkpoints of one model into one inference checkpoint"


def add_arguments(p) -> None:
    p.add_argument("src", nargs="+",
                   help="checkpoint folders (a run folder stands for its best), or with --last one run folder")
    p.add_argument("--last", type=positive_int, default=None, metavar="N",
                   help="average the states of the N newest saved steps of the run folder SRC (at least 2)")
    add_output_arguments(p)


def sources(src: list[str], last: int | None) -> list:
    from tellkit.checkpoint import resolve_checkpoint  # heavy
    from tellkit.training.run_states import CheckpointManager  # heavy

    if last is None:
        if len(src) < 2:
            raise TellkitError("give two or more checkpoints, or one run folder with --last N")
        found = [resolve_checkpoint(s) for s in src]
    else:
        if len(src) != 1:
            raise TellkitError(f"--last takes one run folder, got {len(src)} paths")
        run = Path(src[0])
        if not (run / "checkpoints").is_dir():
            raise TellkitError(f"{run}: not a run folder of tellkit train (no checkpoints/)")
        if last < 2:
            raise TellkitError(f"--last {last}: averaging needs at least 2 states")
        states = CheckpointManager(run).newest_steps(last)
        if len(states) < last:
            raise TellkitError(f"--last {last}: {run} holds states of {len(states)} step(s) only "
                               "(train with --keep-checkpoints N to keep more)")
        found = [p.resolve() for p in reversed(states)]  # oldest first
    dupes = sorted({str(p) for p in found if found.count(p) > 1})
    if dupes:
        raise TellkitError(f"the same checkpoint is given twice: {dupes[0]}")
    return found


def run(args) -> int:
    from tellkit.cli.cmd_export import notes_from, report  # heavy
    from tellkit.export.folder import write_checkpoint_folder  # heavy
    from tellkit.export.safetensors import average_checkpoints, source_name  # heavy

    notes = notes_from(args.note)
    out = check_output_path(args.out, "--out", folder=True)  # a looping link, /proc, a file: before any work
    with reading_states(args.src[0]):  # a run being trained prunes none of its states meanwhile
        found = sources(args.src, args.last)
        try:
            kept = write_checkpoint_folder(
                out, lambda d: average_checkpoints(found, d, weights=args.weights, note=notes or None),
                replace=args.replace, sources=found)
        except TellkitError as exc:
            raise next(filter(None, (pruned_while_reading(p, exc) for p in found)), exc) from None
    names = ", ".join(source_name(p) for p in found)
    report(out, f"the mean of {len(found)} checkpoints: {names}", args.weights, kept)
    return 0
