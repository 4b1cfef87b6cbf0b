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


def draw(step_fn: Callable, output: VocabOutput, state: dict[str, Any], batch_size: int, num_samples: int, *,
         bos_id: int, eos_id: int, pad_id: int, max_len: int, min_len: int = 1, temperature: float = 1.0,
         greedy: bool = False, generator: torch.Generator | None = None, device=None) -> dict[str, Any]:
    """``num_samples`` captions per input (rows of input b consecutive) drawn token by token with
    ``step_fn(last_tokens, state) -> (x [N, dim], state)`` and ``output`` (p(word | x)) in the
    caller's mode and with gradients, as self-critical training draws them (Rennie et al. 2017;
    the reference's ``_sample``): a row stops when it draws EOS, or is cut after ``max_len``
    tokens without one.

    Each token is drawn from the model's distribution with PAD and BOS removed (and EOS before
    ``min_len`` tokens), renormalised, at ``temperature`` (``greedy``: its most likely token);
    ``log_probs`` [N, max_len] holds the drawn token's log-probability under that distribution
    at temperature 1, from this pass (the graph kept: the same dropout masks that drew it; the
    full distribution is built without a graph, the drawn and removed tokens' log-probabilities
    with one), zero after a row's end; ``mask`` [N, max_len] marks the drawn tokens, EOS
    included; ``tokens``: the drawn ids without EOS; ``finished``: whether the row drew EOS."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    N = batch_size * num_samples
    rows = torch.arange(batch_size, device=device).repeat_interleave(num_samples)
    state = reorder_state(state, rows)
    alive = torch.arange(N, device=device)  # output row of each decoder row
    last = torch.full((N,), bos_id, dtype=torch.long, device=device)
    tokens: list[list[int]] = [[] for _ in range(N)]
    finished = [False] * N
    where, values = [], []
    for t in range(max_len):
        x, state = step_fn(last, state)
        banned = [pad_id] + ([bos_id] if bos_id != eos_id else []) + ([eos_id] if t + 1 < min_len else [])
        with torch.no_grad():
            lp = output.log_probs(x).float()
            lp[:, banned] = float("-inf")
            if greedy:
                chosen = lp.argmax(-1)
            else:  # inverse CDF: one uniform number per row (multinomial draws one per word)
                cdf = torch.softmax(lp / temperature, -1).cumsum(-1)
                u = torch.rand(cdf.size(0), 1, generator=generator, device=cdf.device).clamp(min=1e-12)
                chosen = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp(max=cdf.size(1) - 1)
        n = chosen.numel()
        ids = torch.cat([chosen, torch.tensor(banned, device=chosen.device).repeat_interleave(n)])
        picked = output.target_log_probs(x.repeat(len(banned) + 1, 1), ids).view(len(banned) + 1, n)
        removed = picked[1:].exp().sum(0).clamp(max=1.0 - 1e-6)
        where.append(alive * max_len + t)
        values.append(picked[0] - torch.log1p(-removed))
        done = chosen == eos_id
        for row, tok, end in zip(alive.tolist(), chosen.tolist(), done.tolist()):
            if end:
                finished[row] = True
            else:
                tokens[row].append(tok)
        keep = (~done).nonzero(as_tuple=True)[0]
        if keep.numel() == 0:
            break
        if keep.numel() < done.numel():
            state = reorder_state(state, keep)
        alive, last = alive[keep], chosen[keep]
    index = torch.cat(where)
    flat = torch.zeros(N * max_len, dtype=torch.float32, device=index.device)
    mask = torch.zeros(N * max_len, dtype=torch.bool, device=index.device)
    return {"tokens": tokens, "finished": finished,
            "log_probs": flat.index_put((index,), torch.cat(values)).view(N, max_len),
            "mask": mask.index_fill(0, index, True).view(N, max_len)}


def attention_lists(alphas: dict[str, torch.Tensor], valid: dict[str, torch.Tensor], b: int,
                    n_steps: int) -> list[dict[str, list[float]]]:
    """Per generated token (EOS included), context -> weights over that context's real entries."""
    out = []
    for t in range(n_steps):
        out.append({name: a[b, t][valid[name][b]].tolist() for name, a in alphas.items()})
    return out
