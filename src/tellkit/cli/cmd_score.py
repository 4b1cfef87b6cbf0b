"""`tellkit score --predictions FILE --references FILE [FILE ...] [--alignments FILE] [--metrics ...]`:
score any system's outputs (one text a line, files aligned line by line) with the papers' metrics
and print one JSON object.

Summaries (``--metrics rouge content_f1``, the default): ``rouge1``, ``rouge2``, ``rougeL`` (x100,
per-pair F1 on whitespace tokens averaged, the behaviour of the ROUGE package the VG-GPLMs
evaluation uses), ``rouge_score`` (Google's package, for comparison) and ``content_f1`` with both
definitions labelled (``tellkit`` and ``reference``). With ``--alignments`` (METEOR 1.5
``-writeAlignments`` output of these very pairs) Content F1 needs no Java; without it METEOR runs.
Captions (``--metrics caption``): coco-caption BLEU-1..4, METEOR, ROUGE-L, CIDEr-D; several
``--references`` files give several references per line.
"""
from __future__ import annotations

import json

from tellkit.cli import read_text_file
from tellkit.errors import TellkitError

NAME = "score"
HELP = "score predictions against references with ROUGE, Content F1 (summaries) or caption metrics (JSON)"
METRIC_GROUPS = ("rouge", "content_f1", "caption")


def add_arguments(p) -> None:
    p.add_argument("--predictions", required=True, help="text file, one prediction a line")
    p.add_argument("--references", required=True, nargs="+",
                   help="text file(s), one reference a line, aligned with the predictions; several files = "
                   "several references per line (caption metrics; ROUGE and Content F1 use the first)")
    p.add_argument("--alignments", help="METEOR 1.5 alignment file of the predictions against the first references "
                   "(e.g. a paper's released *-align.out); Content F1 then needs no Java")
    p.add_argument("--metrics", nargs="+", default=None,
                   help=f"any of {', '.join(METRIC_GROUPS)} (comma or space separated; default: rouge content_f1)")


def _lines(path: str, what: str) -> list[str]:
    lines = read_text_file(path, what).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.rstrip("\r") for ln in lines]


def run(args) -> int:
    metrics = [m for item in (args.metrics or ["rouge", "content_f1"]) for m in item.split(",") if m]
    unknown = sorted(set(metrics) - set(METRIC_GROUPS))
    if unknown or not metrics:
        raise TellkitError(f"--metrics: unknown {unknown or metrics}; choose from {', '.join(METRIC_GROUPS)}")
    preds = _lines(args.predictions, "--predictions")
    refs = [_lines(r, "--references") for r in args.references]
    if not preds:
        raise TellkitError(f"--predictions: {args.predictions} has no lines")
    for path, r in zip(args.references, refs):
        if len(r) != len(preds):
            raise TellkitError(f"--references: {path} has {len(r)} lines, --predictions has {len(preds)}")
    if args.alignments and "content_f1" not in metrics:
        raise TellkitError("--alignments is only read by Content F1: add content_f1 to --metrics")

    out: dict = {"n": len(preds), "references_per_prediction": len(refs)}
    notes: dict[str, str] = {}
    summary_groups = [m for m in metrics if m in ("rouge", "content_f1")]
    if summary_groups:
        from tellkit.metrics.summarization import score_summaries  # heavy

        alignments = None
        if args.alignments:
            from tellkit.metrics.content_f1 import read_alignment_file  # heavy

            alignments = read_alignment_file(args.alignments)
        scores = score_summaries(preds, refs[0], summary_groups, alignments=alignments)
        if "rouge_reference" in scores:
            out.update(scores.pop("rouge_reference"))  # rouge1 / rouge2 / rougeL at the top
        notes.update(scores.pop("implementations"))
        if "rouge_reference" in notes:
            notes["rouge1/rouge2/rougeL"] = notes.pop("rouge_reference")
        scores.pop("n", None)
        out.update(scores)
        if len(refs) > 1:
            notes["references"] = "ROUGE and Content F1 score against the first --references file only"
    if "caption" in metrics:
        from tellkit.metrics.caption import score_captions  # heavy

        ids = [str(i) for i in range(len(preds))]
        cap = score_captions(dict(zip(ids, preds)), {i: [r[k] for r in refs] for k, i in enumerate(ids)})
        out["caption"] = cap
        notes["caption"] = (
            "coco-caption BLEU-1..4, METEOR 1.5, ROUGE-L (beta 1.2), CIDEr-D via tellkit.metrics.caption, x100, "
            "corpus level, all --references files as references"
        )
    out["implementations"] = notes
    print(json.dumps(out, indent=2))
    return 0
