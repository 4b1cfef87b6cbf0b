"""`tellkit table CONFIG... [--data PATH] [--budget STEPS] [--out DIR]`: train and evaluate
each recipe with the generic trainer and evaluator, then print one table (rows = recipes,
columns = the paper's metrics) as Markdown and write it as JSON, like Table 4 of Transform and
Tell.

    tellkit table configs/baselines/flickr8k/*.yaml --budget 150 --out runs/table_flickr8k
    tellkit table configs/baselines/nytimes/*.yaml --data /data/nytimes800k.archive.gz

Each recipe trains into ``OUT/<recipe name>/`` (``tellkit train``'s run folder) and its best
checkpoint is scored on ``--split`` (``OUT/<name>/eval/metrics_<split>.json``). ``--budget``
caps the optimizer steps of every row (``train.max_steps``); ``key=value`` overrides
(``--set``) apply to every row. Interrupt it at any time and run the same command again: a row
whose evaluation file exists is read back, an unfinished row resumes from its newest saved
state (saved every 10 minutes and at each validation); ``--rerun`` starts rows over. The row
label is the recipe's top-level ``row:`` (else its file name); a recipe's ``published:`` block
(``source``, ``encoder``, metric numbers) is printed as a line under its row, so that the
paper's figures stand beside the measured ones. ``OUT/table.json`` holds every metric of every
row, ``OUT/table.md`` the printed table. The work (training rows, the table itself) is
``tellkit.workflows.table.table_row``.

Captioning rows: rows whose contexts the task's disk cache cannot hold (per-caption contexts such as
Flickr8k's ``other_captions``) are encoded once per image / text in memory and shared
by all rows of the run.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_bytes, atomic_write_json

NAME = "table"
HELP = "train + evaluate several recipes on one data set and print a results table (Markdown + JSON)"

# metric key -> column title, per task (the papers' tables)
COLUMNS = {
    "caption": [("bleu4", "BLEU-4"), ("rouge_l", "ROUGE"), ("meteor", "METEOR"), ("cider", "CIDEr"),
                ("entities_precision", "NE P"), ("entities_recall", "NE R"),
                ("person_precision", "Names P"), ("person_recall", "Names R"),
                ("rare_proper_nouns_precision", "Rare P"), ("rare_proper_nouns_recall", "Rare R"),
                ("length", "Len"), ("ttr", "TTR")],
    "summarize": [("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"),
                  ("bleu4", "BLEU-4"), ("meteor", "METEOR"), ("cider", "CIDEr"), ("content_f1", "Content F1")],
}


def add_arguments(p) -> None:
    p.add_argument("configs", nargs="+", help="YAML recipes (paths or names under configs/), one row each")
    p.add_argument("--data", help="data location for every row (sets data.root)")
    p.add_argument("--budget", type=int, help="optimizer steps per row (train.max_steps; also lifts max_epochs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every row, e.g. --set train.batch_size=16 (repeatable)")
    p.add_argument("--features", metavar="DIR",
                   help="captioning feature caches under DIR/<hash of encoders, contexts and data>, shared by rows "
                        "that encode the same way (default: each recipe's data.features); rows the disk cache "
                        "cannot hold (per-caption contexts) are encoded once in memory")
    p.add_argument("--split", default="test", help="split scored for the table (default: test)")
    p.add_argument("--out", default="runs/table", help="folder for the runs and table.json / table.md")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help="torch CPU threads (torch.set_num_threads)")
    p.add_argument("--rerun", action="store_true",
                   help="train and evaluate again rows that already have results (an unfinished row starts over)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars while training, extracting features and generating (default: on)")


# shown before BLEU-4 when a row's published figures give them (the everyday-caption papers do)
EXTRA_BLEU = [("bleu1", "BLEU-1"), ("bleu2", "BLEU-2"), ("bleu3", "BLEU-3")]


def _columns(done: list[dict]) -> list[tuple[str, str]]:
    """The metric columns: the tasks' (a column appears when any row has it), BLEU-1..3 first
    when a row's published figures have them; every metric for an unknown task."""
    from tellkit.recipes import task_key  # heavy

    tasks = {task_key(r["task"], "a table row's task") for r in done}
    published = {k for r in done for k in ((r.get("published") or {}).get("metrics") or {})}
    cols = [c for c in EXTRA_BLEU if c[0] in published] + [c for t in sorted(tasks) for c in COLUMNS.get(t, [])]
    seen, columns = set(), []
    for key, title in cols:
        if key not in seen and any(key in r["metrics"] for r in done):
            seen.add(key)
            columns.append((key, title))
    return columns or [(k, k) for k in sorted({k for r in done for k in r["metrics"]})]


def _cell(metrics: dict, key: str) -> str:
    """A metric's table cell: two decimals; ``-`` for an undefined value (null: 0/0); empty when absent."""
    if key not in metrics:
        return ""
    return "-" if metrics[key] is None else f"{metrics[key]:.2f}"


def markdown(rows: list[dict]) -> str:
    """The table: one line per row, and under a row with published figures a line with them; a
    failed row shows its error."""
    done = [r for r in rows if "error" not in r]
    columns = _columns(done)
    monitors = sorted({r["monitor"] for r in done}) or ["loss"]
    head = ["Model", "Encoder", *[t for _, t in columns], "Params", "Steps", "Train s",
            "Best val " + "/".join(monitors)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        if "error" in r:
            cells = [r["row"], "failed: " + r["error"].replace("|", "/")] + [""] * (len(head) - 2)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [r["row"], str(r.get("encoder") or "")]
        cells += [_cell(r["metrics"], k) for k, _ in columns]
        cells += [f"{r['params'] / 1e6:.2f}M", str(r["steps"]), f"{r.get('train_seconds', 0):.0f}",
                  f"{r['best_val']:.3f}" if isinstance(r["best_val"], (int, float)) else ""]
        lines.append("| " + " | ".join(cells) + " |")
        pub = r.get("published")
        if pub:
            figures = pub["metrics"]
            cells = [f"&nbsp;&nbsp;published: {pub['source']}", pub.get("encoder", "")]
            cells += [_cell(figures, k) for k, _ in columns] + [""] * 4
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from tellkit.workflows import TableOptions, table_row  # heavy

    if args.threads:
        import torch  # heavy

        torch.set_num_threads(int(args.threads))
    if args.budget is not None and args.budget < 1:
        raise TellkitError("--budget must be >= 1 optimizer steps")
    if args.split not in ("train", "val", "test"):
        raise TellkitError(f"--split must be train, val or test, got {args.split!r}")

    def log(msg: str) -> None:
        print(f"[tellkit table] {msg}", file=sys.stderr, flush=True)

    opts = TableOptions(out=args.out, split=args.split, data=args.data, budget=args.budget,
                        overrides=args.overrides, features=args.features, device=args.device,
                        progress=args.progress, rerun=args.rerun)
    rows = []
    for c in args.configs:  # a row that fails (bad recipe, missing file) is reported, the others still run
        try:
            rows.append(table_row(c, opts, log))
        except TellkitError as exc:
            log(f"{c}: FAILED: {exc}")
            rows.append({"row": str(c), "config": str(c), "error": str(exc)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)

    command = ("tellkit " + " ".join(shlex.quote(a) for a in sys.argv[1:])) if sys.argv[1:2] == ["table"] else None
    atomic_write_json(out / "table.json", {"split": args.split, "budget": args.budget, "overrides": args.overrides,
                                           "data": args.data, "command": command, "rows": rows})
    atomic_write_bytes(out / "table.md", table.encode("utf-8"))
    print(table, end="")
    print(json.dumps({"table_json": str(out / "table.json"), "table_md": str(out / "table.md")}))
    failed = [r["row"] for r in rows if "error" in r]
    if failed:
        log(f"{len(failed)} of {len(rows)} rows failed: {', '.join(failed)}")
        return 1
    return 0
