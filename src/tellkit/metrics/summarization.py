"""All summary metrics of VG-GPLMs (Yu et al., EMNLP 2021) in one JSON-able dict.

``score_summaries(predictions, references)`` returns::

    {"n": 2156,
     "rouge_reference": {"rouge1", "rouge2", "rougeL"},   # sentence-averaged F1, whitespace tokens
     "rouge_score":     {"rouge1", "rouge2", "rougeL"},   # Google's rouge-score package, no stemming
     "bleu1".."bleu4", "meteor", "cider", "rouge_l_coco", # tellkit.metrics.caption (coco-caption)
     "content_f1": {"tellkit", "reference"},              # METEOR alignment F1, two definitions
     "implementations": {...}}                            # what each number is, in words

ROUGE and Content F1 are percentages. ``metrics`` selects groups ("rouge", "caption",
"content_f1"): METEOR and Content F1 need Java, unless Content F1 is given METEOR's alignments
(``alignments``, e.g. the ``*-align.out`` files released with a paper's outputs).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tellkit.errors import TellkitError
from tellkit.metrics import content_f1 as cf1
from tellkit.metrics.caption import score_captions
from tellkit.metrics.rouge import rouge_reference, rouge_score_package

GROUPS = ("rouge", "caption", "content_f1")


def _pairs(
    predictions: Sequence[str] | Mapping[str, str], references: Sequence[str] | Mapping[str, str]
) -> tuple[list[str], list[str], list[str]]:
    if isinstance(predictions, Mapping):
        if not isinstance(references, Mapping):
            raise TellkitError("predictions are keyed by id, so references must be too")
        missing = sorted(set(predictions) ^ set(references))
        if missing:
            raise TellkitError(f"predictions and references have different ids (e.g. {missing[:3]})")
        ids = sorted(predictions)
        return ids, [predictions[i] for i in ids], [references[i] for i in ids]
    if len(predictions) != len(references):
        raise TellkitError(f"{len(predictions)} predictions but {len(references)} references")
    return [str(i) for i in range(len(predictions))], list(predictions), list(references)


def score_summaries(
    predictions: Sequence[str] | Mapping[str, str],
    references: Sequence[str] | Mapping[str, str],
    metrics: Sequence[str] = GROUPS,
    alignments: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Score summaries against one reference each (lists aligned by position, or dicts by id).
    ``alignments``: METEOR alignment blocks (``tellkit.metrics.content_f1.AlignedPair``) of these
    very pairs, in order; Content F1 then reads them instead of running METEOR."""
    unknown = sorted(set(metrics) - set(GROUPS))
    if unknown:
        raise TellkitError(f"unknown summary metric group(s) {unknown}; known: {', '.join(GROUPS)}")
    ids, preds, refs = _pairs(predictions, references)
    if not preds:
        raise TellkitError("no summaries to score")
    out: dict[str, Any] = {"n": len(preds)}
    notes: dict[str, str] = {}
    if "rouge" in metrics:

        out["rouge_reference"] = rouge_reference(preds, refs)
        out["rouge_score"] = rouge_score_package(preds, refs)
        notes["rouge_reference"] = (
            "VG-GPLMs evaluation: per-pair F1 on whitespace tokens (case kept, no stemming), averaged"
        )
        notes["rouge_score"] = "rouge-score package (lower-cased, punctuation dropped, no stemming), mean F-measure"
    if "caption" in metrics:
        cap = score_captions(dict(zip(ids, preds)), {i: [r] for i, r in zip(ids, refs)})
        for k, v in cap.items():
            # coco-caption's ROUGE-L (beta 1.2) is a third ROUGE variant: keep it, labelled
            out["rouge_l_coco" if k == "rouge_l" else k] = v
        notes["caption"] = (
            "coco-caption BLEU-1..4, METEOR 1.5, CIDEr-D (and ROUGE-L with beta 1.2 as rouge_l_coco) via "
            "tellkit.metrics.caption, x100, one reference each, punctuation removed"
        )
    if "content_f1" in metrics:

        if alignments is not None:
            if isinstance(predictions, Mapping):
                raise TellkitError("alignments go with predictions and references given in order (lists), not by id")
            bad = cf1.mismatched_pairs(alignments, preds, refs)
            if bad:
                i = bad[0]
                raise TellkitError(
                    f"the alignments do not belong to these summaries: {len(bad)} of {len(preds)} pairs differ "
                    f"(first: line {i + 1}, aligned {' '.join(alignments[i].prediction)[:60]!r} against "
                    f"{' '.join(alignments[i].reference)[:60]!r})"
                )
            out["content_f1"] = cf1.content_f1_from_alignments(alignments)
            source = "the given METEOR alignments"
        else:
            out["content_f1"] = cf1.content_f1_both(preds, refs)
            source = "METEOR 1.5 alignments (lower-cased whitespace tokens)"
        notes["content_f1.tellkit"] = (
            f"{source}: F1 of aligned content tokens, function words and How2 summary stop-words removed on both "
            "sides, mean over pairs"
        )
        notes["content_f1.reference"] = (
            f"{source}: the VG-GPLMs evaluation script (drops one-word spans whose reference word is a summary "
            "stop-word; aligned tokens over distinct words), mean over pairs; what the paper reports"
        )
    out["implementations"] = notes
    return out


def flatten_scores(scores: Mapping[str, Any]) -> dict[str, float]:
    """Numbers only, one level: ``rouge1/2/L`` = the reference implementation (what the paper
    reports), ``rouge_score.rouge1`` ... = the package, ``content_f1`` = tellkit's definition and
    ``content_f1_reference`` = the reference script's; other metrics keep their names."""
    flat: dict[str, float] = {}
    for k, v in scores.items():
        if k in ("n", "implementations"):
            continue
        if k == "rouge_reference":
            flat.update({kk: float(vv) for kk, vv in v.items()})
        elif k == "content_f1" and isinstance(v, Mapping):
            flat["content_f1"] = float(v["tellkit"])
            flat["content_f1_reference"] = float(v["reference"])
        elif isinstance(v, Mapping):
            flat.update({f"{k}.{kk}": float(vv) for kk, vv in v.items()})
        elif isinstance(v, (int, float)):
            flat[k] = float(v)
    return flat
