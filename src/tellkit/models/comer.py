"""CoMER: BTTR with coverage of past attention (Zhao & Gao, ECCV 2022; reference code Green-Wood/CoMER).

CoMER keeps BTTR (:mod:`tellkit.models.bttr`: DenseNet-B encoder, 3-layer post-LN decoder
trained on both directions, approximate joint search) and adds an Attention Refinement Module
(ARM) to the decoder's cross-attention. In decoder layers 2..L (one module shared by them), the
coverage of past attention, per head,

* the previous layer's attention weights ("cross coverage") and
* this layer's own first-pass attention weights ("self coverage"),

each summed over the earlier decoding steps only (an exclusive cumulative sum: step 0 sees
zero), is drawn as an image over the encoder's h x w feature grid, passed through a 5x5 conv
(2 x nhead -> dc = 32 channels, with bias), ReLU, a 1x1 conv to one channel per head (no bias)
and a BatchNorm whose batch statistics cover real (unpadded) pixels only, and subtracted from
that layer's attention scores before a second softmax. With d 256, 8 heads, dc 32 the module has
16*32*25 + 32 + 32*8 + 2*8 = 13,104 parameters; one more LayerNorm (512) normalises the decoder
input (word embedding + positions). ``tellkit model-info configs/bttr/comer.yaml``: 6,389,041.

Also as in the reference (and unlike BTTR's reference): the encoder's 1x1 projection has no
ReLU, the image positions are added before its LayerNorm, and they pair sin/cos at one frequency
(channel 2j = sin(x' w_j), 2j+1 = cos(x' w_j), w_j = 10000^(-2j/(d/2)); BTTR's uses w_{2j+1} for
the cosine). As in the reference, the coverage is made of the attention weights after attention
dropout when training.

What differs from the reference
* BTTR's tellkit differences hold: padded pixels are zeroed in the encoder (batched = one by
  one), and decoding is batched and cached; the cache carries, per decoder row and layer, the
  coverage so far (reordered with the beam like the key/value cache).
* The search is BTTR's approximate joint search (:mod:`tellkit.models.bttr_search`), not the
  reference's Hugging Face-style beam scorer (which keeps 2k candidates per step and
  length-normalises each direction's score before adding them).
* ``encode`` returns the memory mask as [B, h, w] (the grid's shape is what the ARM draws on);
  BTTR's search and loss take either shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.errors import TellkitError
from tellkit.layers.attention import ProjectedKV
from tellkit.models.bttr import (
    BTTR,
    BTTRConfig,
    Decoder,
    DecoderLayer,
    Encoder,
    normalised_coordinates,
    target_padding,
)
from tellkit.registry import register_model


@dataclass
class ComerConfig(BTTRConfig):
    dc: int = 32  # channels of the ARM's 5x5 conv
    cross_coverage: bool = True  # the previous layer's attention feeds the coverage
    self_coverage: bool = True  # this layer's own attention feeds the coverage
    # BTTR's encoder (projection + ReLU, LayerNorm, then BTTR's image positions) and no decoder
    # input LayerNorm: every weight of a BTTR model has its place, so that CoMER can start from one
    # (``train.init_from``; :meth:`CoMER.adopt_weights`). Not the reference's layout.
    bttr_layout: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.dc < 1:
            raise TellkitError(f"comer: dc must be >= 1 (got {self.dc})")


# ---------------------------------------------------------------------------------------------
# Encoder: BTTR's DenseNet, CoMER's projection and positions
# ---------------------------------------------------------------------------------------------
def comer_image_positions(mask: torch.Tensor, d_model: int) -> torch.Tensor:
    """[B, H, W, d] as the reference's ``ImgPosEnc``: x' = x / W_real * 2pi, y' likewise
    (positions count real pixels only); per axis d/2 channels, channel 2j = sin(x' w_j) and
    2j+1 = cos(x' w_j), w_j = 10000^(-2j/(d/2)); the x channels first, then the y channels."""
    x, y = normalised_coordinates(mask)
    half = d_model // 2
    w = 10000.0 ** (-torch.arange(0, half, 2, dtype=torch.float32, device=mask.device) / half)

    def axis(v: torch.Tensor) -> torch.Tensor:
        ang = v[..., None] * w
        return torch.stack([ang.sin(), ang.cos()], -1).flatten(-2)

    return torch.cat([axis(x), axis(y)], -1)


class ComerEncoder(Encoder):
    """DenseNet-B -> 1x1 conv to d_model -> + 2-D positions -> LayerNorm (no ReLU); with
    ``bttr_layout``, BTTR's order (conv, ReLU, LayerNorm, + BTTR's positions)."""

    def __init__(self, c: ComerConfig):
        super().__init__(c)
        self.bttr_layout = c.bttr_layout

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        """-> memory [B, h*w, d], memory_mask [B, h, w] (True = real)."""
        feat, mask = self.densenet(image, image_mask)
        if self.bttr_layout:
            feat = self.norm(F.relu(self.proj(feat)).permute(0, 2, 3, 1)) + self.positions(mask, self.d_model)
        else:
            feat = self.proj(feat).permute(0, 2, 3, 1)  # [B, h, w, d]
            feat = self.norm(feat + comer_image_positions(mask, self.d_model))
        return feat.reshape(feat.shape[0], -1, self.d_model), mask


# ---------------------------------------------------------------------------------------------
# Attention Refinement Module and the decoder around it
# ---------------------------------------------------------------------------------------------
@dataclass
class GridKV(ProjectedKV):
    """Projected memory that remembers the width of its feature grid (S = h * w)."""

    width: int = 1

    def index_select(self, index: torch.Tensor) -> GridKV:
        kv = super().index_select(index)
        return GridKV(kv.k, kv.v, kv.key_padding_mask, kv.num_real, self.width)

    def real(self) -> torch.Tensor:
        """[N, h, w], True = real pixel."""
        return ~self.key_padding_mask.reshape(self.k.shape[0], -1, self.width)


class AttentionRefinement(nn.Module):
    """Coverage [N, C, T, S] (C = nhead per kind of coverage) -> the amount [N, nhead, T, S]
    subtracted from the attention scores: 5x5 conv (C -> dc) - ReLU - 1x1 conv (dc -> nhead, no
    bias) - BatchNorm over the real pixels (training statistics from those only)."""

    def __init__(self, nhead: int, dc: int, cross_coverage: bool, self_coverage: bool):
        super().__init__()
        self.cross_coverage, self.self_coverage = cross_coverage, self_coverage
        self.conv = nn.Conv2d(nhead * (int(cross_coverage) + int(self_coverage)), dc, 5, padding=2)
        self.proj = nn.Conv2d(dc, nhead, 1, bias=False)
        self.norm = nn.BatchNorm1d(nhead)

    def forward(self, coverage: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        n, c, t, s = coverage.shape
        h, w = real.shape[1:]
        x = coverage.transpose(1, 2).reshape(n * t, c, h, w)  # one image per (row, step)
        x = self.proj(F.relu(self.conv(x)))  # [N*T, nhead, h, w]
        x = x.permute(0, 2, 3, 1).reshape(n, t, s, -1)  # [N, T, S, nhead]
        if self.training and not bool(real.all()):
            keep = real.reshape(n, 1, s).expand(n, t, s)
            out = x.new_zeros(x.shape)
            out[keep] = self.norm(x[keep]).to(x.dtype)
        else:  # running statistics (or no padding): padded pixels are masked out of the scores anyway
            out = self.norm(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        return out.permute(0, 3, 1, 2)


def exclusive_cumsum(a: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over the positions before each one along ``dim`` (the first gets exactly zero)."""
    total = a.cumsum(dim).narrow(dim, 0, a.shape[dim] - 1)
    return torch.cat([torch.zeros_like(a.narrow(dim, 0, 1)), total], dim)


class ComerDecoderLayer(DecoderLayer):
    """BTTR's layer whose cross-attention is refined by the decoder's shared ARM when an earlier
    layer of the same pass has left its attention in ``ctx["prev"]``."""

    def cross_attention(self, x, kv: GridKV, state: dict | None, ctx: dict | None) -> torch.Tensor:
        ctx = {} if ctx is None else ctx
        a = self.cross_attn
        n, t, d = x.shape
        q = a._split(a.q_proj(x) * a.scaling)
        scores = torch.matmul(q, kv.k.transpose(-1, -2)).float()  # [N, H, T, S]
        pad = kv.key_padding_mask[:, None, None, :]
        attn = self._softmax(scores, pad)
        arm: AttentionRefinement | None = ctx.get("arm")
        prev = ctx.get("prev")
        if arm is not None and prev is not None:
            parts = ([prev] if arm.cross_coverage else []) + ([attn] if arm.self_coverage else [])
            step = torch.cat(parts, 1)  # [N, C, T, S]: this pass's attention, per head
            cov = exclusive_cumsum(step, 2)
            if state is not None:  # incremental: add the earlier steps' sum, keep the new one
                if "coverage" in state:
                    cov = cov + state["coverage"][:, :, None]
                state["coverage"] = cov[:, :, -1] + step[:, :, -1]
            attn = self._softmax(scores - arm(cov, kv.real()).float(), pad)
        ctx["prev"] = attn
        out = torch.matmul(attn.to(kv.v.dtype), kv.v).transpose(1, 2).reshape(n, t, d)
        return a.out_proj(out)

    def _softmax(self, scores: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.masked_fill(pad, float("-inf")), -1)
        return F.dropout(probs, p=self.cross_attn.dropout, training=self.training)


class ComerDecoder(Decoder):
    layer_class = ComerDecoderLayer

    def __init__(self, c: ComerConfig):
        super().__init__(c)
        # after word embedding + positions (none in BTTR's layout)
        self.input_norm = None if c.bttr_layout else nn.LayerNorm(c.d_model)
        use = c.cross_coverage or c.self_coverage
        self.arm = AttentionRefinement(c.nhead, c.dc, c.cross_coverage, c.self_coverage) if use else None

    def project_memory(self, memory: torch.Tensor, memory_mask: torch.Tensor) -> list[GridKV]:
        """memory [N, h*w, d], memory_mask [N, h, w] (True = real) -> per layer its keys/values."""
        n, _, w = memory_mask.shape
        flat = ~memory_mask.reshape(n, -1)
        out = []
        for layer in self.layers:
            kv = layer.cross_attn.project_kv(memory, key_padding_mask=flat)
            out.append(GridKV(kv.k, kv.v, kv.key_padding_mask, kv.num_real, w))
        return out

    def forward(self, tokens, memory=None, memory_mask=None, states: list | None = None, start: int = 0,
                kvs: list[GridKV] | None = None):
        """As :meth:`tellkit.models.bttr.Decoder.forward`, with ``memory_mask`` [N, h, w];
        ``states`` also carry each layer's coverage so far."""
        if kvs is None:
            kvs = self.project_memory(memory, memory_mask)
        x = self.embed_norm(self.embed(tokens)) + self.positions(tokens.shape[1], start, tokens.device)
        if self.input_norm is not None:
            x = self.input_norm(x)
        ctx = {"arm": self.arm, "prev": None}
        pad = target_padding(tokens, states)  # padded rows still enter the ARM's BatchNorm, as in the reference
        for i, layer in enumerate(self.layers):
            x = layer(x, kvs[i], None if states is None else states[i], ctx, pad=pad)
        self.last_hidden = x if self.training and hasattr(self, "forest") else None  # for the forest heads
        return self.out(x)


@register_model("comer", ComerConfig)
class CoMER(BTTR):
    """BTTR with CoMER's coverage; training, ``generate`` and the search are BTTR's."""

    encoder_class, decoder_class = ComerEncoder, ComerDecoder

    def adopt_weights(self, source: nn.Module, where: str) -> dict[str, list[str]]:
        """Start from a BTTR model (``train.init_from``): copy every tensor whose name and shape
        match (with ``bttr_layout`` that is all of BTTR's) and make the attention refinement
        neutral: its BatchNorm's scale and shift are zero, so it subtracts exactly zero and this
        model reads as the BTTR until training moves them (the gradient reaches the scale at
        once). -> ``{"copied": names, "new": names}``."""
        if getattr(source, "family", None) != "bttr":
            raise TellkitError(f"{where}: holds a '{getattr(source, 'family', None)}' model; CoMER starts "
                               "from a CoMER or a BTTR model")
        if not self.config.bttr_layout:
            raise TellkitError(f"{where}: a BTTR model starts a CoMER of BTTR's layout only "
                               "(set model.bttr_layout=true)")
        own, theirs = self.state_dict(), source.state_dict()
        bad = sorted(k for k in theirs if k not in own or own[k].shape != theirs[k].shape)
        if bad:
            raise TellkitError(f"{where}: the BTTR's weights do not fit this CoMER's sizes "
                               f"({len(bad)} tensors differ, e.g. {bad[:3]})")
        with torch.no_grad():
            for k, v in theirs.items():
                own[k].copy_(v.to(own[k].dtype))
            if self.decoder.arm is not None:
                nn.init.zeros_(self.decoder.arm.norm.weight)
                nn.init.zeros_(self.decoder.arm.norm.bias)
        return {"copied": sorted(theirs), "new": sorted(k for k in own if k not in theirs)}
