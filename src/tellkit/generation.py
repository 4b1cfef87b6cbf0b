"""Generation settings, held once (like Hugging Face's ``GenerationConfig``).

A captioner's recipe keeps them in its ``eval:`` section (``beam_size``, ``max_len``, ...);
evaluation, the captioning pipeline (``tellkit caption``, ``tellkit demo``, the server) and
the CLI all read them through :class:`GenerationConfig`, and a command-line flag overrides a
field with :meth:`GenerationConfig.updated`::

    gen = GenerationConfig.from_section(recipe["eval"])      # other eval keys are ignored here
    gen = gen.updated(beam_size=args.beam_size)              # None leaves a field as it is
    out = model.generate(batch, **gen.kwargs())
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tellkit.config import from_dict
from tellkit.errors import TellkitError


@dataclass
class GenerationConfig:
    """How a captioner decodes (the ``generate`` keyword arguments of every captioning family)."""

    max_len: int | None = None  # most generated tokens, EOS included; None: the model's own default
    beam_size: int = 1  # 1 = greedy (the Transform and Tell reference decodes greedily)
    length_penalty: float = 1.0  # a finished beam scores sum(log p) / length ** length_penalty
    min_len: int = 1  # EOS is forbidden before this many tokens
    no_repeat_ngram_size: int = 0  # >0: never repeat an n-gram of this size

    def __post_init__(self) -> None:
        for name in ("beam_size", "min_len"):
            if int(getattr(self, name)) < 1:
                raise TellkitError(f"generation: {name} must be at least 1, got {getattr(self, name)}")
        if self.max_len is not None and int(self.max_len) < 1:
            raise TellkitError(f"generation: max_len must be at least 1, got {self.max_len}")
        if int(self.no_repeat_ngram_size) < 0:
            raise TellkitError(f"generation: no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None, where: str = "eval") -> GenerationConfig:
        """The generation fields of a recipe section (other keys are left to its own config)."""
        section = dict(section or {})
        return from_dict(cls, {k: v for k, v in section.items() if k in cls.fields()}, where)

    def updated(self, **overrides: Any) -> GenerationConfig:
        """A copy with the given fields replaced; ``None`` values leave a field unchanged."""
        unknown = sorted(set(overrides) - set(self.fields()))
        if unknown:
            raise TellkitError(f"generation: unknown setting(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate``."""
        return {f: getattr(self, f) for f in self.fields()}
