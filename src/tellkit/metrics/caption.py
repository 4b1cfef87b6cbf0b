"""Caption metrics with the COCO caption evaluation code (``pycocoevalcap``), under the Transform
and Tell reference protocol:

- text is compared case-preserved with punctuation removed (:func:`normalize`: every character
  that is neither a word character nor whitespace is deleted, then whitespace is collapsed);
  no PTB tokenisation, no lower-casing. ``lowercase=True`` also lower-cases predictions and
  references, the convention of the everyday-caption papers (Flickr8k, COCO: the COCO caption
  code's PTB tokenizer lower-cases), where "A dog" and "a dog" are the same words;
- BLEU-1..4 (corpus level, "closest" reference length), METEOR 1.5 (``-norm``; needs Java),
  ROUGE-L (beta 1.2, sentence average), CIDEr-D (n=4, sigma=6, document frequencies from the
  references of the WHOLE scored set: never average per-batch CIDEr).
- ROUGE-L sees the text as the reference scored it (``rouge_whitespace="reference"``):
  punctuation deleted but whitespace left as it is, and pycocoevalcap splits on single spaces,
  so "Doe - left" becomes "Doe  left" with an empty token between the words, which counts in
  the lengths. ``rouge_whitespace="collapsed"`` scores the collapsed text like the other metrics.

    from tellkit.metrics.caption import score_captions
    score_captions({"a": "A dog runs"}, {"a": ["A dog is running", "The dog runs"]})
    # {"bleu1": .., "bleu2": .., "bleu3": .., "bleu4": .., "meteor": .., "rouge_l": .., "cider": ..}

Scores are x100, the scale of the papers' tables (BLEU-4 6.41, CIDEr 54.7 ...).
"""
from __future__ import annotations

import re
import shutil
from collections.abc import Iterable, Mapping

from tellkit.errors import TellkitError
from tellkit.utils.optional import require

METRICS = ("bleu", "meteor", "rouge", "cider")
_PUNCT = re.compile(r"[^\w\s]")
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Case kept, punctuation removed, whitespace collapsed (the reference protocol)."""
    return _SPACE.sub(" ", _PUNCT.sub("", text)).strip()


def strip_punctuation(text: str) -> str:
    """Punctuation removed, whitespace untouched (what the reference handed to ROUGE-L)."""
    return _PUNCT.sub("", text)


ROUGE_WHITESPACE = ("reference", "collapsed")


def _prepare(predictions: Mapping[str, str], references: Mapping[str, Iterable[str]], norm: bool,
             lowercase: bool = False):
    if set(predictions) != set(references):
        missing = sorted(set(references) - set(predictions))[:3]
        extra = sorted(set(predictions) - set(references))[:3]
        raise TellkitError(f"predictions and references cover different ids (missing {missing}, extra {extra})")
    if not predictions:
        raise TellkitError("no captions to score")
    base = normalize if norm else (lambda s: _SPACE.sub(" ", s).strip())
    f = (lambda s: base(s).lower()) if lowercase else base
    res = {str(k): [f(v)] for k, v in predictions.items()}
    gts = {}
    for k, refs in references.items():
        refs = [f(r) for r in refs]
        if not refs:
            raise TellkitError(f"id {k!r} has no reference caption")
        gts[str(k)] = refs
    return res, gts


def score_captions_detailed(
    predictions: Mapping[str, str],
    references: Mapping[str, Iterable[str]],
    metrics: Iterable[str] = METRICS,
    *,
    normalize_text: bool = True,
    rouge_whitespace: str = "reference",
    lowercase: bool = False,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(corpus scores, per-id scores). Per-id BLEU is the sentence-level score, per-id CIDEr-D is
    computed with the corpus document frequencies."""
    require("pycocoevalcap", "metrics", "BLEU/METEOR/ROUGE-L/CIDEr")
    metrics = tuple(metrics)
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise TellkitError(f"unknown caption metric(s) {sorted(unknown)}; known: {', '.join(METRICS)}")
    if rouge_whitespace not in ROUGE_WHITESPACE:
        raise TellkitError(f"rouge_whitespace must be one of {', '.join(ROUGE_WHITESPACE)}, got {rouge_whitespace!r}")
    res, gts = _prepare(predictions, references, normalize_text, lowercase)
    ids = list(res)
    corpus: dict[str, float] = {}
    per: dict[str, dict[str, float]] = {i: {} for i in ids}

    def put(name: str, total: float, each) -> None:
        corpus[name] = 100.0 * float(total)
        for i, v in zip(ids, each):
            per[i][name] = 100.0 * float(v)

    if "bleu" in metrics:
        from pycocoevalcap.bleu.bleu import Bleu  # optional

        totals, each = Bleu(4).compute_score(gts, res, verbose=0)
        for n in range(4):
            put(f"bleu{n + 1}", totals[n], each[n])
    if "meteor" in metrics:
        put("meteor", *_meteor(gts, res))
    if "rouge" in metrics:
        from pycocoevalcap.rouge.rouge import Rouge  # optional

        r_res, r_gts = res, {i: gts[i] for i in ids}  # scored in the order of ``ids``
        if normalize_text and rouge_whitespace == "reference":
            preds = {str(k): v for k, v in predictions.items()}
            refs_by_id = {str(k): list(v) for k, v in references.items()}
            case = str.lower if lowercase else str
            r_res = {i: [case(strip_punctuation(preds[i]))] for i in ids}
            r_gts = {i: [case(strip_punctuation(r)) for r in refs_by_id[i]] for i in ids}
        put("rouge_l", *Rouge().compute_score(r_gts, r_res))
    if "cider" in metrics:
        from pycocoevalcap.cider.cider import Cider  # optional

        put("cider", *Cider().compute_score(gts, res))
    return corpus, per


def score_captions(predictions: Mapping[str, str], references: Mapping[str, Iterable[str]],
                   metrics: Iterable[str] = METRICS, *, normalize_text: bool = True,
                   rouge_whitespace: str = "reference", lowercase: bool = False) -> dict[str, float]:
    """Corpus-level scores (x100) for ``predictions`` (id -> caption) against ``references``
    (id -> list of captions). ``metrics``: any of bleu, meteor, rouge, cider."""
    return score_captions_detailed(predictions, references, metrics, normalize_text=normalize_text,
                                   rouge_whitespace=rouge_whitespace, lowercase=lowercase)[0]


def _meteor(gts, res):
    if shutil.which("java") is None:
        raise TellkitError("METEOR needs Java (a `java` on PATH); install a JRE, or leave 'meteor' out of the metrics")
    from pycocoevalcap.meteor.meteor import Meteor  # optional

    # the jar reads one line per request: keep hypotheses non-empty and free of its separator
    res = {k: [v[0].replace("|||", "") or "<empty>"] for k, v in res.items()}
    gts = {k: [r.replace("|||", "") for r in v] for k, v in gts.items()}
    scorer = Meteor()
    try:
        return scorer.compute_score(gts, res)
    except (ValueError, BrokenPipeError) as exc:
        exited = scorer.meteor_p.poll() is not None
        err = scorer.meteor_p.stderr.read().decode(errors="replace")[-500:] if exited else ""
        raise TellkitError(f"METEOR failed ({exc}) {err}".strip()) from exc
    finally:
        del scorer  # closes the Java process
