"""One sample type for every captioning data set, and the article-context builders.

A :class:`CaptionSample` is one (image, caption) pair with whatever text context the data set
has: a news article (title + paragraphs, and where known the paragraph index at which the image
sits), or for plain captioning data another text (e.g. the image's other captions) or none.

Which paragraphs the captioner reads (first tokens for GoodNews, location-aware for
NYTimes800k) is decided by :func:`tellkit.encoders.context.build_context` from ``title``,
``paragraphs`` and ``image_position``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
