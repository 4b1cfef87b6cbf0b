"""Multi-head attention (Vaswani et al. 2017) as Transform and Tell's reference uses it.

Differences from ``torch.nn.MultiheadAttention`` that the models here need:
- keys and values may have their own input sizes (``kdim``, ``vdim``): image 2048-d, faces
  512-d, article 1024-d, all attended from a 1024-d decoder state;
- ``add_bias_kv`` appends a learned key/value pair and ``add_zero_attn`` a zero key/value, so a
  query always has somewhere to attend: an empty context set (an image with no faces) is legal
  and yields a well-defined output;
- the key/value projections of a fixed context can be computed ONCE per input
  (:meth:`project_kv`) and reused at every decoding step (:meth:`attend`);
- self-attention keeps an incremental key/value cache (``cache`` dict) for fast generation;
- the attention weights (averaged over heads, over the real keys only) can be returned for
  visualisation.

Masks: ``key_padding_mask`` is bool [B, S] with True = ignore (padding), PyTorch's convention;
``attn_mask`` is bool [T, S] with True = not allowed (e.g. the future).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ProjectedKV:
    """Keys/values of one context, projected and split into heads once per input."""

    k: torch.Tensor  # [B, H, S', hd]  (S' = S + extra slots)
    v: torch.Tensor  # [B, H, S', hd]
    key_padding_mask: torch.Tensor | None  # [B, S'] True = ignore
    num_real: int  # S: keys that came from the input (the rest are bias / zero slots)

    def index_select(self, index: torch.Tensor) -> ProjectedKV:
        m = self.key_padding_mask.index_select(0, index) if self.key_padding_mask is not None else None
        return ProjectedKV(self.k.index_select(0, index), self.v.index_select(0, index), m, self.num_real)


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
    ):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout = dropout
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.reset_parameters()

    def reset_parameters(self) -> None:
        same = self.kdim == self.vdim == self.embed_dim
        gain = 1 / math.sqrt(2) if same else 1.0
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(lin.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    # -- helpers ------------------------------------------------------------------------
    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, d] -> [B, H, S, hd]
        B, S, _ = x.shape
        return x.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)

    def _extra_slots(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """Append the bias and/or zero key/value slots (on [B, S, d] projections)."""
        B = k.size(0)
        extra = 0
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1).to(k.dtype)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1).to(v.dtype)], dim=1)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, k.size(2))], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, v.size(2))], dim=1)
            extra += 1
        if mask is not None and extra:
            mask = torch.cat([mask, mask.new_zeros(B, extra)], dim=1)
        return k, v, mask

    # -- cross-attention over a fixed context ----------------------------------------------
    def project_kv(self, key: torch.Tensor, value: torch.Tensor | None = None,
                   key_padding_mask: torch.Tensor | None = None) -> ProjectedKV:
        """Project a context [B, S, kdim] once; reuse the result for every query / step."""
        value = key if value is None else value
        S = key.size(1)
        k, v = self.k_proj(key), self.v_proj(value)
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(key.shape[:2], dtype=torch.bool, device=key.device)
        k, v, mask = self._extra_slots(k, v, key_padding_mask)
        return ProjectedKV(self._split(k), self._split(v), mask, S)

    def attend(self, query: torch.Tensor, kv: ProjectedKV, attn_mask: torch.Tensor | None = None,
               need_weights: bool = False):
        """``query`` [B, T, d] against projected keys/values -> ([B, T, d], weights [B, T, S] or None)."""
        B, T, _ = query.shape
        q = self._split(self.q_proj(query) * self.scaling)
        scores = torch.matmul(q, kv.k.transpose(-1, -2))  # [B, H, T, S']
        masked = None
        if kv.key_padding_mask is not None:
            masked = kv.key_padding_mask[:, None, None, :]
        if attn_mask is not None:
            am = attn_mask[None, None, :, :]
            if am.size(-1) < scores.size(-1):  # extra slots are never masked by attn_mask
                am = F.pad(am, (0, scores.size(-1) - am.size(-1)), value=False)
            masked = am if masked is None else (masked | am)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1)
        if masked is not None:  # rows with every key masked (no extra slots): attend to nothing
            probs = torch.nan_to_num(probs, nan=0.0)
        probs = probs.to(q.dtype)
        dropped = F.dropout(probs, p=self.dropout, training=self.training)
        out = torch.matmul(dropped, kv.v).transpose(1, 2).reshape(B, T, self.embed_dim)
        out = self.out_proj(out)
        weights = probs[..., : kv.num_real].mean(dim=1) if need_weights else None
        return out, weights

    # -- general entry point ----------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                cache: dict | None = None, need_weights: bool = False):
        """Cross-attention when ``key`` is given; self-attention on ``query`` otherwise.

        For incremental self-attention pass ``cache`` (a dict, initially empty): keys/values
        of the new positions are appended to it, so each step costs O(t) instead of O(t^2).
        """
        if key is not None:
            return self.attend(query, self.project_kv(key, value, key_padding_mask), attn_mask, need_weights)
        k, v = self._split(self.k_proj(query)), self._split(self.v_proj(query))
        if cache is not None:
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
                if key_padding_mask is not None and "mask" in cache:
                    key_padding_mask = torch.cat([cache["mask"], key_padding_mask], dim=1)
            cache["k"], cache["v"] = k, v
            if key_padding_mask is not None:
                cache["mask"] = key_padding_mask
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(k.size(0), k.size(2), dtype=torch.bool, device=k.device)
        S = k.size(2)
        if self.bias_k is not None or self.add_zero_attn:
            kk, vv = k.transpose(1, 2).reshape(k.size(0), S, -1), v.transpose(1, 2).reshape(v.size(0), S, -1)
            kk, vv, key_padding_mask = self._extra_slots(kk, vv, key_padding_mask)
            k, v = self._split(kk), self._split(vv)
        return self.attend(query, ProjectedKV(k, v, key_padding_mask, S), attn_mask, need_weights)


def causal_mask(length: int, device: torch.device | None = None, offset: int = 0) -> torch.Tensor:
    """bool [length, offset + length], True where query i may NOT see key j (j > i + offset)."""
    i = torch.arange(length, device=device)[:, None] + offset
    j = torch.arange(offset + length, device=device)[None, :]
    return j > i
