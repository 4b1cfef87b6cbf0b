"""`tellkit curve RUN_DIR`: validation metrics of a training run against epochs, read from the
run's ``eval_log.csv``: JSON (default), a Markdown table, and optionally a PNG plot."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from tellkit.errors import TellkitError

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
    p.add_argument("--format", choices=["json", "markdown"], default="json", help="what to print")


def read_eval_log(run) -> list[dict]:
    """Rows of ``RUN/eval_log.csv`` as dicts with int step/epoch and float value."""
    path = Path(run) / "eval_log.csv"
    if not path.is_file():
        raise TellkitError(f"{run}: no eval_log.csv (not a `tellkit train` run folder, or not validated yet)")
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
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
    except UnicodeDecodeError:
        try:  # the decoder's position is within its chunk: find the byte in the whole file
            path.read_bytes().decode("utf-8")
            at = ""
        except UnicodeDecodeError as exc:
            at = f" (byte {exc.start})"
        raise TellkitError(f"{path}: not UTF-8 text{at}; expected the CSV log `tellkit train` writes") from None
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
    if args.png:
        check_png_path(Path(args.png))
        from tellkit.checkpoint import atomic_write_bytes  # heavy
        from tellkit.utils.plot import line_chart  # heavy

        series = {m: [(e[args.x], e[m]) for e in table if m in e] for m in metrics}
        img = line_chart(series, title=args.title or Path(args.run).name,
                         xlabel="epoch" if args.x == "epoch" else "optimizer step", ylabel=", ".join(metrics))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        try:
            Path(args.png).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(Path(args.png), buf.getvalue())
        except OSError as exc:
            raise TellkitError(f"{args.png}: cannot write the plot ({exc.strerror or exc})") from None
    if args.format == "markdown":
        print("| epoch | step | " + " | ".join(metrics) + " |")
        print("|---:|---:|" + "---:|" * len(metrics))
        for e in table:
            vals = " | ".join(f"{e[m]:.2f}" if m in e else "" for m in metrics)
            print(f"| {e['epoch']} | {e['step']} | {vals} |")
    else:
        print(json.dumps({"run": str(args.run), "metrics": metrics, "evaluations": table,
                          **({"png": args.png} if args.png else {})}, indent=2))
    return 0
