"""Text-vision fusion sub-layers of VG-GPLMs (Yu et al., EMNLP 2021, section 3.2).

Given text states ``Z_t`` [B, N, d_t] and video states ``Z_v`` [B, M, d_v] with a frame mask
[B, M] (True = real frame), each fusion returns ``Z_t'`` [B, N, d_t]; :class:`FusionBlock`
then adds the residual and a LayerNorm: ``LayerNorm(Z_t + Dropout(Z_t'))``.

- Dot-product: ``Z_v' = Z_v W1``; ``A = softmax(Z_t Z_v'^T)`` over the video frames;
  ``Z_t' = [Z_t ; A Z_v] W2`` (variant ``concat_projected``: ``[Z_t ; A Z_v'] W2``).
- Multi-head: ``Q = Z_t Wq``, ``K = Z_v Wk``, ``V = Z_v Wv`` (common dim d_c), scaled
  multi-head attention, ``Z_t' = [Z_t ; O] W3``.
- Forget gate (optional, either fusion): ``F = sigmoid([O ; Z_t] Wf)``, ``O' = F * O`` before the
  concatenation (``O`` is the attended video context).

Differences from the reference code (HLTCHKUST/VG-GPLMs): as in the paper's equations the
softmax runs over video frames and padded frames are masked out (the reference normalises over
text positions and has no video mask). A sample with no real frame gets a zero context.
"""
from __future__ import annotations

import math

import torch
from torch import nn

FUSIONS = ("dot_product", "dot_product_projected", "multi_head")


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis (frames); ``mask`` [B, M] True = keep. Rows with no real
    frame come out as zeros instead of NaN."""
    if mask is None:
        return scores.softmax(-1)
    keep = mask[:, None, :] if scores.dim() == 3 else mask[:, None, None, :]
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores.softmax(-1) * keep.any(-1, keepdim=True).to(scores.dtype)


class ForgetGate(nn.Module):
    """``F = sigmoid([O ; Z_t] Wf)``; returns ``F * O``."""

    def __init__(self, d_context: int, d_text: int):
        super().__init__()
        self.proj = nn.Linear(d_context + d_text, d_context)

    def forward(self, context: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.proj(torch.cat([context, text], dim=-1)))
        return gate * context


class DotProductFusion(nn.Module):
    """Dot-product attention from text positions to video frames (no scaling, as in the paper)."""

    def __init__(self, d_text: int, d_video: int, concat_projected: bool = False, forget_gate: bool = False):
        super().__init__()
        self.concat_projected = concat_projected
        self.video_proj = nn.Linear(d_video, d_text)  # W1
        d_ctx = d_text if concat_projected else d_video
        self.gate = ForgetGate(d_ctx, d_text) if forget_gate else None
        self.out = nn.Linear(d_text + d_ctx, d_text)  # W2

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        zv = self.video_proj(video)  # [B, M, d_t]
        attn = _masked_softmax(text @ zv.transpose(1, 2), video_mask)  # [B, N, M]
        context = attn @ (zv if self.concat_projected else video)  # [B, N, d_ctx]
        if self.gate is not None:
            context = self.gate(context, text)
        return self.out(torch.cat([text, context], dim=-1))


class MultiHeadFusion(nn.Module):
    """Multi-head attention from text (queries) to video (keys, values) in a common dim d_c."""

    def __init__(self, d_text: int, d_video: int, d_common: int, heads: int, dropout: float = 0.0, forget_gate: bool = False):
        super().__init__()
        if d_common % heads:
            raise ValueError(f"fusion dim {d_common} is not divisible by {heads} heads")
        self.heads, self.d_head = heads, d_common // heads
        self.q = nn.Linear(d_text, d_common)
        self.k = nn.Linear(d_video, d_common)
        self.v = nn.Linear(d_video, d_common)
        self.o = nn.Linear(d_common, d_common)
        self.dropout = nn.Dropout(dropout)
        self.gate = ForgetGate(d_common, d_text) if forget_gate else None
        self.out = nn.Linear(d_text + d_common, d_text)  # W3

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = text.shape
        m = video.size(1)
        q = self.q(text).view(b, n, self.heads, self.d_head).transpose(1, 2)  # [B, H, N, dh]
        k = self.k(video).view(b, m, self.heads, self.d_head).transpose(1, 2)  # [B, H, M, dh]
        v = self.v(video).view(b, m, self.heads, self.d_head).transpose(1, 2)
        attn = _masked_softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d_head), video_mask)  # [B, H, N, M]
        context = (self.dropout(attn) @ v).transpose(1, 2).reshape(b, n, -1)  # [B, N, d_c]
        context = self.o(context)
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
        heads: int = 4,
        dropout: float = 0.1,
        forget_gate: bool = False,
        eps: float = 1e-5,
    ):
        super().__init__()
        if kind in ("dot_product", "dot_product_projected"):
            self.fusion = DotProductFusion(d_text, d_video, kind == "dot_product_projected", forget_gate)
        elif kind == "multi_head":
            self.fusion = MultiHeadFusion(d_text, d_video, d_common or d_text, heads, dropout, forget_gate)
        else:
            raise ValueError(f"unknown fusion '{kind}'; known: {', '.join(FUSIONS)}")
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_text, eps=eps)

    def forward(self, text: torch.Tensor, video: torch.Tensor, video_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(text + self.dropout(self.fusion(text, video, video_mask)))
