"""Linguistic measures of captions (Transform and Tell, Table 5; the reference's
``compute_metrics.py`` reports each for the generations AND the references): length in words,
distinct words, type-token ratio and Flesch reading ease, each computed per caption and
averaged over the set.

- words: whitespace tokens after punctuation removal (``caption.normalize``), as the reference
  counted caption length and distinct words ("Unique words");
- type-token ratio: distinct words / words, x100, case kept as the reference's ``basic_ttr``
  (which tokenised with nltk's ``word_tokenize`` and dropped punctuation tokens: "Obama's" is one
  word here, two there); ``lowercase=True`` folds case first;
- Flesch reading ease: 206.835 - 1.015 * words/sentences - 84.6 * syllables/words, where
  sentences count runs of . ! ? (at least one) and syllables are estimated per word as groups
  of vowels (a e i o u y), less a silent final "e" (but not "-le" after a consonant), at least 1.
  The reference used the ``textstat`` package (dictionary hyphenation), so single values differ
  by a few points; a caption with no words is undefined (None).

An empty set gives None for every measure (undefined), never 0.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from tellkit.metrics.caption import normalize

_VOWELS = re.compile(r"[aeiouy]+")
_SENT_END = re.compile(r"[.!?]+")
MEASURES = ("length", "unique_words", "ttr", "flesch")


def syllables(word: str) -> int:
    w = re.sub(r"[^a-z]", "", word.lower())
    if not w:
        return 0
    n = len(_VOWELS.findall(w))
    if len(w) > 2 and w.endswith("e") and not w.endswith(("le", "ee", "ye")) and w[-2] not in "aeiouy":
        n -= 1
    elif len(w) > 2 and w.endswith("le") and w[-3] in "aeiouy":
        n -= 1  # "-ale", "-ole" etc.: the e is silent
    return max(1, n)


def flesch_reading_ease(text: str) -> float | None:
    words = normalize(text).split()
    if not words:
        return None
    sentences = max(1, len([s for s in _SENT_END.split(text.strip()) if s.strip()]))
    syl = sum(syllables(w) for w in words)
    return 206.835 - 1.015 * len(words) / sentences - 84.6 * syl / len(words)


def type_token_ratio(text: str, lowercase: bool = False) -> float:
    words = normalize(text).split()
    if lowercase:
        words = [w.lower() for w in words]
    return 100.0 * len(set(words)) / len(words) if words else 0.0


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def linguistic_scores(captions: Iterable[str], prefix: str = "") -> dict[str, float | None]:
    """``length``, ``unique_words``, ``ttr``, ``flesch`` averaged over ``captions``, each key
    with ``prefix`` in front (``"reference_"`` for the references' figures)."""
    caps = list(captions)
    words = [normalize(c).split() for c in caps]
    scores = {
        "length": _mean([len(w) for w in words]),
        "unique_words": _mean([len(set(w)) for w in words]),
        "ttr": _mean([type_token_ratio(c) for c in caps]),
        "flesch": _mean([flesch_reading_ease(c) for c in caps]),
    }
    return {prefix + k: v for k, v in scores.items()}
