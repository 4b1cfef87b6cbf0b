"""Which part of an article the captioner reads (Transform and Tell, Section 4 / reference code).

    ctx = build_context(title, paragraphs, image_index=6, count_tokens=enc.count_tokens,
                        max_tokens=enc.max_tokens - enc.num_special)
    ctx.text          # what to feed ArticleEncoder.encode (which truncates to its budget)
    ctx.paragraphs    # indices of the paragraphs used, in document order
    ctx.n_tokens      # tokens of ctx.text the encoder keeps (<= max_tokens)

``paragraphs[:image_index]`` come before the image. An empty string in ``paragraphs`` is a slot
that holds no text (NYTimes800k: another image's caption between paragraphs); it is never read
but it takes a step of the walk, as the reference's walk over ``parsed_section`` does.

Policy ``"reference"`` (default), the rules of the reference code:

- ``image_index=k`` (NYTimes800k, "location-aware"): the title, then the first paragraph (not
  counted toward the budget), then rounds of one step above the image (k-1, k-2, ...) and one
  step below it (k, k+1, ...); a step on a paragraph takes it and adds its token count. The walk
  stops after the round in which the count (title included) reaches ``max_tokens``, or when
  both directions are exhausted. The text is ``"\n".join(title, first, above..., below...)``
  in document order, stripped; the encoder then cuts it hard at ``max_tokens`` tokens, so the
  paragraphs of the last round may be cut or dropped.
- ``image_index=None`` (GoodNews): ``title + "\n\n" + article`` (the article's paragraphs joined
  by blank lines), its first ``first_words`` space-separated words, cut at ``max_tokens`` by the
  encoder.

Policy ``"cut"`` (a compact builder, not the reference's rules): the title, the first
paragraph, then paragraphs alternately above and below the image (:func:`reading_order`) while
they fit; the first paragraph that does not fit is cut at a word boundary and building stops; whitespace is normalised.

``count_tokens`` defaults to the caption tokenizer (RoBERTa BPE, as the paper's "510 BPE
tokens"); pass the article encoder's own counter when it is not RoBERTa. ``tokenize`` (optional)
gives ``ctx.tokens``: the first ``max_tokens`` tokens of the text, what the encoder reads.

``split_parsed_section(parsed_section, image_position)`` turns a NYTimes800k ``parsed_section``
into ``(paragraphs, image_index)``: paragraph texts, other captions as empty slots, the image's
own caption removed.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tellkit.encoders.tokenizer import CaptionTokenizer

DEFAULT_MAX_TOKENS = 510  # 512 minus <s> and </s>
SEPARATOR = "\n"
POLICIES = ("reference", "cut")
GOODNEWS_FIRST_WORDS = 500


@dataclass
class ArticleContext:
    text: str
    paragraphs: list[int] = field(default_factory=list)  # indices into the input paragraphs
    n_tokens: int = 0
    truncated: bool = False  # True when part of the article was left out (cut or not reached)
    tokens: list[Any] | None = None  # with ``tokenize``: the first max_tokens tokens of ``text``


def _default_counter() -> Callable[[str], int]:

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
                  max_tokens: int = DEFAULT_MAX_TOKENS, sep: str = SEPARATOR, *, policy: str = "reference",
                  first_words: int | None = GOODNEWS_FIRST_WORDS,
                  tokenize: Callable[[str], Sequence[Any]] | None = None) -> ArticleContext:
    """Pick the paragraphs the captioner reads; see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"context policy must be one of {POLICIES}, got {policy!r}")
    count = count_tokens or _default_counter()
    if policy == "reference":
        ctx = _reference_context(title, paragraphs, image_index, count, max_tokens, first_words)
    else:
        ctx = _cut_context(title, paragraphs, image_index, count, max_tokens, sep)
    if tokenize is not None:
        ctx.tokens = list(tokenize(ctx.text))[:max_tokens]
    return ctx


def _reference_context(title: str, paragraphs: Sequence[str], image_index: int | None,
                       count: Callable[[str], int], max_tokens: int, first_words: int | None) -> ArticleContext:
    title = (title or "").strip()
    paras = list(paragraphs)
    if image_index is None:  # GoodNews: title + blank line + article, first words
        article = "\n\n".join(paras).strip()
        text = f"{title}\n\n{article}" if title else article
        used = list(range(len(paras)))
        words = text.split(" ")
        cut_words = first_words is not None and len(words) > first_words
        if cut_words:
            text = " ".join(words[:first_words])
            kept = len(text) - (len(title) + 2 if title else 0)  # characters of the article kept
            used, pos = [], 0
            for i, p in enumerate(paras):
                if pos < kept and p.strip():
                    used.append(i)
                pos += len(p) + 2
        text = text.strip()
        n = count(text)
        return ArticleContext(text, used, min(n, max_tokens), cut_words or n > max_tokens)
    n_words = count(title) if title else 0
    first = next((i for i, p in enumerate(paras) if p), None)
    k = first if first is not None else len(paras)  # no paragraph: nothing above/below to take
    before: list[int] = []
    after: list[int] = []
    i, j = int(image_index) - 1, int(image_index)
    while True:
        if i > k and paras[i]:
            before.insert(0, i)
            n_words += count(paras[i])
        i -= 1
        if k < j < len(paras) and paras[j]:
            after.append(j)
            n_words += count(paras[j])
        j += 1
        if n_words >= max_tokens or (i <= k and j >= len(paras)):
            break
    order = ([first] if first is not None else []) + before + after
    text = "\n".join(([title] if title else []) + [paras[x] for x in order]).strip()
    n = count(text)
    taken = set(order)
    left_out = any(p for x, p in enumerate(paras) if p and x not in taken)
    return ArticleContext(text, sorted(order), min(n, max_tokens), left_out or n > max_tokens)


def _cut_context(title: str, paragraphs: Sequence[str], image_index: int | None,
                 count: Callable[[str], int], max_tokens: int, sep: str) -> ArticleContext:
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
    """NYTimes800k ``parsed_section`` + one of its ``image_positions`` -> (texts, image index):
    paragraph texts as they are stored, every other section (other images' captions) as an
    empty slot, the image's own caption section left out; ``texts[:index]`` are above the image.
    The slots keep the reference's walk, which steps over sections, exact."""
    texts: list[str] = []
    image_index = None
    for pos, sec in enumerate(parsed_section):
        if pos == image_position:
            image_index = len(texts)
            continue
        texts.append((sec.get("text") or "") if sec.get("type") == "paragraph" else "")
    return texts, (len(texts) if image_index is None else image_index)
