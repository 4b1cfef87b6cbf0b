"""`tellkit curve RUN_DIR`: validation metrics of a training run against epochs, read from the
run's ``eval_log.csv``: JSON (default), a Markdown table, and optionally a PNG plot (matplotlib,
the ``plot`` extra: one panel per kind of quantity, the chosen evaluation marked). Values that
are not finite (a diverged loss logged as nan or inf) are null in the JSON and left out of the
plot, with a line on stderr saying which."""
from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path

from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_bytes, read_text

MAX_LOG_BYTES = 256 << 20  # a validation log of years of training is a few MB

NAME = "curve"
HELP = "validation metrics of a training run against epochs (JSON, Markdown table, PNG plot)"


def add_arguments(p) -> None:
    p.add_argument("run", help="run folder written by `tellkit train` (holds eval_log.csv)")
    p.add_argument("--metric", action="append", default=None,
                   help="metric to report (repeatable; default: every metric of the log)")
    p.add_argument("--x", choices=["epoch", "step"], default="epoch",
                   help="x axis: completed epochs (default) or optimizer steps")
    p.add_argument("--png", default=None, help="also write the curve as a PNG to this path")
    p.add_argument("--title", default=None, help="title of the PNG (default: the run folder's name)")
    p.add_argument("--chosen-step", type=int, default=None,
                   help="the evaluation to mark as chosen (default: the run's best step, from its last checkpoint)")
    p.add_argument("--format", choices=["json", "markdown"], default="json", help="what to print")


def read_eval_log(run) -> list[dict]:
    """Rows of ``RUN/eval_log.csv`` as dicts with int step/epoch and float value."""
    path = Path(run) / "eval_log.csv"
    if not path.exists() and not path.is_symlink():
        raise TellkitError(f"{run}: no eval_log.csv (not a `tellkit train` run folder, or not validated yet)")
    rows = []
    text = read_text(path, "eval_log.csv", MAX_LOG_BYTES)  # a regular file, UTF-8, of a bounded size
    try:
        with io.StringIO(text, newline="") as f:
            reader = csv.DictReader(f)
            need = {"step", "epoch", "metric", "value"}
            if not need <= set(reader.fieldnames or []):
                raise TellkitError(f"{path}: expected columns {sorted(need)}, found {reader.fieldnames}")
            for i, r in enumerate(reader, 2):
                try:
                    rows.append({"step": int(r["step"]), "epoch": int(r["epoch"]), "metric": r["metric"],
                                 "value": float(r["value"])})
                except (TypeError, ValueError):
                    raise TellkitError(f"{path}, line {i}: not a number in {r}") from None
    except csv.Error as exc:
        raise TellkitError(f"{path}: not a readable CSV log ({exc})") from None
    return rows


def check_png_path(png: Path) -> None:
    """--png names a file: not an existing folder, nor under a file."""
    if png.is_dir():
        raise TellkitError(f"{png}: is a folder; --png takes the path of the PNG file to write "
                           f"(e.g. {png / 'curve.png'})")
    for parent in png.parents:
        if parent.exists():
            if not parent.is_dir():
                raise TellkitError(f"{png}: {parent} is a file, not a folder")
            return


def chosen_step(run) -> int | None:
    """The step of the best evaluation, as the run's last checkpoint records it (None when it
    has none yet, or no checkpoint)."""
    state = Path(run) / "checkpoints" / "last" / "trainer_state.json"
    try:
        step = json.loads(state.read_text(encoding="utf-8")).get("best_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def non_finite(table: list[dict], metrics: list[str]) -> list[str]:
    """'metric at step S (value)' for every value that is nan or infinite."""
    return [f"{m} at step {e['step']} ({e[m]})" for e in table for m in metrics
            if m in e and not math.isfinite(e[m])]


def write_png(args, table: list[dict], metrics: list[str]) -> int | None:
    """Draws the curve into ``args.png``; returns the step marked as chosen (or None)."""
    check_png_path(Path(args.png))
    from tellkit.utils.plot import curve_figure, figure_png  # heavy

    step = args.chosen_step if args.chosen_step is not None else chosen_step(args.run)
    if step is not None and not any(e["step"] == step for e in table):
        if args.chosen_step is not None:
            raise TellkitError(f"--chosen-step {step}: no evaluation at that step in {args.run}/eval_log.csv "
                               f"(steps: {', '.join(str(e['step']) for e in table)})")
        print(f"tellkit curve: the run's chosen step {step} has no row in eval_log.csv; nothing is marked",
              file=sys.stderr)
        step = None
    try:
        fig = curve_figure(table, metrics, x=args.x, title=args.title or Path(args.run).resolve().name,
                           chosen_step=step)
    except ValueError as exc:
        raise TellkitError(f"{args.run}: {exc}") from None
    try:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(args.png), figure_png(fig))
    except OSError as exc:
        raise TellkitError(f"{args.png}: cannot write the plot ({exc.strerror or exc})") from None
    return step


def run(args) -> int:
    rows = read_eval_log(args.run)
    found = list(dict.fromkeys(r["metric"] for r in rows))
    metrics = args.metric or found
    missing = [m for m in metrics if m not in found]
    if missing:
        raise TellkitError(f"{args.run}: no validation values for {missing} (the log has {found or 'none'})")
    # one point per evaluation: an evaluation is identified by its step; epoch counts completed epochs
    evals: dict[int, dict] = {}
    for r in rows:
        if r["metric"] in metrics:
            e = evals.setdefault(r["step"], {"step": r["step"], "epoch": r["epoch"]})
            e[r["metric"]] = r["value"]
    table = [evals[s] for s in sorted(evals)]
    bad = non_finite(table, metrics)
    if args.png and len(bad) == sum(m in e for e in table for m in metrics):
        raise TellkitError(f"{args.run}: nothing to plot: every value of {', '.join(metrics)} is nan or infinite")
    if bad:
        where = "; ".join((["left out of the plot"] if args.png else [])
                          + ["null in the JSON" if args.format == "json" else "shown as they are in the table"])
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        print(f"tellkit curve: {len(bad)} value(s) not finite ({where}): {shown}", file=sys.stderr)
    marked = write_png(args, table, metrics) if args.png else None
    if args.format == "markdown":
        print("| epoch | step | " + " | ".join(metrics) + " |")
        print("|---:|---:|" + "---:|" * len(metrics))
        for e in table:
            vals = " | ".join(f"{e[m]:.2f}" if m in e else "" for m in metrics)
            print(f"| {e['epoch']} | {e['step']} | {vals} |")
    else:
        safe = [{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in e.items()}
                for e in table]
        print(json.dumps({"run": str(args.run), "metrics": metrics, "evaluations": safe,
                          **({"png": args.png, "chosen_step": marked} if args.png else {})}, indent=2,
                         allow_nan=False))
    return 0
