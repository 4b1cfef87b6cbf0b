"""Text-vision fusion sub-layers of VG-GPLMs (Yu et al., EMNLP 2021, section 3.2).

Given text states ``Z_t`` [B, N, d_t] and video states ``Z_v`` [B, M, d_v] with a frame mask
[B, M] (True = real frame), each fusion returns ``Z_t'`` [B, N, d_t]; :class:`FusionBlock`
then adds the residual and a LayerNorm: ``LayerNorm(Z_t + Dropout(Z_t'))``.

- ``dot_product`` (the reference's ``cross_attn_type 0``): ``Z_v' = Z_v W1``;
  ``A = softmax(Z_t Z_v'^T)`` (no scaling); ``O = A Z_v`` (d_v); ``Z_t' = [Z_t ; O] W2``.
- ``dot_product_projected`` (type 1): the same with ``O = A Z_v'`` (d_t).
- ``multi_head`` (type 4): ``Q = Z_t Wq``, ``K = Z_v Wk``, ``V = Z_v Wv`` in a common dim d_c
  (the reference: 256), then a standard multi-head attention over them (its own input and
  output projections, one head in the reference), ``O`` (d_c); ``Z_t' = [Z_t ; O] W3``.
- Forget gate (optional, any fusion): ``F = Dropout(sigmoid([O ; Z_t] Wf))``, ``O' = F * O``
  before the concatenation; ``Wf`` maps to the width of ``O`` (d_v, d_t or d_c).

The reference's other fusions (types 2, 3 and 5: attended video alone, a low-dimensional
dot-product, multi-head without ``W3``) appear in none of the paper's tables and are not built.

Two switches choose between the reference code (HLTCHKUST/VG-GPLMs) and tellkit's fixes:
- ``softmax_over``: ``"text"`` normalises the dot-product scores over text positions with no mask
  at all, as the reference (``F.softmax(attn, dim=1)``); ``"frames"`` follows the paper's
  equations (a convex mix of frames per text position);
- ``mask_frames``: True masks padded frames in every fusion (a sample with no real frame gets a
  zero context); False lets them take part, as the reference, which gives its fusion no video
  mask (its multi-head attention gets no ``key_padding_mask``).
:meth:`FusionBlock.boosted_parameters` are the parameters the reference trains with the larger
learning rate (all fusion linears, the attention and the gate; not the LayerNorm).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

FUSIONS = ("dot_product", "dot_product_projected", "multi_head")
SOFTMAX_OVER = ("frames", "text")


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax of [B, N, M] scores over frames; ``mask`` [B, M] True = keep. Rows with no
    real frame come out as zeros instead of NaN."""
    if mask is None:
        return scores.softmax(-1)
    keep = mask[:, None, :]
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores.softmax(-1) * keep.any(-1, keepdim=True).to(scores.dtype)


class ForgetGate(nn.Module):
    """``F = Dropout(sigmoid([O ; Z_t] Wf))``; returns ``F * O``."""

    def __init__(self, d_context: int, d_text: int, dropout: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(d_context + d_text, d_context)
        self.dropout = nn.Dropout(dropout)

    def forward(self, context: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        gate = self.dropout(torch.sigmoid(self.proj(torch.cat([context, text], dim=-1))))
        return gate * context


class DotProductFusion(nn.Module):
    """Dot-product attention from text positions to video frames (no scaling, as in the paper)."""

    def __init__(
        self,
        d_text: int,
        d_video: int,
        concat_projected: bool = False,
        forget_gate: bool = False,
        dropout: float = 0.0,
        softmax_over: str = "frames",
    ):
        super().__init__()
        if softmax_over not in SOFTMAX_OVER:
            raise ValueError(f"softmax_over must be one of {SOFTMAX_OVER}, got {softmax_over!r}")
        self.concat_projected = concat_projected
        self.softmax_over = softmax_over
        self.video_proj = nn.Linear(d_video, d_text)  # W1
        d_ctx = d_text if concat_projected else d_video
        self.gate = ForgetGate(d_ctx, d_text, dropout) if forget_gate else None
        self.out = nn.Linear(d_text + d_ctx, d_text)  # W2

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        zv = self.video_proj(video)  # [B, M, d_t]
        scores = text @ zv.transpose(1, 2)  # [B, N, M]
        if self.softmax_over == "frames":
            attn = _masked_softmax(scores, video_mask)
        else:  # the reference: normalised over text positions, no masks
            attn = scores.softmax(1)
        context = attn @ (zv if self.concat_projected else video)  # [B, N, d_ctx]
        if self.gate is not None:
            context = self.gate(context, text)
        return self.out(torch.cat([text, context], dim=-1))


class MultiHeadFusion(nn.Module):
    """Q/K/V linears into d_c, then multi-head attention from text (queries) to video."""

    def __init__(
        self, d_text: int, d_video: int, d_common: int, heads: int, dropout: float = 0.0, forget_gate: bool = False
    ):
        super().__init__()
        if d_common % heads:
            raise ValueError(f"fusion dim {d_common} is not divisible by {heads} heads")
        self.k = nn.Linear(d_video, d_common)
        self.v = nn.Linear(d_video, d_common)
        self.q = nn.Linear(d_text, d_common)
        self.attention = nn.MultiheadAttention(d_common, heads, batch_first=True)  # no attention dropout (reference)
        self.gate = ForgetGate(d_common, d_text, dropout) if forget_gate else None
        self.out = nn.Linear(d_text + d_common, d_text)  # W3

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        pad = None
        empty = None
        if video_mask is not None:
            empty = ~video_mask.any(-1)  # [B]: no real frame; attend to all, then zero the context
            pad = ~(video_mask | empty[:, None])
        q, k, v = self.q(text), self.k(video), self.v(video)
        context, _ = self.attention(q, k, v, key_padding_mask=pad, need_weights=False)
        if empty is not None and bool(empty.any()):
            context = context.masked_fill(empty[:, None, None], 0.0)
        if self.gate is not None:
            context = self.gate(context, text)
        return self.out(torch.cat([text, context], dim=-1))


class FusionBlock(nn.Module):
    """One inserted sub-layer: ``LayerNorm(Z_t + Dropout(fusion(Z_t, Z_v)))``."""

    def __init__(
        self,
        kind: str,
        d_text: int,
        d_video: int,
        *,
        d_common: int | None = None,
        heads: int = 1,
        dropout: float = 0.1,
        forget_gate: bool = False,
        softmax_over: str = "frames",
        mask_frames: bool = True,
        eps: float = 1e-5,
    ):
        super().__init__()
        self.mask_frames = mask_frames
        if kind in ("dot_product", "dot_product_projected"):
            self.fusion = DotProductFusion(
                d_text, d_video, kind == "dot_product_projected", forget_gate, dropout, softmax_over
            )
        elif kind == "multi_head":
            self.fusion = MultiHeadFusion(d_text, d_video, d_common or d_text, heads, dropout, forget_gate)
        else:
            raise ValueError(f"unknown fusion '{kind}'; known: {', '.join(FUSIONS)}")
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_text, eps=eps)

    def boosted_parameters(self) -> Iterator[nn.Parameter]:
        """Fusion linears, attention and gate (the reference's x ``img_lr_factor`` group)."""
        return self.fusion.parameters()

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        mask = video_mask if self.mask_frames else None  # None: padded frames take part (reference)
        return self.norm(text + self.dropout(self.fusion(text, video, mask)))
