"""`tellkit calibrate CHECKPOINT --predictions predictions_val.jsonl (--out DIR | --in-place)`:
fit the confidence of a formula reader's or a captioner's answers on its validation set.

The predictions are those of ``tellkit evaluate CHECKPOINT --split val`` (one JSON object per
input: the search's ``score``, the answer, and whether it was right). A recognition answer is
right when it matches the truth exactly (``correct``); a caption is right when its CIDEr-D
against the image's references (the per-caption ``scores.cider`` of the evaluation, in the
metric's usual x100 units) is at least ``--cider-at-least``. The fitted curve and the unsure
threshold (the confidence below which ``--unsure-share`` of the validation answers fall) go
under ``confidence`` in the checkpoint's ``config.json``: of a copy (``--out DIR``) or of the
checkpoint itself (``--in-place``). See :mod:`tellkit.decoding.confidence`. Prints what was
fitted and how well it separates right from wrong answers (AUROC), as JSON.
"""
from __future__ import annotations

import json
import math

from tellkit.errors import TellkitError

NAME = "calibrate"
HELP = "fit a checkpoint's answer confidence (and its 'unsure' threshold) on validation predictions"
DEFAULT_CIDER = 50.0  # captions: right when CIDEr-D (x100) >= this


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder of a recognition or captioning model")
    p.add_argument("--predictions", required=True, metavar="JSONL",
                   help="predictions_val.jsonl written by `tellkit evaluate CHECKPOINT --split val`")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR", help="write a copy of the checkpoint with the calibration here")
    where.add_argument("--in-place", action="store_true", help="write the calibration into the checkpoint's config.json")
    p.add_argument("--cider-at-least", type=float, default=DEFAULT_CIDER, metavar="X",
                   help=f"captions: right when their CIDEr-D (x100) is at least X (default {DEFAULT_CIDER:g})")
    p.add_argument("--unsure-share", type=float, default=None, metavar="F",
                   help="the share of validation answers left below the unsure threshold (default 0.1)")
    p.add_argument("--fitted-on", default=None, metavar="TEXT",
                   help="what the predictions are, in words (stored with the calibration)")


def read_rows(path: str, task: str, cider_at_least: float) -> tuple[list, list, list, str]:
    """(scores, lengths, right, what right means) of the predictions file."""
    from tellkit.utils.files import read_text  # heavy

    text = read_text(path, "--predictions", 512 * 2**20)
    scores, lengths, right = [], [], []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if task == "recognition":
                ok, n = bool(row["correct"]), len(str(row["prediction"]).split())
            else:
                ok, n = float(row["scores"]["cider"]) >= cider_at_least, int(row["length"])
            sc = row["score"]
        except (ValueError, KeyError, TypeError) as exc:
            need = "correct, prediction, score" if task == "recognition" else "score, length, scores.cider"
            raise TellkitError(f"--predictions: {path}: line {k} is not a prediction of `tellkit evaluate` for this "
                               f"model (needs {need}; {type(exc).__name__}: {exc})") from None
        scores.append(None if sc is None or not math.isfinite(float(sc)) else float(sc))
        lengths.append(n)
        right.append(ok)
    means = ("exact match of the LaTeX tokens" if task == "recognition"
             else f"caption CIDEr-D (x100) >= {cider_at_least:g} against the image's references")
    return scores, lengths, right, means


def run(args) -> int:
    import shutil  # heavy enough: only here
    from pathlib import Path

    from tellkit.checkpoint import CONFIG_NAME, atomic_write_json, read_checkpoint_config, resolve_checkpoint
    from tellkit.decoding import confidence

    src = resolve_checkpoint(args.checkpoint, follow_links=False)
    meta = read_checkpoint_config(src)
    task = meta.get("task")
    if task not in ("recognition", "captioning"):
        raise TellkitError(f"{src}: a '{task}' model; calibrate fits formula readers and captioners")
    share = confidence.DEFAULT_UNSURE_SHARE if args.unsure_share is None else args.unsure_share
    scores, lengths, right, means = read_rows(args.predictions, task, args.cider_at_least)
    fitted_on = args.fitted_on or f"{Path(args.predictions).name} ({len(scores)} answers)"
    cal = confidence.fit(scores, lengths, right, unsure_share=share, right_means=means, fitted_on=fitted_on)
    if args.out:
        dst = Path(args.out)
        if dst.exists() and any(dst.iterdir()):
            raise TellkitError(f"--out: {dst} exists and is not empty")
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        dst = src
    atomic_write_json(dst / CONFIG_NAME, {**meta, confidence.META_KEY: cal.to_dict()})
    print(json.dumps({"checkpoint": str(dst), "right_share": round(sum(right) / len(right), 4),
                      **cal.to_dict()}, indent=2))
    return 0
