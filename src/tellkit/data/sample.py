"""One sample type for every captioning data set, and the article-context builders.

A :class:`CaptionSample` is one (image, caption) pair with whatever text context the data set
has: a news article (title + paragraphs, and where known the paragraph index at which the image
sits), or for plain captioning data another text (e.g. the image's other captions) or none.

Context building follows Transform and Tell (Tran et al. 2020):
- ``first_tokens`` (GoodNews): the article from its start, up to ``max_tokens`` tokens.
- ``location_aware`` (NYTimes800k): title, first paragraph, then paragraphs taken alternately
  just above and just below the image until about ``max_tokens`` tokens; kept in document order.
Token counts use whatever tokenizer the article encoder uses (``count_tokens``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

CONTEXT_MODES = ("first_tokens", "location_aware", "none")


@dataclass
class CaptionSample:
    id: str  # unique within its data set (one image + one caption)
    caption: str
    image_path: str | None = None
    image_id: str | None = None  # the image (several samples may share one)
    article_id: str | None = None
    title: str = ""
    paragraphs: list[str] = field(default_factory=list)  # article / context text, in order
    image_position: int | None = None  # paragraphs[:image_position] come before the image
    split: str | None = None  # "train" | "val" | "test"
    source: str = ""  # goodnews | nytimes800k | coco | flickr8k
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. precomputed face embeddings

    @property
    def article_text(self) -> str:
        return "\n\n".join(p for p in ([self.title] if self.title else []) + self.paragraphs)


def _default_count(text: str) -> int:
    return len(text.split())


def build_context(
    sample: CaptionSample,
    mode: str = "location_aware",
    max_tokens: int = 510,
    count_tokens: Callable[[str], int] | None = None,
) -> list[str]:
    """The context paragraphs for ``sample`` (title first when present). Falls back to
    ``first_tokens`` when the image position is unknown. The last paragraph may overrun the
    budget: the encoder truncates to its own maximum length."""
    if mode not in CONTEXT_MODES:
        raise ValueError(f"context mode must be one of {CONTEXT_MODES}, got {mode!r}")
    if mode == "none":
        return []
    count = count_tokens or _default_count
    paras = [p for p in sample.paragraphs if p.strip()]
    out: list[str] = [sample.title] if sample.title.strip() else []
    used = sum(count(p) for p in out)
    pos = sample.image_position
    if mode == "first_tokens" or pos is None or not paras:
        for p in paras:
            if used >= max_tokens:
                break
            out.append(p)
            used += count(p)
        return out
    # location-aware: the first paragraph, then alternately above / below the image
    out.append(paras[0])
    used += count(paras[0])
    pos = max(1, min(pos, len(paras)))
    above, below = [], []
    i, j = pos - 1, pos  # paras[i] is the nearest above, paras[j] the nearest below
    while used < max_tokens and (i >= 1 or j < len(paras)):
        if i >= 1:
            above.append(paras[i])
            used += count(paras[i])
            i -= 1
        if used < max_tokens and j < len(paras):
            below.append(paras[j])
            used += count(paras[j])
            j += 1
    return out + above[::-1] + below
