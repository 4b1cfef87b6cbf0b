"""`tellkit score --predictions FILE --references FILE [FILE ...] [--alignments FILE] [--metrics ...]`
(or `tellkit score --generations generations.jsonl --metrics entities caption`): score any
system's outputs (one text a line, files aligned line by line) with the papers' metrics and print
one JSON object.

Summaries (``--metrics rouge content_f1``, the default): ``rouge1``, ``rouge2``, ``rougeL`` (x100,
per-pair F1 on whitespace tokens averaged, the behaviour of the ROUGE package the VG-GPLMs
evaluation uses), ``rouge_score`` (Google's package, for comparison) and ``content_f1`` with both
definitions labelled (``tellkit`` and ``reference``). With ``--alignments`` (METEOR 1.5
``-writeAlignments`` output of these very pairs) Content F1 needs no Java; without it METEOR runs.
Captions (``--metrics caption``): coco-caption BLEU-1..4, METEOR, ROUGE-L, CIDEr-D; several
``--references`` files give several references per line.
News captions (``--metrics entities``): what the Transform and Tell reference's
``compute_metrics.py`` reports besides the caption metrics (:mod:`tellkit.metrics.news`): entity
precision / recall overall and for PERSON, GPE, ORG, DATE, all proper nouns, rare proper nouns
against the training captions' proper nouns (``--train-captions`` or ``--caption-names``) and
against those of the training captions and articles (``--train-articles`` or
``--article-names``), each with its counts, undefined ratios as null; length, distinct words, TTR
and Flesch of the predictions and of the (first) references. ``--generations`` reads the
reference's ``generations.jsonl`` instead of text files (its stored spaCy annotations are used).
"""
from __future__ import annotations

import json

from tellkit.cli import read_text_file
from tellkit.errors import TellkitError

NAME = "score"
HELP = "score predictions against references with ROUGE, Content F1 (summaries) or caption metrics (JSON)"
METRIC_GROUPS = ("rouge", "content_f1", "caption", "entities")


def add_arguments(p) -> None:
    p.add_argument("--predictions", help="text file, one prediction a line")
    p.add_argument("--references", nargs="+",
                   help="text file(s), one reference a line, aligned with the predictions; several files = "
                   "several references per line (caption metrics; ROUGE and Content F1 use the first)")
    p.add_argument("--alignments", help="METEOR 1.5 alignment file of the predictions against the first references "
                   "(e.g. a paper's released *-align.out); Content F1 then needs no Java")
    p.add_argument("--metrics", nargs="+", default=None,
                   help=f"any of {', '.join(METRIC_GROUPS)} (comma or space separated; default: rouge content_f1, "
                   "with --generations: entities)")
    p.add_argument("--generations", help="the Transform and Tell reference's generations.jsonl (generation, "
                   "raw_caption and its spaCy annotations), instead of --predictions / --references")
    p.add_argument("--train-captions", help="entities: training captions, one a line; their spaCy proper nouns "
                   "make the rare-name vocabulary")
    p.add_argument("--caption-names", help="entities: the training captions' proper nouns as a word list (one a "
                   "line, a JSON list, or a JSON object keyed by word), instead of --train-captions")
    p.add_argument("--train-articles", help="entities: training articles, one a line; their proper nouns and the "
                   "captions' make the article rare-name vocabulary")
    p.add_argument("--article-names", help="entities: the training articles' proper nouns as a word list, "
                   "instead of --train-articles")
    p.add_argument("--name-counters", help="entities: the reference's name_counters.pkl (training captions' and "
                   "articles' proper nouns), instead of the four options above")
    p.add_argument("--ner-model", default="auto", help="entities: spaCy pipeline (default: auto, the best installed)")


def _lines(path: str, what: str) -> list[str]:
    lines = read_text_file(path, what).split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.rstrip("\r") for ln in lines]


def _inputs(args) -> tuple[list[str], list[list[str]], list[dict] | None]:
    """(predictions, reference lists, the --generations records or None)."""
    if args.generations:
        if args.predictions or args.references:
            raise TellkitError("--generations replaces --predictions and --references: give one or the other")
        from tellkit.metrics.news import read_generations, reference_caption  # heavy

        records = read_generations(args.generations)
        return [r["generation"] for r in records], [[reference_caption(r) for r in records]], records
    if not args.predictions or not args.references:
        raise TellkitError("give --predictions and --references (or --generations)")
    preds = _lines(args.predictions, "--predictions")
    refs = [_lines(r, "--references") for r in args.references]
    if not preds:
        raise TellkitError(f"--predictions: {args.predictions} has no lines")
    for path, r in zip(args.references, refs):
        if len(r) != len(preds):
            raise TellkitError(f"--references: {path} has {len(r)} lines, --predictions has {len(preds)}")
    return preds, refs, None


def run(args) -> int:
    default = ["entities"] if args.generations else ["rouge", "content_f1"]
    metrics = [m for item in (args.metrics or default) for m in item.split(",") if m]
    unknown = sorted(set(metrics) - set(METRIC_GROUPS))
    if unknown or not metrics:
        raise TellkitError(f"--metrics: unknown {unknown or metrics}; choose from {', '.join(METRIC_GROUPS)}")
    vocab_options = (args.train_captions, args.caption_names, args.train_articles, args.article_names,
                     args.name_counters)
    if "entities" not in metrics and any(vocab_options):
        raise TellkitError("--train-captions / --caption-names / --train-articles / --article-names / "
                           "--name-counters are read by the entity metrics only: add entities to --metrics")
    preds, refs, records = _inputs(args)
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
    if "entities" in metrics:
        out["entities"] = _entities(args, preds, refs[0], records)
        notes["entities"] = (
            "tellkit.metrics.news: the Transform and Tell reference's compute_metrics.py figures; precision / recall "
            "x100 over lists with their counts (null when 0/0); reference_* keys describe the (first) references"
        )
    out["implementations"] = notes
    print(json.dumps(out, indent=2))
    return 0


def _vocabulary(texts_path: str | None, names_path: str | None, texts_option: str, names_option: str, nlp):
    if texts_path and names_path:
        raise TellkitError(f"give {texts_option} or {names_option}, not both")
    if names_path:
        from tellkit.metrics.news import read_vocabulary  # heavy

        return read_vocabulary(names_path, names_option)
    if texts_path:
        from tellkit.metrics.ner import train_proper_nouns  # heavy

        return train_proper_nouns(_lines(texts_path, texts_option), nlp=nlp())
    return None


def _entities(args, preds: list[str], refs: list[str], records: list[dict] | None) -> dict:
    from tellkit.metrics.ner import load_nlp, resolve_model  # heavy
    from tellkit.metrics.news import news_caption_scores, score_generations  # heavy

    def nlp():
        return load_nlp(resolve_model(args.ner_model))

    if args.name_counters:
        if any((args.train_captions, args.caption_names, args.train_articles, args.article_names)):
            raise TellkitError("--name-counters gives both rare-name vocabularies: leave out --train-captions, "
                               "--caption-names, --train-articles and --article-names")
        from tellkit.metrics.news import read_name_counters  # heavy

        words, article = read_name_counters(args.name_counters)
    else:
        words = _vocabulary(args.train_captions, args.caption_names, "--train-captions", "--caption-names", nlp)
        article = _vocabulary(args.train_articles, args.article_names, "--train-articles", "--article-names", nlp)
    if records is not None:
        return score_generations(records, train_words=words, article_words=article, model=args.ner_model)
    ids = [str(i) for i in range(len(preds))]
    return news_caption_scores(dict(zip(ids, preds)), dict(zip(ids, refs)), train_words=words,
                               article_words=article, model=args.ner_model)
