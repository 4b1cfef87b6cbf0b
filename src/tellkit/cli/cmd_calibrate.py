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

A captioner may also learn what its photos look like (``--typical`` photos like its training
photos, or ``--typical-list NAMES --typical-root DIR``, e.g. Flickr8k's official
``Flickr_8k.trainImages.txt`` and its ``images`` folder; the first ``--typical-limit``): the mean
direction of their image features, and the distance from it that ``--typical-share`` of them
exceed. A photo further away is unsure, whatever its score.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

from tellkit.cli import IMAGE_SUFFIXES, expand_inputs, positive_int
from tellkit.errors import TellkitError
from tellkit.utils.files import atomic_write_json, read_text

NAME = "calibrate"
HELP = "fit a checkpoint's answer confidence (and its 'unsure' threshold) on validation predictions"
DEFAULT_CIDER = 50.0  # captions: right when CIDEr-D (x100) >= this


def add_arguments(p) -> None:
    p.add_argument("checkpoint", help="checkpoint folder of a recognition or captioning model")
    p.add_argument("--predictions", required=True, metavar="JSONL",
                   help="predictions_val.jsonl written by `tellkit evaluate CHECKPOINT --split val`")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR", help="write a copy of the checkpoint with the calibration here")
    where.add_argument("--in-place", action="store_true",
                       help="write the calibration into the checkpoint's config.json")
    p.add_argument("--cider-at-least", type=float, default=DEFAULT_CIDER, metavar="X",
                   help=f"captions: right when their CIDEr-D (x100) is at least X (default {DEFAULT_CIDER:g})")
    p.add_argument("--unsure-share", type=float, default=None, metavar="F",
                   help="the share of validation answers left below the unsure threshold (default 0.1)")
    p.add_argument("--fitted-on", default=None, metavar="TEXT",
                   help="what the predictions are, in words (stored with the calibration)")
    p.add_argument("--typical", nargs="+", default=[], metavar="IMAGE",
                   help="captioners: photos like the training photos (files, folders, globs)")
    p.add_argument("--typical-list", metavar="FILE", help="captioners: a file naming such photos, one a line")
    p.add_argument("--typical-root", metavar="DIR", help="the folder the names of --typical-list are in")
    p.add_argument("--typical-limit", type=positive_int, default=600, metavar="N",
                   help="use the first N typical photos (default 600)")
    p.add_argument("--typical-share", type=float, default=0.01, metavar="F",
                   help="the share of typical photos beyond the limit (default 0.01)")
    p.add_argument("--device", help="cpu, cuda or cuda:N, for the typical photos "
                   "(default: cuda when available, else cpu)")


def typical_paths(args) -> list[str]:
    """The typical photos named by --typical and --typical-list (the first --typical-limit)."""

    paths = expand_inputs(args.typical, IMAGE_SUFFIXES, "images") if args.typical else []
    if args.typical_list:
        if not args.typical_root:
            raise TellkitError("--typical-list needs --typical-root (the folder its names are in)")
        names = [ln.strip() for ln in read_text(args.typical_list, "--typical-list", 64 * 2**20).splitlines()]
        paths += [str(Path(args.typical_root) / n) for n in names if n]
    return paths[: args.typical_limit]


def typical_features(checkpoint, paths: list[str], device: str):
    """The mean image-encoder grid vector of each photo, through the captioner's own processor."""
    import torch  # heavy

    from tellkit.pipelines.captioning import CaptioningPipeline  # heavy

    proc = CaptioningPipeline.load(checkpoint, device=device).processor
    if "image" not in proc.contexts:
        raise TellkitError("--typical: this captioner reads no image grid to compare")
    out = []
    for i in range(0, len(paths), 16):
        items = proc.encode([proc.prepare(p) for p in paths[i:i + 16]])
        out += [it["image"].float().mean(0) for it in items]
    return torch.stack(out)


def read_rows(path: str, task: str, cider_at_least: float) -> tuple[list, list, list, str]:
    """(scores, lengths, right, what right means) of the predictions file."""
    text = read_text(path, "--predictions", 512 * 2**20)
    scores, lengths, right = [], [], []
    for k, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if task == "recognize":
                ok, n = bool(row["correct"]), len(str(row["prediction"]).split())
            else:
                ok, n = float(row["scores"]["cider"]) >= cider_at_least, int(row["length"])
            sc = row["score"]
        except (ValueError, KeyError, TypeError) as exc:
            need = "correct, prediction, score" if task == "recognize" else "score, length, scores.cider"
            raise TellkitError(f"--predictions: {path}: line {k} is not a prediction of `tellkit evaluate` for this "
                               f"model (needs {need}; {type(exc).__name__}: {exc})") from None
        scores.append(None if sc is None or not math.isfinite(float(sc)) else float(sc))
        lengths.append(n)
        right.append(ok)
    means = ("exact match of the LaTeX tokens" if task == "recognize"
             else f"caption CIDEr-D (x100) >= {cider_at_least:g} against the image's references")
    return scores, lengths, right, means


def run(args) -> int:
    from tellkit.checkpoint import CONFIG_NAME, read_checkpoint_config, resolve_checkpoint  # heavy
    from tellkit.decoding import confidence  # heavy
    from tellkit.recipes import task_key  # heavy

    src = resolve_checkpoint(args.checkpoint, follow_links=False)
    meta = read_checkpoint_config(src)
    task = task_key(meta.get("task"), f"{src}: task:")
    if task not in ("recognize", "caption"):
        raise TellkitError(f"{src}: a '{task}' model; calibrate fits formula readers and captioners")
    share = confidence.DEFAULT_UNSURE_SHARE if args.unsure_share is None else args.unsure_share
    scores, lengths, right, means = read_rows(args.predictions, task, args.cider_at_least)
    fitted_on = args.fitted_on or f"{Path(args.predictions).name} ({len(scores)} answers)"
    cal = confidence.fit(scores, lengths, right, unsure_share=share, right_means=means, fitted_on=fitted_on)
    if args.typical or args.typical_list:
        if task != "caption":
            raise TellkitError("--typical: the input check is for captioners")
        paths = typical_paths(args)
        check = confidence.fit_input_check(typical_features(src, paths, args.device), share=args.typical_share,
                                           fitted_on=f"{len(paths)} typical photos"
                                           + (f" named in {Path(args.typical_list).name}" if args.typical_list else ""))
        cal = dataclasses.replace(cal, input=check)
    if args.out:
        dst = Path(args.out)
        if dst.exists() and any(dst.iterdir()):
            raise TellkitError(f"--out: {dst} exists and is not empty")
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        dst = src
    atomic_write_json(dst / CONFIG_NAME, {**meta, confidence.META_KEY: cal.to_dict()})
    shown = cal.to_dict()
    if "input" in shown:  # the mean direction is long: its size only
        shown["input"] = {**shown["input"], "mean": f"<{len(cal.input.mean)} numbers>"}
    print(json.dumps({"checkpoint": str(dst), "right_share": round(sum(right) / len(right), 4), **shown}, indent=2))
    return 0
