"""CIDEr-D of single captions against document frequencies fixed in advance: the reward of
self-critical training (:mod:`tellkit.training.self_critical`).

The evaluation metric (:mod:`tellkit.metrics.caption`, the COCO caption code) takes its document
frequencies from the references of the whole scored set. A reward needs the same number for one
caption at a time, so :class:`CiderD` computes the frequencies once from a reference corpus (the
training captions, as Rennie et al. 2017 and later self-critical work do) and scores any caption
against its own references with them. Everything else is the COCO code's CIDEr-D: n-grams 1-4,
tf-idf vectors, clipped cosine similarity, the Gaussian length penalty (sigma 6) measured the way
that code measures length (the count of bigrams), mean over references, x10. With the
frequencies of the scored set itself the scores equal ``pycocoevalcap``'s (tested).

Texts are compared as given, split on whitespace: normalise them first (:func:`prepare`). The
self-critical reward appends :data:`EOS_WORD` to every text that ends with the end token (the
references, their document frequencies, a drawn caption that drew EOS), as the reference
implementation scores token ids up to and including its end id.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from tellkit.errors import TellkitError
from tellkit.metrics.caption import normalize

N = 4
SIGMA = 6.0
# the word that stands for the end token in a reward's text (never produced by prepare(): it
# removes "<" and ">")
EOS_WORD = "<eos>"


def prepare(text: str, lowercase: bool = True) -> str:
    """Punctuation removed, whitespace collapsed, lower-cased (the metric's text)."""
    text = normalize(text)
    return text.lower() if lowercase else text


def ngram_counts(text: str, n: int = N) -> Counter:
    words = text.split()
    return Counter(tuple(words[i:i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


class CiderD:
    """``corpus``: one list of reference captions per image (already :func:`prepare`-d); an
    n-gram's document frequency is the number of images whose references hold it."""

    def __init__(self, corpus: Iterable[Sequence[str]], n: int = N, sigma: float = SIGMA):
        self.n, self.sigma = n, sigma
        df: Counter = Counter()
        images = 0
        for refs in corpus:
            images += 1
            df.update({g for r in refs for g in ngram_counts(r, n)})
        if images == 0:
            raise TellkitError("CIDEr-D needs a reference corpus of at least one image")
        self.df = df
        self.log_images = math.log(float(images))
        self._ref_cache: dict[str, tuple] = {}

    def _vector(self, text: str):
        vec: list[dict] = [{} for _ in range(self.n)]
        norm = [0.0] * self.n
        length = 0
        for gram, tf in ngram_counts(text, self.n).items():
            k = len(gram) - 1
            w = float(tf) * (self.log_images - math.log(max(1.0, self.df.get(gram, 0.0))))
            vec[k][gram] = w
            norm[k] += w * w
            if k == 1:  # the COCO code's "length": its count of bigrams
                length += tf
        return vec, [math.sqrt(x) for x in norm], length

    def _ref(self, text: str):
        got = self._ref_cache.get(text)
        if got is None:
            if len(self._ref_cache) > 200_000:
                self._ref_cache.clear()
            got = self._ref_cache[text] = self._vector(text)
        return got

    def score(self, caption: str, references: Sequence[str]) -> float:
        """CIDEr-D of one caption against its references, on the COCO code's scale (its
        per-image value; tables print the corpus mean x100)."""
        if not references:
            raise TellkitError("CIDEr-D needs at least one reference")
        hv, hn, hl = self._vector(caption)
        total = 0.0
        for r in references:
            rv, rn, rl = self._ref(r)
            penalty = math.exp(-((hl - rl) ** 2) / (2 * self.sigma ** 2))
            s = 0.0
            for k in range(self.n):
                ref_k = rv[k]
                v = sum(min(w, ref_k.get(g, 0.0)) * ref_k.get(g, 0.0) for g, w in hv[k].items())
                if hn[k] != 0 and rn[k] != 0:
                    v /= hn[k] * rn[k]
                s += v * penalty
            total += s / self.n
        return 10.0 * total / len(references)
