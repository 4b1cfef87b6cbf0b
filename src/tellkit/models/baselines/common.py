"""Pieces shared by the LSTM caption baselines (Show and Tell, Show-Attend-and-Tell, the LSTM
ablation rows of Transform and Tell): reading context sets from a captioning batch and
generation through the project's one search (:mod:`tellkit.decoding.search`), returning
what ``TransformAndTell.generate`` returns.

Batch keys: :class:`tellkit.data.batch.CaptionBatch` (``caption`` [B, T], and per context
``<name>`` float [B, N, C] with ``<name>_mask`` bool [B, N], True = a real entry).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tellkit.data.batch import read_context
from tellkit.decoding.search import run_sample, run_search
from tellkit.decoding.state import reorder_state
from tellkit.errors import TellkitError
from tellkit.layers.adaptive import AdaptiveSoftmax

# one checked reader of a context set for every captioner (True = a real entry)
context_set = read_context


def masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the real entries: [B, N, C], [B, N] -> [B, C] (zeros for an empty set)."""
    w = valid.to(x.dtype)[..., None]
    return (x * w).sum(1) / w.sum(1).clamp(min=1.0)


def masked_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis restricted to ``valid``; an empty set gets all-zero weights."""
    scores = scores.float().masked_fill(~valid, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)


def shift(caption: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher forcing: (inputs [B, T-1], targets [B, T-1], target mask [B, T-1])."""
    if caption.dim() != 2 or caption.size(1) < 2:
        raise TellkitError(f"caption must be [B, T>=2] token ids, got {tuple(caption.shape)}")
    inp, target = caption[:, :-1], caption[:, 1:]
    return inp, target, target != pad_id


class VocabOutput(nn.Module):
    """p(word | x) over the caption vocabulary: a full softmax (as the papers), or with
    ``cutoffs`` an adaptive softmax (:mod:`tellkit.layers.adaptive`), which keeps the output
    layer affordable over RoBERTa's 50,265 BPE ids (the papers had ~10K-word vocabularies)."""

    def __init__(self, vocab_size: int, dim: int, cutoffs: tuple[int, ...] = (), factor: float = 1.0):
        super().__init__()

        self.linear = nn.Linear(dim, vocab_size) if not cutoffs else None
        self.adaptive = AdaptiveSoftmax(vocab_size, dim, cutoffs, factor) if cutoffs else None

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., vocab] (float32)."""
        if self.linear is not None:
            return torch.log_softmax(self.linear(x).float(), dim=-1)
        return self.adaptive.log_probs(x)

    def target_log_probs(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """[N, dim], [N] -> log p(target) [N] (float32)."""
        if self.linear is not None:
            return self.log_probs(x).gather(-1, target[:, None]).squeeze(-1)
        return self.adaptive.target_log_probs(x, target)


class RowState:
    """:class:`tellkit.decoding.state.IncrementalDecoder` over a step function:
    ``step_fn(last_tokens [N], state) -> (log_probs [N, V], new_state)``; ``state`` is a dict
    of tensors whose first axis is the row."""

    def __init__(self, step_fn: Callable, state: dict[str, Any]):
        self.step_fn, self.state = step_fn, state

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        lp, self.state = self.step_fn(tokens[:, -1], self.state)
        return lp

    def reorder(self, index: torch.Tensor) -> None:
        self.state = reorder_state(self.state, index)


def search(step_fn: Callable, state: dict[str, Any], batch_size: int, *, bos_id: int, eos_id: int, pad_id: int,
           max_len: int, beam_size: int = 1, length_penalty: float = 1.0, min_len: int = 1,
           no_repeat_ngram_size: int = 0, n_best: int = 1, device=None) -> dict[str, Any]:
    """Greedy (``beam_size=1``) or beam search over a :class:`RowState`; ``state`` holds one
    row per input and is repeated per beam here. Output as ``TransformAndTell.generate``."""
    common = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, max_len=max_len, min_len=min_len,
                  no_repeat_ngram_size=no_repeat_ngram_size, device=device)
    return run_search(lambda rows: RowState(step_fn, state if rows is None else reorder_state(state, rows)),
                      batch_size, beam_size=beam_size, length_penalty=length_penalty, n_best=n_best, **common)


def sample(step_fn: Callable, state: dict[str, Any], batch_size: int, num_samples: int, *, bos_id: int,
           eos_id: int, pad_id: int, max_len: int, min_len: int = 1, temperature: float = 1.0,
           generator: torch.Generator | None = None, device=None) -> dict[str, Any]:
    """``num_samples`` captions drawn per input (rows of input b consecutive) over a
    :class:`RowState`: ``tokens`` (no BOS/EOS) and ``log_probs`` (their summed log-probabilities),
    as ``TransformAndTell.sample``."""
    return run_sample(lambda rows: RowState(step_fn, reorder_state(state, rows)), batch_size, num_samples,
                      bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, max_len=max_len, min_len=min_len,
                      temperature=temperature, generator=generator, device=device)


def attention_lists(alphas: dict[str, torch.Tensor], valid: dict[str, torch.Tensor], b: int,
                    n_steps: int) -> list[dict[str, list[float]]]:
    """Per generated token (EOS included), context -> weights over that context's real entries."""
    out = []
    for t in range(n_steps):
        out.append({name: a[b, t][valid[name][b]].tolist() for name, a in alphas.items()})
    return out
