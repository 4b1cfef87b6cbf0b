"""Multi-head attention (Vaswani et al. 2017) as Transform and Tell's reference uses it.

Differences from ``torch.nn.MultiheadAttention`` that the models here need:
- keys and values may have their own input sizes (``kdim``, ``vdim``): image 2048-d, faces
  512-d, article 1024-d, all attended from a 1024-d decoder state;
- ``add_bias_kv`` appends a learned key/value pair and ``add_zero_attn`` a zero key/value, so a
  query always has somewhere to attend: an empty context set (an image with no faces) is legal
  and yields a well-defined output;
- the key/value projections of a fixed context can be computed ONCE per input
  (:meth:`project_kv`) and reused at every decoding step (:meth:`attend`);
- self-attention keeps an incremental key/value cache (``cache`` dict, holding a
  :class:`KVCache` whose buffers grow by doubling, so a step writes only its new position) for
  fast generation;
- rows that read the same context (the beams of one input) can share ONE copy of its projected
  keys/values (:class:`SharedKV`): their queries are gathered per input and attend in one matrix
  product per input, instead of every row reading its own copy;
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

from tellkit.layers import rows


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q`` [..., T, hd] against ``k`` [..., S, hd] -> [..., T, S]. One float32 query row per
    head (a decoding step) is taken as keys x query, a matrix-vector product that ran 21 to 24%
    faster than query x keys over Transform and Tell's 514 article keys (bfloat16: the other way)."""
    if q.size(-2) == 1 and q.dtype == torch.float32 and k.dtype == torch.float32:
        return torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)
    return torch.matmul(q, k.transpose(-1, -2))


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


class RowGroups:
    """Which input each of N rows reads (``owner`` [N], values in 0..n_inputs-1), and where the
    row sits in a padded [n_inputs, width] layout (``pos`` = owner * width + rank among the rows
    of its input, in row order). ``regular``: every input has ``width`` rows, in input order, so
    the layout is the rows themselves and nothing needs gathering."""

    def __init__(self, owner: torch.Tensor, n_inputs: int):
        self.owner, self.n_inputs = owner, n_inputs
        n = owner.numel()
        counts = torch.bincount(owner, minlength=n_inputs)
        self.width = int(counts.max()) if n else 0
        sorted_ = n == 0 or bool((owner[1:] >= owner[:-1]).all())
        self.regular = sorted_ and n == self.width * n_inputs
        if self.regular:
            self.pos = None
            return
        starts = counts.cumsum(0) - counts
        if sorted_:
            rank = torch.arange(n, device=owner.device) - starts[owner]
        else:
            order = torch.argsort(owner, stable=True)
            rank = torch.empty_like(owner)
            rank[order] = torch.arange(n, device=owner.device) - starts[owner[order]]
        self.pos = owner * self.width + rank

    def to_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] rows -> [n_inputs, width, ...] (absent rows are zeros)."""
        if self.pos is None:
            return x.reshape(self.n_inputs, self.width, *x.shape[1:])
        out = x.new_zeros(self.n_inputs * self.width, *x.shape[1:])
        out.index_copy_(0, self.pos, x)
        return out.view(self.n_inputs, self.width, *x.shape[1:])

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[n_inputs, width, ...] -> [N, ...], the inverse of :meth:`to_inputs`."""
        flat = y.reshape(self.n_inputs * self.width, *y.shape[2:])
        return flat if self.pos is None else flat.index_select(0, self.pos)


@dataclass
class SharedKV:
    """One :class:`ProjectedKV` per input, read by rows whose input is ``groups.owner``: what
    :meth:`MultiheadAttention.attend` takes so that the beams of one input share its keys and
    values. ``index_select`` re-indexes rows (beams re-ranked, rows dropped) without copying
    the keys/values; inputs left with no row are dropped from them."""

    kv: ProjectedKV  # [n_inputs, H, S', hd]
    groups: RowGroups

    @staticmethod
    def of(kv: ProjectedKV, owner: torch.Tensor) -> SharedKV:
        return SharedKV.share([kv], owner)[0]

    @staticmethod
    def share(kvs: list[ProjectedKV], owner: torch.Tensor) -> list[SharedKV]:
        """Several contexts (one per decoder layer, say) read by the same rows: one grouping."""
        groups = RowGroups(owner, kvs[0].k.shape[0])
        return [SharedKV(kv, groups) for kv in kvs]

    @staticmethod
    def reindex(shared: list[SharedKV], index: torch.Tensor) -> list[SharedKV]:
        """Row ``i`` becomes old row ``index[i]`` in every one of ``shared`` (which share their
        rows); the keys/values of inputs left with no row are dropped (copied once, per input)."""
        kvs = [s.kv for s in shared]
        n_inputs = kvs[0].k.shape[0]
        owner = shared[0].groups.owner.index_select(0, index)
        used = torch.bincount(owner, minlength=n_inputs) > 0
        if not bool(used.all()):
            live = used.nonzero().squeeze(1)
            kvs = [kv.index_select(live) for kv in kvs]
            owner = (used.cumsum(0) - 1).index_select(0, owner)
        return SharedKV.share(kvs, owner)

    def index_select(self, index: torch.Tensor) -> SharedKV:
        return SharedKV.reindex([self], index)[0]


class KVCache:
    """Incremental self-attention keys/values [N, H, t, hd] in buffers with room to grow:
    a step writes its new positions in place (no copy of the earlier ones), the capacity doubles
    when full. ``index_select`` (beam re-ranking, rows dropped) copies the t positions once, into
    the buffers of the cache re-indexed before (two pairs of buffers take turns, so a search
    allocates nothing step after step); the cache it was called on is retired: its buffers now
    belong to the new one, and reading it is an error."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int, rows: int | None = None,
                 spare: tuple[torch.Tensor, torch.Tensor] | None = None):
        self._k, self._v, self.length = k, v, length  # [>= rows, H, capacity, hd]
        self.rows = k.shape[0] if rows is None else rows
        self._spare = spare

    @classmethod
    def empty(cls, like: torch.Tensor, capacity: int = 32) -> KVCache:
        n, h, _, hd = like.shape
        return cls(like.new_empty(n, h, capacity, hd), like.new_empty(n, h, capacity, hd), 0)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k is None:
            raise RuntimeError("this KVCache was re-indexed (index_select): use the cache that returned")
        return self._k, self._v

    @property
    def k(self) -> torch.Tensor:
        return self._buffers()[0][: self.rows, :, : self.length]

    @property
    def v(self) -> torch.Tensor:
        return self._buffers()[1][: self.rows, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add positions ``k``/``v`` [N, H, T, hd]; -> all keys/values so far."""
        bk, bv = self._buffers()
        end = self.length + k.shape[2]
        if end > bk.shape[2] or k.dtype != bk.dtype:
            cap = max(end, 2 * bk.shape[2])
            nk, nv = k.new_empty(*k.shape[:2], cap, k.shape[3]), v.new_empty(*v.shape[:2], cap, v.shape[3])
            nk[:, :, : self.length] = self.k
            nv[:, :, : self.length] = self.v
            self._k, self._v, self._spare = nk, nv, None
        self._k[: self.rows, :, self.length : end] = k
        self._v[: self.rows, :, self.length : end] = v
        self.length = end
        return self.k, self.v

    def index_select(self, index: torch.Tensor) -> KVCache:
        bk, bv = self._buffers()
        n, (_, h, cap, hd) = index.numel(), bk.shape
        sk, sv = self._spare if self._spare is not None else (None, None)
        if sk is None or sk.shape[0] < n:
            sk, sv = bk.new_empty(n, h, cap, hd), bv.new_empty(n, h, cap, hd)
        for src, dst in ((self.k, sk), (self.v, sv)):
            torch.index_select(src, 0, index, out=dst[:n, :, : self.length])  # one pass
        out = KVCache(sk, sv, self.length, rows=n, spare=(bk, bv))
        self._k = self._v = self._spare = None  # retired: its buffers are the new cache's spare
        return out


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
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(key.shape[:2], dtype=torch.bool, device=key.device)
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        if extra:
            key_padding_mask = torch.cat([key_padding_mask, key_padding_mask.new_zeros(key.size(0), extra)], 1)
        # heads laid out one after the other ([B, H, S', hd], contiguous) in one copy with the
        # extra slots: attending to a head-interleaved view would copy the whole context's
        # keys/values at every decoding step
        out = []
        for proj, x, bias in ((self.k_proj, key, self.bias_k), (self.v_proj, value, self.bias_v)):
            y = rows.linear(proj, x)
            heads = y.new_empty(y.size(0), self.num_heads, S + extra, self.head_dim)
            heads[:, :, :S] = self._split(y)
            if bias is not None:
                heads[:, :, S] = bias.view(self.num_heads, self.head_dim).to(y.dtype)
            if self.add_zero_attn:
                heads[:, :, -1] = 0
            out.append(heads)
        return ProjectedKV(out[0], out[1], key_padding_mask, S)

    def attend(self, query: torch.Tensor, kv: ProjectedKV | SharedKV, attn_mask: torch.Tensor | None = None,
               need_weights: bool = False):
        """``query`` [B, T, d] against projected keys/values -> ([B, T, d], weights [B, T, S] or None).
        ``kv`` may be a :class:`SharedKV` (rows reading the keys/values of their input)."""
        if isinstance(kv, SharedKV):
            if attn_mask is not None:
                raise ValueError("attn_mask does not apply to keys/values shared by rows")
            return self._attend_shared(query, kv, need_weights)
        B, T, _ = query.shape
        q = self._split(rows.linear(self.q_proj, query) * self.scaling)
        scores = _scores(q, kv.k)  # [B, H, T, S']
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
        out = rows.linear(self.out_proj, out)
        weights = probs[..., : kv.num_real].mean(dim=1) if need_weights else None
        return out, weights

    def _attend_shared(self, query: torch.Tensor, kv: SharedKV, need_weights: bool):
        """The queries of the rows of each input gathered into one sequence [n_inputs, width * T]
        that attends to that input's keys/values in one product (none is copied per row)."""
        g, p = kv.groups, kv.kv
        N, T, _ = query.shape
        q = g.to_inputs(rows.linear(self.q_proj, query)).reshape(g.n_inputs, g.width * T, self.embed_dim)
        q = self._split(q)  # [n_inputs, H, width*T, hd]
        k, v = p.k.to(q.dtype), p.v.to(q.dtype)
        allowed = None if p.key_padding_mask is None else ~p.key_padding_mask[:, None, None, :]
        weights = None
        if need_weights:
            scores = torch.matmul(q * self.scaling, k.transpose(-1, -2)).float()
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            weights = probs[..., : p.num_real].mean(dim=1).reshape(g.n_inputs, g.width, T, -1)
            weights = g.to_rows(weights)
            out = torch.matmul(F.dropout(probs, p=self.dropout, training=self.training).to(q.dtype), v)
        else:  # the fused kernel (softmax accumulated in float32 for 16-bit inputs)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                 dropout_p=self.dropout if self.training else 0.0)
        out = out.transpose(1, 2).reshape(g.n_inputs, g.width, T, self.embed_dim)
        return rows.linear(self.out_proj, g.to_rows(out)), weights

    # -- general entry point ----------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                cache: dict | None = None, need_weights: bool = False):
        """Cross-attention when ``key`` is given; self-attention on ``query`` otherwise.

        For incremental self-attention pass ``cache`` (a dict, initially empty): keys/values
        of the new positions are appended to its :class:`KVCache` (``cache["self_kv"]``), so each
        step costs O(t) instead of O(t^2).
        """
        if key is not None:
            return self.attend(query, self.project_kv(key, value, key_padding_mask), attn_mask, need_weights)
        k, v = self._split(rows.linear(self.k_proj, query)), self._split(rows.linear(self.v_proj, query))
        if cache is not None:
            if "self_kv" not in cache:
                cache["self_kv"] = KVCache.empty(k)
            k, v = cache["self_kv"].append(k, v)
            if key_padding_mask is not None:
                if "mask" in cache:
                    key_padding_mask = torch.cat([cache["mask"], key_padding_mask], dim=1)
                cache["mask"] = key_padding_mask
        S = k.size(2)
        if self.bias_k is not None or self.add_zero_attn:
            kk, vv = k.transpose(1, 2).reshape(k.size(0), S, -1), v.transpose(1, 2).reshape(v.size(0), S, -1)
            kk, vv, key_padding_mask = self._extra_slots(kk, vv, key_padding_mask)
            k, v = self._split(kk), self._split(vv)
        return self.attend(query, ProjectedKV(k, v, key_padding_mask, S), attn_mask, need_weights)


def cached_length(cache: dict | None) -> int:
    """How many positions an incremental self-attention ``cache`` holds (0 for a new one)."""
    return cache["self_kv"].length if cache and "self_kv" in cache else 0


def causal_mask(length: int, device: torch.device | None = None, offset: int = 0) -> torch.Tensor:
    """bool [length, offset + length], True where query i may NOT see key j (j > i + offset)."""
    i = torch.arange(length, device=device)[:, None] + offset
    j = torch.arange(offset + length, device=device)[None, :]
    return j > i
