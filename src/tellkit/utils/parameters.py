"""Counting a model's parameters: each shared (tied) tensor once, and broken into disjoint parts
(what ``tellkit model-info`` prints and ``PretrainedMixin.parameter_breakdown`` gives)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def count_parameters(modules, trainable_only: bool = False, seen: set[int] | None = None) -> int:
    """Parameters of ``modules``, each shared (tied) tensor counted once. Pass the same ``seen``
    set to several calls to count each tensor only in the first call that meets it."""
    seen = set() if seen is None else seen
    n = 0
    for m in modules:
        for p in m.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            n += p.numel()
    return n


def parameter_breakdown(parts: Mapping[str, Any], whole: Any) -> dict[str, int]:
    """Trainable parameters per part (name -> a module, a list of modules, or None) of the
    module ``whole``, in one shape for every model: the parts are disjoint (a tensor shared by
    two parts, such as a tied embedding, counts in the first part that holds it) and sum to
    the trainable parameters of ``whole``; trainable parameters no part holds are counted as
    ``"other"``."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, part in parts.items():
        modules: Iterable[Any] = [] if part is None else [part] if hasattr(part, "parameters") else list(part)
        out[name] = count_parameters(modules, trainable_only=True, seen=seen)
    rest = count_parameters([whole], trainable_only=True, seen=seen)
    if rest:
        out["other"] = rest
    return out
