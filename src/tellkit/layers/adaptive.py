"""Adaptive input embeddings (Baevski & Auli, ICLR 2019) and an adaptive softmax (Grave et al.
2017) tied to them, as in Transform and Tell's decoder.

The vocabulary is split into bands by ``cutoffs`` (reference: [5000, 20000] over RoBERTa's
50,265 tokens -> bands of 5,000 / 15,000 / 30,265 frequent-to-rare tokens). Band i embeds
into ``dim // factor**i`` dimensions and projects up to ``dim``. Transform and Tell uses
factor 1 (every band 1024-d): that is where its 54.6M embedding parameters come from.

The adaptive softmax's head scores the first band's words plus one "cluster" logit per tail;
a tail's words are scored as log p(cluster) + log p(word | cluster). Tied to the adaptive
input: the head's word weights are band 0's embedding, each tail's output weights are its
band's embedding; each tail's input projection (d -> band dim) is its own parameter unless
``tie_proj`` (then the band's up-projection, transposed). Token ids follow the vocabulary's
order, which for RoBERTa's BPE is roughly by frequency.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.layers import rows


def _bands(vocab_size: int, cutoffs: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    edges = [0, *cutoffs, vocab_size]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"cutoffs {list(cutoffs)} must be increasing and below vocab_size {vocab_size}")
    return list(zip(edges, edges[1:]))


class AdaptiveInput(nn.Module):
    def __init__(self, vocab_size: int, dim: int, cutoffs, factor: float = 1.0, padding_idx: int | None = 1,
                 band_padding_idx: int | None = None):
        """``padding_idx``: a vocabulary id whose embedding starts at zero. ``band_padding_idx``:
        instead, row ``band_padding_idx`` of EVERY band is zero and never updated (the reference
        configures ``padding_idx: 0`` per band, so ids 0, 5000 and 20000 embed to zero)."""
        super().__init__()
        self.vocab_size, self.dim, self.factor = vocab_size, dim, factor
        self.bands = _bands(vocab_size, cutoffs)
        self.padding_idx = padding_idx
        self.band_padding_idx = band_padding_idx
        self.embeddings = nn.ModuleList()
        self.projections = nn.ModuleList()
        for i, (lo, hi) in enumerate(self.bands):
            bdim = int(dim // (factor**i))
            emb = nn.Embedding(hi - lo, bdim, padding_idx=band_padding_idx)
            nn.init.normal_(emb.weight, mean=0.0, std=bdim**-0.5)
            with torch.no_grad():
                if band_padding_idx is not None:
                    emb.weight[band_padding_idx].zero_()
                elif padding_idx is not None and lo <= padding_idx < hi:
                    emb.weight[padding_idx - lo].zero_()
            proj = nn.Linear(bdim, dim, bias=False)
            nn.init.xavier_uniform_(proj.weight)
            self.embeddings.append(emb)
            self.projections.append(proj)

    def band_dim(self, i: int) -> int:
        return self.embeddings[i].embedding_dim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.projections[0].weight.new_zeros(*tokens.shape, self.dim)
        for (lo, hi), emb, proj in zip(self.bands, self.embeddings, self.projections):
            sel = (tokens >= lo) & (tokens < hi)
            if sel.any():
                e = emb(tokens[sel] - lo)
                # the packed product only where asked for (rows.prepacked): other callers keep proj(e)
                y = rows.linear(proj, e) if rows.prepacking() else proj(e)
                out[sel] = y.to(out.dtype)  # float32 under autocast too
        return out


class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax; pass ``tied_to`` (an :class:`AdaptiveInput`) to share its weights."""

    def __init__(self, vocab_size: int, dim: int, cutoffs, factor: float = 1.0, dropout: float = 0.0,
                 tied_to: AdaptiveInput | None = None, tie_proj: bool = False):
        super().__init__()
        self.vocab_size, self.dim, self.dropout = vocab_size, dim, dropout
        self.bands = _bands(vocab_size, cutoffs)
        self.head_size = self.bands[0][1]
        n_tails = len(self.bands) - 1
        self._tied = [tied_to] if tied_to is not None else []  # not a submodule: no duplicate params
        self.tie_proj = tie_proj and tied_to is not None
        if tied_to is None:
            self.head_words = nn.Parameter(torch.empty(self.head_size, dim))
            nn.init.xavier_uniform_(self.head_words)
        else:
            if tied_to.band_dim(0) != dim:
                raise ValueError("tied adaptive softmax needs band 0 of the input embedding to be d-dimensional")
            self.head_words = None
        self.class_proj = nn.Linear(dim, n_tails, bias=False)
        self.tail_proj = nn.ModuleList()
        self.tail_out = nn.ParameterList()
        for i, (lo, hi) in enumerate(self.bands[1:], start=1):
            tdim = int(dim // (factor**i))
            if tied_to is not None and tied_to.band_dim(i) != tdim:
                raise ValueError(f"tail {i} dim {tdim} != adaptive input band dim {tied_to.band_dim(i)} "
                                 "(use one factor)")
            if not self.tie_proj:
                p = nn.Linear(dim, tdim, bias=False)
                nn.init.xavier_uniform_(p.weight)
                self.tail_proj.append(p)
            if tied_to is None:
                w = nn.Parameter(torch.empty(hi - lo, tdim))
                nn.init.xavier_uniform_(w)
                self.tail_out.append(w)

    # -- weights (own or tied) ------------------------------------------------------------
    def _head_weight(self) -> torch.Tensor:
        return self.head_words if self.head_words is not None else self._tied[0].embeddings[0].weight

    def _tail_out_weight(self, i: int) -> torch.Tensor:  # i = 1..n_tails
        return self._tied[0].embeddings[i].weight if self._tied else self.tail_out[i - 1]

    def _tail_hidden(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.tie_proj:
            h = rows.dense(x, self._tied[0].projections[i].weight.t())
        else:
            h = rows.linear(self.tail_proj[i - 1], x)
        return F.dropout(h, p=self.dropout, training=self.training)

    def _head_logprobs(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([rows.dense(x, self._head_weight()), rows.linear(self.class_proj, x)], dim=-1)
        return torch.log_softmax(logits.float(), dim=-1)

    # -- public API ------------------------------------------------------------------------
    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Full log-distribution: [..., dim] -> [..., vocab_size] (float32)."""
        shape = x.shape[:-1]
        x = F.dropout(x.reshape(-1, self.dim), p=self.dropout, training=self.training)
        head = self._head_logprobs(x)
        parts = [head[:, : self.head_size]]
        for i in range(1, len(self.bands)):
            tail = torch.log_softmax(rows.dense(self._tail_hidden(x, i), self._tail_out_weight(i)).float(), dim=-1)
            parts.append(tail + head[:, self.head_size + i - 1: self.head_size + i])
        return torch.cat(parts, dim=-1).view(*shape, self.vocab_size)

    def target_log_probs(self, x: torch.Tensor, target: torch.Tensor,
                         ignore_in_cluster: int | None = None) -> torch.Tensor:
        """log p(target) without building the full distribution: [N, dim], [N] -> [N] (float32).
        Tails are evaluated only for the rows whose target falls in them.

        ``ignore_in_cluster``: reproduce fairseq's AdaptiveLoss, which applies the padding index
        to each tail's *relative* targets as well, so a word whose id within its tail equals it
        (ids cutoff + 1) contributes only log p(cluster)."""
        x = F.dropout(x.reshape(-1, self.dim), p=self.dropout, training=self.training)
        target = target.reshape(-1)
        head = self._head_logprobs(x)
        out = head.new_zeros(target.shape)
        in_head = target < self.head_size
        out[in_head] = head[in_head].gather(1, target[in_head, None]).squeeze(1)
        for i, (lo, hi) in enumerate(self.bands[1:], start=1):
            sel = ((target >= lo) & (target < hi)).nonzero(as_tuple=True)[0]
            if sel.numel() == 0:
                continue
            tail = torch.log_softmax(rows.dense(self._tail_hidden(x[sel], i), self._tail_out_weight(i)).float(), dim=-1)
            word = tail.gather(1, (target[sel] - lo)[:, None]).squeeze(1)
            if ignore_in_cluster is not None:
                word = word.masked_fill(target[sel] - lo == ignore_in_cluster, 0.0)
            out[sel] = head[sel, self.head_size + i - 1] + word
        return out
