"""Everything the Transform and Tell reference's ``compute_metrics.py`` reports beyond the COCO
caption metrics, for any system's captions: entity and proper-noun precision / recall with their
counts (:mod:`tellkit.metrics.ner`), and length, distinct words, type-token ratio and Flesch
reading ease of the generations AND the references (:mod:`tellkit.metrics.linguistic`; reference
figures under ``reference_*`` keys). Undefined figures (0/0, an empty set) are None.

Two inputs:

- texts (id -> generated caption, id -> reference caption): spaCy analyses both sides
  (:func:`news_caption_scores`);
- the reference's own ``generations.jsonl`` (:func:`read_generations`, :func:`score_generations`):
  one JSON object a line with ``generation`` and ``raw_caption`` (``caption`` when there is no
  ``raw_caption``) and, as the reference's evaluator wrote them, the spaCy annotations
  ``generated_names`` / ``caption_names`` (PROPN tokens) and ``generated_entities`` /
  ``caption_entities`` (``{"text", "label"}`` objects), ``gen_np.basic_ttr`` /
  ``caption_np.basic_ttr`` and ``gen_readability.flesch_reading_ease`` /
  ``caption_readability.flesch_reading_ease``. Stored annotations are used as they are (the
  reference's numbers are reproduced without spaCy); lines without them are analysed with spaCy.

The rare-name vocabularies are word lists (:func:`read_vocabulary`): one word a line, or a JSON
list, or a JSON object whose keys are the words (a name counter written as JSON); or the
reference's own ``name_counters.pkl`` (:func:`read_name_counters`, read without running code).
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping
from typing import Any

from tellkit.errors import TellkitError
from tellkit.metrics.linguistic import linguistic_scores
from tellkit.metrics.ner import DEFAULT_MODEL, analyse, entity_scores, load_nlp, resolve_model, scores_from_analysed
from tellkit.utils.files import read_bytes, read_text
from tellkit.utils.safe_unpickle import restricted_load

MAX_BYTES = 1 << 31  # a test set's generations with their annotations


def news_caption_scores(predictions: Mapping[str, str], references: Mapping[str, str], *,
                        train_words: Iterable[str] | None = None, article_words: Iterable[str] | None = None,
                        model: str = DEFAULT_MODEL, nlp: Any = None) -> dict[str, Any]:
    """Entity / proper-noun scores with counts, and the linguistic measures of both sides."""
    out = entity_scores(predictions, references, train_words=train_words, article_words=article_words,
                        model=model, nlp=nlp, with_model=True)
    out.update(linguistic_scores(predictions.values()))
    out.update(linguistic_scores([references[k] for k in predictions], prefix="reference_"))
    return out


def read_vocabulary(path: str, what: str = "vocabulary") -> set[str]:
    """A word list: one word a line, a JSON list of words, or a JSON object whose keys are words."""
    text = read_text(path, what, MAX_BYTES)
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise TellkitError(f"{what}: {path} is not valid JSON ({exc})") from exc
        if isinstance(data, dict):
            return {str(k) for k in data}
        if isinstance(data, list) and all(isinstance(w, str) for w in data):
            return set(data)
        raise TellkitError(f"{what}: {path} must be a JSON list of words or an object keyed by word")
    return {w.strip() for w in text.split("\n")} - {""}


def read_name_counters(path: str, what: str = "--name-counters") -> tuple[set[str], set[str]]:
    """The reference's ``name_counters.pkl`` (``{"caption": Counter, "context": Counter}`` of the
    training captions' and articles' PROPN tokens): (caption words, article words). Read by a
    restricted unpickler that resolves ``collections.Counter`` and nothing else."""
    data = restricted_load(io.BytesIO(read_bytes(path, what, MAX_BYTES)), {"collections.Counter"}, what)
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("caption", "context")):
        raise TellkitError(f"{what}: {path} is not the reference's name counters (a dict with 'caption' and "
                           "'context' counters)")
    return {str(w) for w in data["caption"]}, {str(w) for w in data["context"]}


def read_generations(path: str) -> list[dict]:
    """The reference's ``generations.jsonl``: one JSON object a line, each with ``generation`` and
    a reference caption (``raw_caption`` or ``caption``)."""
    records = []
    for n, line in enumerate(read_text(path, "--generations", MAX_BYTES).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise TellkitError(f"--generations: {path} line {n} is not JSON ({exc})") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("generation"), str) or \
                not isinstance(obj.get("raw_caption", obj.get("caption")), str):
            raise TellkitError(f"--generations: {path} line {n} needs the strings 'generation' and "
                               "'raw_caption' (or 'caption')")
        records.append(obj)
    if not records:
        raise TellkitError(f"--generations: {path} has no generations")
    return records


def reference_caption(obj: Mapping) -> str:
    return obj.get("raw_caption", obj.get("caption"))


def _stored(obj: Mapping) -> tuple | None:
    keys = ("generated_entities", "generated_names", "caption_entities", "caption_names")
    if not all(isinstance(obj.get(k), list) for k in keys):
        return None
    try:
        ents = [[(str(e["text"]), str(e["label"])) for e in obj[k]] for k in ("generated_entities", "caption_entities")]
    except (TypeError, KeyError) as exc:
        raise TellkitError(f"--generations: an entity is not a {{'text', 'label'}} object ({exc})") from exc
    return ents[0], [str(w) for w in obj["generated_names"]], ents[1], [str(w) for w in obj["caption_names"]]


def _stored_figure(obj: Mapping, section: str, key: str, scale: float) -> float | None:
    value = (obj.get(section) or {}).get(key) if isinstance(obj.get(section), dict) else None
    return scale * float(value) if isinstance(value, (int, float)) else None


def score_generations(records: list[dict], *, train_words: Iterable[str] | None = None,
                      article_words: Iterable[str] | None = None, model: str = DEFAULT_MODEL,
                      nlp: Any = None) -> dict[str, Any]:
    """The report of the module docstring for the reference's generation records."""
    analysed = [_stored(r) for r in records]
    missing = [i for i, a in enumerate(analysed) if a is None]
    out: dict[str, Any] = {"n": len(records), "stored_annotations": len(records) - len(missing)}
    if missing:
        name = None if nlp is not None else resolve_model(model)
        pipeline = nlp or load_nlp(name)
        gen = analyse([records[i]["generation"] for i in missing], pipeline)
        ref = analyse([reference_caption(records[i]) for i in missing], pipeline)
        for i, (ge, gp), (re_, rp) in zip(missing, gen, ref):
            analysed[i] = (ge, gp, re_, rp)
        out["ner_model"] = name or getattr(pipeline, "__name__", type(pipeline).__name__)
    out.update(scores_from_analysed(analysed, train_words=train_words, article_words=article_words))
    out.update(linguistic_scores(r["generation"] for r in records))
    out.update(linguistic_scores((reference_caption(r) for r in records), prefix="reference_"))
    # the reference's own per-caption TTR (a fraction) and Flesch (textstat), where it stored them
    for prefix, side in (("", "gen"), ("reference_", "caption")):
        ttr = [_stored_figure(r, f"{side}_np", "basic_ttr", 100.0) for r in records]
        flesch = [_stored_figure(r, f"{side}_readability", "flesch_reading_ease", 1.0) for r in records]
        if all(v is not None for v in ttr):
            out[prefix + "ttr"] = sum(ttr) / len(ttr)
        if all(v is not None for v in flesch):
            out[prefix + "flesch"] = sum(flesch) / len(flesch)
    return out
