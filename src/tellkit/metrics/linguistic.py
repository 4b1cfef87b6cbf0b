"""Linguistic measures of captions (Transform and Tell, Table 5): length in words, type-token
ratio and Flesch reading ease, each computed per caption and averaged over the set.

- words: whitespace tokens after punctuation removal (``caption.normalize``);
- type-token ratio: distinct lower-cased words / words, x100;
- Flesch reading ease: 206.835 - 1.015 * words/sentences - 84.6 * syllables/words, where
  sentences count runs of . ! ? (at least one) and syllables are estimated per word as groups
  of vowels (a e i o u y), less a silent final "e" (but not "-le" after a consonant), at least 1.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from tellkit.metrics.caption import normalize

_VOWELS = re.compile(r"[aeiouy]+")
_SENT_END = re.compile(r"[.!?]+")


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


def flesch_reading_ease(text: str) -> float:
    words = normalize(text).split()
    if not words:
        return 0.0
    sentences = max(1, len([s for s in _SENT_END.split(text.strip()) if s.strip()]))
    syl = sum(syllables(w) for w in words)
    return 206.835 - 1.015 * len(words) / sentences - 84.6 * syl / len(words)


def type_token_ratio(text: str) -> float:
    words = [w.lower() for w in normalize(text).split()]
    return 100.0 * len(set(words)) / len(words) if words else 0.0


def linguistic_scores(captions: Iterable[str]) -> dict[str, float]:
    caps = list(captions)
    if not caps:
        return {"length": 0.0, "ttr": 0.0, "flesch": 0.0}
    return {
        "length": sum(len(normalize(c).split()) for c in caps) / len(caps),
        "ttr": sum(type_token_ratio(c) for c in caps) / len(caps),
        "flesch": sum(flesch_reading_ease(c) for c in caps) / len(caps),
    }
