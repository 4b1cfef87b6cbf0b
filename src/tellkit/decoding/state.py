"""Incremental decoding state: one convention for every decoder that generates token by token.

Three pieces, used by Transform and Tell, BTTR and the LSTM / seq2seq baselines:

* :class:`IncrementalDecoder` is what a search talks to (:mod:`tellkit.decoding.search`, and
  BTTR's joint search in :mod:`tellkit.models.bttr_search`): ``step(tokens)`` returns the
  log-probabilities of the next token for every row, ``reorder(index)`` makes row ``i`` continue
  from old row ``index[i]`` (beams re-ranked, rows of finished inputs dropped).
* Per-row state lives in plain dicts (one per decoder layer) whose tensors have the decoder row
  on axis 0: self-attention keys/values (``MultiheadAttention(cache=...)``, a ``KVCache``), dynamic-convolution
  histories (``DynamicConv1d(state=...)``), LSTM ``h``/``c``. :func:`reorder_state` gives
  any nesting of them re-indexed.
* Per-input context (projected image / article / memory keys and values) is the same for every
  beam of one input. :class:`RowContext` keeps it per row and re-indexes it only when the
  row -> input mapping changes (rows of finished inputs dropped), never for a beam permutation,
  which saves copying the largest tensors of the search at every step.

The Hugging Face backbones of VG-BART / VG-T5 keep their own ``past_key_values`` inside
``transformers``' ``generate`` and do not use this module.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch


class IncrementalDecoder(Protocol):
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [N, t] row histories (beginning with the start token) -> float [N, V]
        log-probabilities of the next token. The decoder keeps its own state, so it only needs
        to process ``tokens[:, -1]``."""
        ...

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` of the state becomes old row ``index[i]``."""
        ...


def reorder_state(state: Any, index: torch.Tensor) -> Any:
    """``state`` with the rows of every tensor in it replaced by ``state[index]`` (axis 0).

    ``state`` may be a tensor, an object with ``index_select(index)`` (``ProjectedKV``,
    ``Contexts``, ``KVCache``), or dicts / lists / tuples of these, nested; other values (ints,
    None) are kept. Returns new containers and leaves the tensors of ``state`` untouched, so a
    caller's copy stays valid; a ``KVCache`` is the exception: it hands its buffers on to the
    re-indexed one (no allocation per step) and is retired."""
    if isinstance(state, torch.Tensor):
        return state.index_select(0, index.to(state.device))
    if isinstance(state, dict):
        return {key: reorder_state(value, index) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(reorder_state(v, index) for v in state)
    if hasattr(state, "index_select"):
        return state.index_select(index)
    return state


class RowContext:
    """Context shared by the rows of one input, held per row.

    ``value``: anything :func:`reorder_state` handles, one row per decoder row; ``owner`` [N]:
    the input each row belongs to. :meth:`reorder` copies ``value`` only when the owners change."""

    def __init__(self, value: Any, owner: torch.Tensor):
        self.value = value
        self.owner = owner.detach().cpu()

    def reorder(self, index: torch.Tensor) -> None:
        owner = self.owner[index.cpu()]
        if not torch.equal(owner, self.owner):
            self.value = reorder_state(self.value, index)
        self.owner = owner
