"""`tellkit table CONFIG... [--data PATH] [--budget STEPS] [--out DIR]`: train and evaluate
each recipe with the generic trainer and evaluator, then print one table (rows = recipes,
columns = the paper's metrics) as Markdown and write it as JSON, like Table 4 of Transform and
Tell.

    tellkit table configs/baselines/flickr8k/*.yaml --budget 150 --out runs/table_flickr8k
    tellkit table configs/baselines/nytimes/*.yaml --data /data/nytimes800k.archive.gz

Each recipe trains into ``OUT/<recipe name>/`` (``tellkit train``'s run folder) and its best
checkpoint is scored on ``--split`` (``OUT/<name>/eval/metrics_<split>.json``). ``--budget``
caps the optimizer steps of every row (``train.max_steps``); ``key=value`` overrides
(``--set``) apply to every row. A row whose evaluation file already exists is read back, not
re-run, unless ``--rerun``. The row label is the recipe's top-level ``row:`` (else its file
name). ``OUT/table.json`` holds every metric of every row, ``OUT/table.md`` the printed table.

Captioning rows: rows whose contexts the task's disk cache cannot hold (per-caption contexts such as
Flickr8k's ``other_captions``) are encoded once per image / text in memory and shared
by all rows of the run.
"""
from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from tellkit.errors import TellkitError

NAME = "table"
HELP = "train + evaluate several recipes on one data set and print a results table (Markdown + JSON)"

# metric key -> column title, per task (the papers' tables)
COLUMNS = {
    "captioning": [("bleu4", "BLEU-4"), ("rouge_l", "ROUGE"), ("meteor", "METEOR"), ("cider", "CIDEr"),
                   ("entities_precision", "NE P"), ("entities_recall", "NE R"),
                   ("person_precision", "Names P"), ("person_recall", "Names R"),
                   ("rare_proper_nouns_precision", "Rare P"), ("rare_proper_nouns_recall", "Rare R"),
                   ("length", "Len"), ("ttr", "TTR")],
    "summarization": [("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"),
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
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (torch.set_num_threads)")
    p.add_argument("--rerun", action="store_true", help="train and evaluate again rows that already have results")
    p.add_argument("--progress", action="store_true", help="show progress bars")


# Encoders and their outputs shared by the rows of one table run (process-wide): rows that encode
# the same images / texts with the same encoders do it once. float16, like the task's disk cache.
_MEMO: dict[tuple, object] = {}


def cacheable(recipe) -> bool:
    """Whether the captioning task's disk cache (data.features) can hold this row's contexts."""
    from tellkit.registry import model_contexts  # heavy

    contexts = model_contexts(recipe.get("model") or {})
    return "article" not in contexts or (recipe.get("data") or {}).get("context") != "other_captions"


def _task(recipe):
    """The recipe's task. A captioning task gets an encoder bundle that shares the built encoders
    and remembers image / article encodings across the rows of this run, in memory."""
    from tellkit.encoders.bundle import EncoderBundle  # heavy
    from tellkit.recipes import section  # heavy
    from tellkit.registry import model_contexts  # heavy
    from tellkit.tasks import make_task  # heavy

    if recipe.get("task") != "captioning":
        return make_task(recipe)
    contexts = model_contexts(section(recipe, "model"))
    return make_task(recipe, bundle=EncoderBundle.for_recipe(recipe, contexts, shared_encoders=_MEMO, memo=_MEMO))


def feature_key(recipe) -> str:
    """Rows with equal encoders, contexts and data (but for the cache folder) share features."""
    data = {k: v for k, v in (recipe.get("data") or {}).items() if k != "features"}
    what = {"encoders": recipe.get("encoders") or {}, "contexts": (recipe.get("model") or {}).get("contexts"),
            "data": data}
    return hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_row(path, args, log) -> dict:
    from tellkit.checkpoint import atomic_write_json  # heavy
    from tellkit.config import deep_merge, load_yaml, parse_overrides, resolve_config_path  # heavy
    from tellkit.errors import TellkitError  # heavy
    from tellkit.training.loop import train  # heavy
    from tellkit.workflows import evaluate_checkpoint  # heavy

    cfg_path = resolve_config_path(path)
    recipe = load_yaml(cfg_path)
    label = str(recipe.pop("row", cfg_path.stem))
    extra: dict = {}
    if args.data:
        extra["data"] = {"root": args.data}
    if args.budget:
        extra["train"] = {"max_steps": int(args.budget), "max_epochs": 10**6}
    recipe = deep_merge(deep_merge(recipe, extra), parse_overrides(args.overrides))
    if "task" not in recipe:
        raise TellkitError(f"{cfg_path}: the recipe has no 'task:'")
    if recipe["task"] == "captioning":
        recipe["data"] = dict(recipe.get("data") or {})
        if not cacheable(recipe):
            recipe["data"].pop("features", None)  # encoded in memory, shared across rows (see _task)
        elif args.features:
            recipe["data"]["features"] = str(Path(args.features) / feature_key(recipe))
    name = cfg_path.stem if cfg_path.parent.name in ("", ".") else f"{cfg_path.parent.name}_{cfg_path.stem}"
    run_dir = Path(args.out) / name
    eval_file = run_dir / "eval" / f"metrics_{args.split}.json"
    summary_file = run_dir / "table_row.json"
    if eval_file.is_file() and summary_file.is_file() and not args.rerun:
        log(f"{label}: results exist in {run_dir} (--rerun to redo)")
        return json.loads(summary_file.read_text(encoding="utf-8"))

    log(f"{label}: training {cfg_path} -> {run_dir}")
    task = _task(recipe)
    if (run_dir / "checkpoints").exists():
        if not args.rerun:
            raise TellkitError(f"{run_dir} holds an unfinished row: pass --rerun, or remove the folder")

        shutil.rmtree(run_dir)
    t0 = time.time()
    summary = train(recipe, run_dir, task=task, device=args.device, save_every_minutes=None, progress=args.progress)
    t_train = time.time() - t0
    if summary["stopped"] == "signal":
        raise KeyboardInterrupt
    ckpt = summary["best_checkpoint"] or summary["last_checkpoint"]
    log(f"{label}: {summary['steps']} steps in {t_train:.0f}s; scoring {ckpt} on {args.split}")
    t0 = time.time()
    try:
        result = evaluate_checkpoint(ckpt, args.split, out=run_dir / "eval", device=args.device,
                                     progress=args.progress, recipe=recipe, task=task)
    except TellkitError as exc:
        raise TellkitError(f"{label}: {exc}") from exc
    metrics, preds = result.metrics, result.predictions
    row = {
        "row": label, "config": str(path), "task": recipe["task"], "family": recipe["model"]["name"],
        "params": result.parameters, "steps": summary["steps"],
        "train_seconds": round(t_train, 1), "eval_seconds": round(time.time() - t0, 1), "split": args.split,
        "n": len(preds), "best_val": summary["best"], "monitor": summary["monitor"], "metrics": metrics,
        "example": {"prediction": preds[0].get("prediction"),
                    "reference": (preds[0].get("references") or [preds[0].get("reference")])[0]} if preds else None,
    }
    atomic_write_json(summary_file, row)
    return row


def markdown(rows: list[dict]) -> str:
    """The table: one line per row; a metric column appears when any row has it; a failed row
    shows its error."""
    done = [r for r in rows if "error" not in r]
    tasks = {r["task"] for r in done}
    cols = [c for t in sorted(tasks) for c in COLUMNS.get(t, [])]
    seen, columns = set(), []
    for key, title in cols:
        if key not in seen and any(key in r["metrics"] for r in done):
            seen.add(key)
            columns.append((key, title))
    if not columns:  # an unknown task: every metric
        columns = [(k, k) for k in sorted({k for r in done for k in r["metrics"]})]
    monitors = sorted({r["monitor"] for r in done}) or ["loss"]
    head = ["Model", *[t for _, t in columns], "Params", "Steps", "Best val " + "/".join(monitors)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        if "error" in r:
            cells = [r["row"], "failed: " + r["error"].replace("|", "/")] + [""] * (len(head) - 2)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        cells = [r["row"]]
        cells += [f"{r['metrics'][k]:.2f}" if k in r["metrics"] else "" for k, _ in columns]
        cells += [f"{r['params'] / 1e6:.2f}M", str(r["steps"]),
                  f"{r['best_val']:.3f}" if isinstance(r["best_val"], (int, float)) else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from tellkit.checkpoint import atomic_write_bytes, atomic_write_json  # heavy

    if args.threads:
        import torch  # heavy

        torch.set_num_threads(int(args.threads))
    if args.budget is not None and args.budget < 1:
        raise TellkitError("--budget must be >= 1 optimizer steps")
    if args.split not in ("train", "val", "test"):
        raise TellkitError(f"--split must be train, val or test, got {args.split!r}")

    def log(msg: str) -> None:
        print(f"[tellkit table] {msg}", file=sys.stderr, flush=True)

    rows = []
    for c in args.configs:  # a row that fails (bad recipe, missing file) is reported, the others still run
        try:
            rows.append(run_row(c, args, log))
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
