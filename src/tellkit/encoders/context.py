"""Which part of an article the captioner reads (Transform and Tell, Section 4 / reference code).

    ctx = build_context(title, paragraphs, image_index=6, count_tokens=enc.count_tokens,
                        max_tokens=enc.max_tokens - enc.num_special)
    ctx.text          # what to feed ArticleEncoder.encode
    ctx.paragraphs    # indices of the paragraphs used, in document order
    ctx.n_tokens      # count_tokens(ctx.text) <= max_tokens

- ``image_index=None`` (GoodNews): the title and then the paragraphs in order, up to the limit
  (the first ~510 tokens of the article).
- ``image_index=k`` (NYTimes800k, "location-aware"): the image sits after paragraph k-1, i.e.
  ``paragraphs[:k]`` are above it. Take the title, the first paragraph, then paragraphs
  alternately just above and just below the image (k-1, k, k-2, k+1, ...), moving outwards,
  until the budget is spent. The chosen paragraphs are joined in document order.
- The paragraph that no longer fits is cut at a word boundary to the tokens left, and building
  stops there. ``count_tokens`` defaults to the caption tokenizer (RoBERTa BPE, as the paper's
  "about 510 BPE tokens"); pass the article encoder's own counter when it is not RoBERTa.

``split_parsed_section(parsed_section, image_position)`` turns a NYTimes800k ``parsed_section``
(paragraphs and captions interleaved; ``image_positions`` index into it) into
``(paragraphs, image_index)`` for :func:`build_context`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

DEFAULT_MAX_TOKENS = 510  # 512 minus <s> and </s>
SEPARATOR = "\n"


@dataclass
class ArticleContext:
    text: str
    paragraphs: list[int] = field(default_factory=list)  # indices into the input paragraphs
    n_tokens: int = 0
    truncated: bool = False  # True when part of the article was left out (cut or not reached)


def _default_counter() -> Callable[[str], int]:
    from tellkit.encoders.tokenizer import CaptionTokenizer

    tok = CaptionTokenizer.load()
    return lambda text: len(tok.encode(text))


def _cut_to(text: str, budget: int, count: Callable[[str], int]) -> str:
    """The longest word prefix of ``text`` with at most ``budget`` tokens (binary search)."""
    words = text.split()
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def reading_order(n_paragraphs: int, image_index: int | None) -> list[int]:
    """Paragraph indices in the order they are taken (see the module docstring)."""
    if image_index is None:
        return list(range(n_paragraphs))
    k = max(0, min(int(image_index), n_paragraphs))
    order = [0] if n_paragraphs else []
    above, below = k - 1, k
    while above > 0 or below < n_paragraphs:
        if above > 0:
            order.append(above)
            above -= 1
        if below < n_paragraphs:
            if below != 0:
                order.append(below)
            below += 1
    return order


def build_context(title: str, paragraphs: Sequence[str], image_index: int | None = None,
                  count_tokens: Callable[[str], int] | None = None,
                  max_tokens: int = DEFAULT_MAX_TOKENS, sep: str = SEPARATOR) -> ArticleContext:
    """Pick the paragraphs that fill ``max_tokens``; see the module docstring."""
    count = count_tokens or _default_counter()
    sep_cost = count(sep) if sep.strip() else 0
    paras = [" ".join(p.split()) for p in paragraphs]  # one line each; no stray whitespace
    title = " ".join((title or "").split())
    used = 0
    head = ""
    truncated = False
    if title:
        head = title if count(title) <= max_tokens else _cut_to(title, max_tokens, count)
        truncated = head != title
        used = count(head)
    chosen: dict[int, str] = {}
    for i in reading_order(len(paras), image_index):
        if truncated:
            break
        if not paras[i]:
            continue
        cost = count(paras[i]) + (sep_cost if (head or chosen) else 0)
        if used + cost <= max_tokens:
            chosen[i], used = paras[i], used + cost
            continue
        left = max_tokens - used - (sep_cost if (head or chosen) else 0)
        cut = _cut_to(paras[i], left, count) if left > 0 else ""
        if cut:
            chosen[i] = cut
        truncated = True
    parts = ([head] if head else []) + [chosen[i] for i in sorted(chosen)]
    text = sep.join(parts)
    n = count(text)
    while n > max_tokens and parts:  # separators may merge with neighbours: trim to be exact
        last = max(chosen) if chosen else None
        words = parts[-1].split()
        parts[-1] = " ".join(words[:-1])
        if not parts[-1]:
            parts.pop()
            if last is not None:
                chosen.pop(last)
        elif last is not None:
            chosen[last] = parts[-1]
        text, n, truncated = sep.join(parts), count(sep.join(parts)), True
    return ArticleContext(text=text, paragraphs=sorted(chosen), n_tokens=n, truncated=truncated)


def split_parsed_section(parsed_section: Sequence[Mapping], image_position: int) -> tuple[list[str], int]:
    """NYTimes800k ``parsed_section`` + one of its ``image_positions`` -> (paragraph texts,
    number of paragraphs above the image)."""
    paragraphs: list[str] = []
    image_index = None
    for pos, sec in enumerate(parsed_section):
        if pos == image_position:
            image_index = len(paragraphs)
        if sec.get("type") == "paragraph":
            paragraphs.append(sec.get("text", ""))
    return paragraphs, (len(paragraphs) if image_index is None else image_index)
