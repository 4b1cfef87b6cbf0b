"""BTTR: handwritten mathematical expression recognition with a bidirectionally trained transformer.

Zhao, Gao, Yan, Wang, ICDAR 2021 (reference code: Green-Wood/BTTR). Read top to bottom:
DenseNet-B encoder -> 1x1 conv to d_model (+ReLU, LayerNorm) -> 2-D normalised sinusoidal image
positions -> 3-layer post-LN transformer decoder trained on left-to-right and right-to-left
copies of every target at once -> approximate joint search (``tellkit.models.bttr_search``).

What differs from the reference
* The encoder zeroes padded pixels before every convolution when a batch has padding, and
  images are padded to a multiple of 16 (``tellkit.data.crohme``): a batched image then gets
  exactly the features it gets alone, so batched search equals one-by-one search.
* Decoding keeps a key/value cache per layer (the reference recomputes every prefix) and
  runs batched over images and beams; ``use_cache=False`` gives the reference's recomputation.

BTTR in tellkit 0.1's own layout (pre-activation DenseNet, other positions), which checkpoints
written by tellkit 0.1 hold, is the family ``bttr_legacy`` (:mod:`tellkit.models.bttr_legacy`).

Token conventions (``tellkit.data.latex.Vocab``): ``<pad>`` = 0, ``<sos>`` = 1, ``<eos>`` = 2.
Left-to-right: ``<sos> y1..yT`` predicts ``y1..yT <eos>``; right-to-left: ``<eos> yT..y1``
predicts ``yT..y1 <sos>``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.data import position_forest as forest
from tellkit.data.latex import EOS_ID, PAD_ID, SOS_ID, Vocab
from tellkit.decoding.runaway import RunawayStop
from tellkit.decoding.state import IncrementalDecoder, RowContext, reorder_state
from tellkit.errors import TellkitError
from tellkit.layers import rows
from tellkit.layers.attention import MultiheadAttention, ProjectedKV, SharedKV, cached_length, causal_mask
from tellkit.layers.dropout import FastDropout
from tellkit.layers.loss import logits_loss
from tellkit.models.bttr_search import joint_search
from tellkit.registry import register_model

PAD, SOS, EOS = PAD_ID, SOS_ID, EOS_ID  # token ids (tellkit.data.latex.Vocab)
_ITOS = Vocab().itos  # label ids -> tokens, for the position-forest targets


@dataclass
class BTTRConfig:
    vocab_size: int = 113  # 110 symbols + <pad>, <sos>, <eos>
    # encoder (DenseNet-B)
    in_channels: int = 1
    growth_rate: int = 24
    num_blocks: int = 3
    block_depth: int = 16
    stem_channels: int = 48
    compression: float = 0.5
    encoder_dropout: float = 0.2
    # decoder
    d_model: int = 256
    nhead: int = 8
    num_decoder_layers: int = 3
    dim_feedforward: int = 1024
    dropout: float = 0.3
    # search
    beam_size: int = 10
    max_len: int = 200
    alpha: float = 1.0  # length normalisation exponent
    # beyond the BTTR and CoMER papers: PosFormer's position-forest targets (each symbol's nesting
    # layer and relative position, tellkit.data.position_forest) predicted from the decoder's last
    # hidden states by two small heads, each loss weighted by this much; 0: off (no heads). The
    # search never uses them. PosFormer's own weight is 0.25 (loss (ce + w layer + w pos) / (1 + 2w)).
    position_forest: float = 0.0

    def __post_init__(self):
        if isinstance(self.position_forest, bool) or not 0 <= float(self.position_forest) < 100:
            raise TellkitError(f"bttr: position_forest is a loss weight >= 0 (0: off), got {self.position_forest!r}")


# ---------------------------------------------------------------------------------------------
# Encoder: DenseNet-B
# ---------------------------------------------------------------------------------------------
def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded pixels (mask [B, H, W], True = real) so convolutions see background there."""
    return x if mask is None else x * mask[:, None].to(x.dtype)


class Bottleneck(nn.Module):
    """The reference's layer: 1x1 conv (4k) - BN - ReLU - dropout - 3x3 conv (k) - BN - ReLU -
    dropout; the output is concatenated to the input."""

    def __init__(self, cin: int, growth: int, dropout: float):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(growth)
        self.drop = FastDropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = _masked(self.drop(F.relu(self.bn1(self.conv1(x)))), mask)
        h = _masked(self.drop(F.relu(self.bn2(self.conv2(h)))), mask)
        return torch.cat([x, h], 1)


class Transition(nn.Module):
    """The reference's transition: 1x1 conv (compression) - BN - ReLU - dropout - 2x2 average pool."""

    def __init__(self, cin: int, cout: int, dropout: float):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.drop = FastDropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.avg_pool2d(_masked(self.drop(F.relu(self.bn(self.conv(x)))), mask), 2, ceil_mode=True)


def _halve(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask[:, 0::2, 0::2]


class DenseNetB(nn.Module):
    """[B, 1, H, W] -> [B, 684, H/16, W/16] (with the defaults), and the mask at that scale.

    Reference layout: 7x7/2 conv - BN - ReLU - 2x2 max-pool, three dense blocks with
    transitions between them, and after the last block a BatchNorm with no ReLU."""

    layer_class, transition_class = Bottleneck, Transition

    def __init__(self, c: BTTRConfig):
        super().__init__()
        layer, trans = self.layer_class, self.transition_class
        k = c.growth_rate
        self.stem = nn.Conv2d(c.in_channels, c.stem_channels, 7, stride=2, padding=3, bias=False)
        self.stem_bn = nn.BatchNorm2d(c.stem_channels)
        ch = c.stem_channels
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for b in range(c.num_blocks):
            self.blocks.append(nn.ModuleList(layer(ch + i * k, k, c.encoder_dropout) for i in range(c.block_depth)))
            ch += c.block_depth * k
            if b < c.num_blocks - 1:
                out = int(math.floor(ch * c.compression))
                self.transitions.append(trans(ch, out, c.encoder_dropout))
                ch = out
        self.out_channels = ch
        self.post_bn = nn.BatchNorm2d(ch)
        # channels-last convolution weights make the dense blocks faster on CPU (oneDNN) and
        # are what GPUs prefer; values and checkpoints are unaffected
        self.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # with no padding in the batch (one image, or equal sizes) nothing needs masking
        m = None if mask is None or bool(mask.all()) else mask
        if m is None and not self.training and not torch.is_grad_enabled():
            return self._infer(x, mask)
        return self.run_layers(x, mask, m)

    def run_layers(self, x: torch.Tensor, mask: torch.Tensor | None,
                   m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` layer by layer, through the last BatchNorm; ``m``: ``mask`` where the
        batch has padding, else None (nothing to zero)."""
        x = self.stem(_masked(x, m))
        mask, m = _halve(mask), _halve(m)
        x = F.max_pool2d(_masked(F.relu(self.stem_bn(x)), m), 2, ceil_mode=True)
        mask, m = _halve(mask), _halve(m)
        for b, block in enumerate(self.blocks):
            x = _masked(x, m)
            for layer in block:
                x = layer(x, m)
            if b < len(self.transitions):
                x = self.transitions[b](x, m)
                mask, m = _halve(mask), _halve(m)
        if mask is None:
            mask = torch.ones(x.shape[0], x.shape[2], x.shape[3], dtype=torch.bool, device=x.device)
        return self.post_bn(x), mask

    # --- inference on unpadded batches -----------------------------------------------------
    def _infer(self, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same function as :meth:`forward` in eval mode with no padding, computed faster:
        every batch norm folded into the convolution before it, each 1x1 convolution a matrix
        product over pixels, and each dense block written into one channels-last buffer (a
        layer reads the leading channels in place and appends its growth: no concatenation).
        Under bfloat16 autocast the buffers and products are bfloat16."""
        f = self._folded(x)
        dtype = f["dtype"]
        x = F.conv2d(x.to(dtype), f["stem"][0], f["stem"][1], stride=2, padding=3).relu_()
        x = F.max_pool2d(x, 2, ceil_mode=True)
        for b, block in enumerate(self.blocks):
            n, c0, h, w = x.shape
            k = block[0].conv2.out_channels
            total = c0 + len(block) * k
            pixels = n * h * w
            # NHWC: one row per pixel, channels appended layer by layer; in bfloat16 the rows are
            # padded (zeros) to a bucketed count so the products reuse their kernels (layers.rows)
            flat = x.new_empty(rows.bucket(pixels) if rows.cpu_bf16(x) else pixels, total)
            flat[pixels:] = 0
            buf = flat[:pixels].view(n, h, w, total)
            buf[..., :c0] = x.permute(0, 2, 3, 1)
            for i, (w1, b1, w2, b2) in enumerate(f["blocks"][b]):
                c = c0 + i * k
                hid = F.linear(flat[:, :c], w1, b1)[:pixels].relu_()  # the 1x1 convolution, [pixels, 4k]
                hid = hid.view(n, h, w, -1).permute(0, 3, 1, 2)  # channels-last NCHW, no copy
                buf[..., c : c + k] = F.conv2d(hid, w2, b2, padding=1).relu_().permute(0, 2, 3, 1)
            if b < len(self.transitions):
                wt, bt = f["transitions"][b]
                y = F.linear(flat, wt, bt)[:pixels].relu_().view(n, h, w, -1).permute(0, 3, 1, 2)
                x = F.avg_pool2d(y, 2, ceil_mode=True)
            else:
                scale, shift = f["post"]
                x = torch.addcmul(shift.to(dtype), buf, scale.to(dtype)).permute(0, 3, 1, 2)
        out_mask = mask
        for _ in range(2 + len(self.transitions)):
            out_mask = _halve(out_mask)
        if out_mask is None:
            out_mask = torch.ones(x.shape[0], x.shape[2], x.shape[3], dtype=torch.bool, device=x.device)
        return x, out_mask

    def _folded(self, x: torch.Tensor) -> dict:
        """The folded weights for :meth:`_infer`, in the dtype it computes in; kept while the
        parameters and statistics are the very tensors they were folded from, unchanged."""
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        tensors = [t for t in (*self.parameters(), *self.buffers()) if t.is_floating_point()]
        key = (dtype, x.device, tuple((t.data_ptr(), t._version) for t in tensors))
        cache = self.__dict__.get("_fold_cache")
        if cache is not None and cache[0] == key:
            return cache[1]

        def fold(conv: nn.Conv2d, bn: nn.BatchNorm2d, flat: bool):
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            wgt = conv.weight * scale[:, None, None, None]
            if flat:  # 1x1: a [out, in] matrix
                wgt = wgt.reshape(wgt.shape[0], -1)
            return wgt.to(dtype).contiguous(memory_format=torch.contiguous_format if flat else
                                               torch.channels_last), (bn.bias - bn.running_mean * scale).to(dtype)

        with torch.no_grad():
            post_scale = self.post_bn.weight / torch.sqrt(self.post_bn.running_var + self.post_bn.eps)
            folded = {
                "dtype": dtype,
                "stem": fold(self.stem, self.stem_bn, False),
                "blocks": [[(*fold(layer.conv1, layer.bn1, True), *fold(layer.conv2, layer.bn2, False))
                            for layer in block] for block in self.blocks],
                "transitions": [fold(t.conv, t.bn, True) for t in self.transitions],
                "post": (post_scale, self.post_bn.bias - self.post_bn.running_mean * post_scale),
            }
        self.__dict__["_fold_cache"] = (key, folded)
        return folded


# ---------------------------------------------------------------------------------------------
# Positional encodings (the reference's layout: interleaved sin/cos)
# ---------------------------------------------------------------------------------------------
def word_positions(length: int, d_model: int, start: int = 0, device=None) -> torch.Tensor:
    """[length, d] encodings of positions start..start+length-1 (the first token is position 0):
    channel 2j = sin(p * w_j), channel 2j+1 = cos(p * w_j), w_j = 10000^(-2j/d)."""
    pos = torch.arange(start, start + length, dtype=torch.float32, device=device)
    w = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float32, device=device) / d_model)
    ang = pos[:, None] * w[None]
    return torch.stack([ang.sin(), ang.cos()], -1).flatten(1)


def normalised_coordinates(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', y') [B, H, W] of the reference's ``ImgPosEnc``: the count of real pixels up to each
    position along the row (column), over the row's (column's) real width (height), times 2*pi."""
    m = mask.float()
    y = m.cumsum(1)
    x = m.cumsum(2)
    return x / (x[:, :, -1:] + 1e-6) * 2 * math.pi, y / (y[:, -1:, :] + 1e-6) * 2 * math.pi


def image_positions(mask: torch.Tensor, d_model: int) -> torch.Tensor:
    """2-D normalised encoding [B, H, W, d] as the reference's ``ImgPosEnc``: x' = x / W_real,
    y' = y / H_real (positions count real pixels only), scaled by 2*pi. Each axis uses d/2
    channels with frequencies w_i = 10000^(-i/(d/2)), i = 0..d/2-1: channel i is sin(x' w_i) for
    even i and cos(x' w_i) for odd i; the x channels come first, then the y channels."""
    x, y = normalised_coordinates(mask)
    half = d_model // 2
    w = 10000.0 ** (-torch.arange(half, dtype=torch.float32, device=mask.device) / half)

    def axis(v: torch.Tensor) -> torch.Tensor:
        ang = v[..., None] * w
        return torch.stack([ang[..., 0::2].sin(), ang[..., 1::2].cos()], -1).flatten(-2)

    return torch.cat([axis(x), axis(y)], -1)


class Encoder(nn.Module):
    """DenseNet-B -> 1x1 conv to d_model -> ReLU -> LayerNorm -> + 2-D positions, flattened."""

    densenet_class = DenseNetB
    positions = staticmethod(image_positions)  # mask [B, h, w], d -> [B, h, w, d]

    def __init__(self, c: BTTRConfig):
        super().__init__()
        self.densenet = self.densenet_class(c)
        self.proj = nn.Conv2d(self.densenet.out_channels, c.d_model, 1)
        self.norm = nn.LayerNorm(c.d_model)
        self.d_model = c.d_model

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        """The feature grid (h, w) of an image of ``height`` x ``width`` pixels: every
        stride-2 stage (the stem's convolution and pooling, each transition) halves, rounding up."""
        for _ in range(2 + len(self.densenet.transitions)):
            height, width = (height + 1) // 2, (width + 1) // 2
        return height, width

    def forward(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        """-> memory [B, h*w, d], memory_mask [B, h*w] (True = real)."""
        feat, mask = self.densenet(image, image_mask)
        feat = F.relu(self.proj(feat)).permute(0, 2, 3, 1)  # [B, h, w, d]
        feat = self.norm(feat) + self.positions(mask, self.d_model)
        b = feat.shape[0]
        return feat.reshape(b, -1, self.d_model), mask.reshape(b, -1)


# ---------------------------------------------------------------------------------------------
# Decoder with key/value caching
# ---------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """Post-LN: x = LN(x + SelfAttn(x)); x = LN(x + CrossAttn(x, memory)); x = LN(x + FFN(x))."""

    def __init__(self, c: BTTRConfig):
        super().__init__()
        d = c.d_model
        self.self_attn = MultiheadAttention(d, c.nhead, dropout=c.dropout)
        self.cross_attn = MultiheadAttention(d, c.nhead, dropout=c.dropout)
        self.ff = nn.Sequential(nn.Linear(d, c.dim_feedforward), nn.ReLU(), nn.Dropout(c.dropout),
                                nn.Linear(c.dim_feedforward, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, kv: ProjectedKV, state: dict | None = None, ctx: dict | None = None,
                pad: torch.Tensor | None = None):
        """x [N, L, d]; ``kv``: the memory projected by ``cross_attn.project_kv``.
        ``state``: incremental self-attention keys/values (a dict, initially empty); with it
        ``x`` holds only the newest position(s). ``ctx``: what a variant's cross-attention shares
        between the layers of one decoder pass (see :meth:`cross_attention`). ``pad`` [N, L]
        (full sequences only): True at padded target positions, which no position attends to
        (the reference's ``tgt_key_padding_mask``; real positions never see them anyway, as
        padding comes after the real tokens, but padded rows' outputs change)."""
        if state is None:  # full sequence, causal
            h, _ = self.self_attn(x, key_padding_mask=pad, attn_mask=causal_mask(x.shape[1], x.device))
        else:  # earlier keys/values come from the state; one new position sees them all
            mask = causal_mask(x.shape[1], x.device, offset=cached_length(state)) if x.shape[1] > 1 else None
            h, _ = self.self_attn(x, attn_mask=mask, cache=state)
        x = self.norm1(x + self.drop(h))
        x = self.norm2(x + self.drop(self.cross_attention(x, kv, state, ctx)))
        return self.norm3(x + self.drop(self.feed_forward(x)))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``self.ff`` (Linear, ReLU, Dropout, Linear), its products on bucketed rows (:mod:`tellkit.layers.rows`)."""
        first, relu, drop, second = self.ff
        return rows.linear(second, drop(relu(rows.linear(first, x))))

    def cross_attention(self, x, kv: ProjectedKV, state: dict | None, ctx: dict | None) -> torch.Tensor:
        """Cross-attention output [N, L, d] (the hook CoMER's coverage overrides)."""
        return self.cross_attn.attend(x, kv)[0]


def target_padding(tokens: torch.Tensor, states: list | None) -> torch.Tensor | None:
    """[N, L] True at PAD tokens of a full (teacher-forced) sequence; None when decoding step by
    step (``states``), where no token is padding."""
    return None if states is not None else tokens == PAD


class Decoder(nn.Module):
    layer_class = DecoderLayer

    def __init__(self, c: BTTRConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_norm = nn.LayerNorm(c.d_model)
        self.d_model = c.d_model
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_decoder_layers))
        self.out = nn.Linear(c.d_model, c.vocab_size)
        if c.position_forest:  # PosFormer's heads: d -> 128 -> ReLU -> classes
            self.forest = nn.ModuleDict({
                "layer": nn.Sequential(nn.Linear(c.d_model, 128), nn.ReLU(), nn.Linear(128, forest.NUM_LAYERS)),
                "position": nn.Sequential(nn.Linear(c.d_model, 128), nn.ReLU(), nn.Linear(128, forest.NUM_POSITIONS)),
            })

    def positions(self, length: int, start: int, device) -> torch.Tensor:
        """[length, d] encodings of the word positions start..start+length-1."""
        return word_positions(length, self.d_model, start, device)

    def project_memory(self, memory: torch.Tensor, memory_mask: torch.Tensor) -> list[ProjectedKV]:
        """Per layer, the memory [N, S, d] (mask True = real) projected for cross-attention."""
        return [layer.cross_attn.project_kv(memory, key_padding_mask=~memory_mask) for layer in self.layers]

    @property
    def shares_memory(self) -> bool:
        """Whether decoder rows reading one image can share its projected memory
        (:class:`tellkit.layers.attention.SharedKV`): the beams of both directions then attend
        to one copy of it. Not for a variant whose layers override the cross-attention (CoMER's
        coverage reads per-row keys); those get one copy per row."""
        return all(type(layer).cross_attention is DecoderLayer.cross_attention for layer in self.layers)

    def project_shared(self, memory: torch.Tensor, memory_mask: torch.Tensor, owner: torch.Tensor) -> list:
        """Per layer, the memory projected once per image and read by the decoder rows whose
        image is ``owner`` [N] (one copy per row where the variant cannot share)."""
        owner = owner.to(memory.device)
        if self.shares_memory:
            used = torch.bincount(owner, minlength=memory.shape[0]) > 0
            if not bool(used.all()):  # only the images some row reads
                live = used.nonzero().squeeze(1)
                memory, memory_mask = memory.index_select(0, live), memory_mask.index_select(0, live)
                owner = (used.cumsum(0) - 1).index_select(0, owner)
            return SharedKV.share(self.project_memory(memory, memory_mask), owner)
        return [kv.index_select(owner) for kv in self.project_memory(memory, memory_mask)]

    def forward(self, tokens, memory=None, memory_mask=None, states: list | None = None, start: int = 0,
                kvs: list[ProjectedKV] | None = None):
        """tokens [N, L] at positions start..start+L-1 -> logits [N, L, V]. The memory comes
        as ``memory``/``memory_mask`` or already projected (``kvs``, from :meth:`project_memory`);
        ``states``: one incremental self-attention dict per layer."""
        if kvs is None:
            kvs = self.project_memory(memory, memory_mask)
        x = self.embed_norm(self.embed(tokens)) + self.positions(tokens.shape[1], start, tokens.device)
        pad = target_padding(tokens, states)
        for i, layer in enumerate(self.layers):
            x = layer(x, kvs[i], None if states is None else states[i], pad=pad)
        self.last_hidden = x if self.training and hasattr(self, "forest") else None  # for the forest heads
        return rows.linear(self.out, x)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
def forest_targets(labels: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position-forest targets [2B, width] aligned with :func:`bidirectional_targets`' targets:
    rows 0..B-1 left to right, B..2B-1 right to left (reversed); the end token and padding get
    ``forest.IGNORE``."""
    itos = _ITOS
    b = labels.shape[0]
    layer_t = torch.full((2 * b, width), forest.IGNORE, dtype=torch.long)
    pos_t = torch.full((2 * b, width), forest.IGNORE, dtype=torch.long)
    for i, (row, n) in enumerate(zip(labels.tolist(), lengths.tolist())):
        layers, positions = forest.position_forest([itos[t] if 0 <= t < len(itos) else "" for t in row[:n]])
        layer_t[i, :n], pos_t[i, :n] = torch.tensor(layers, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
        layer_t[b + i, :n] = torch.tensor(layers[::-1], dtype=torch.long)
        pos_t[b + i, :n] = torch.tensor(positions[::-1], dtype=torch.long)
    return layer_t, pos_t


def bidirectional_targets(labels: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, T] (no sos/eos, PAD-padded) -> decoder inputs and targets [2B, T+1]:
    rows 0..B-1 left-to-right (inputs sos y, targets y eos), rows B..2B-1 right-to-left (inputs
    eos reversed(y), targets reversed(y) sos). Built with whole-tensor operations: no read of
    ``lengths`` back to the host, so a GPU step does not wait on it."""
    b, t = labels.shape
    n = lengths.to(labels.device).long()[:, None]  # [B, 1]
    j = torch.arange(t + 1, device=labels.device)[None]  # [1, T+1]
    real = j < n  # positions 0..n-1 hold a symbol
    padded = torch.cat([labels, labels.new_full((b, 1), PAD)], 1)
    fwd = torch.where(real, padded, PAD)
    rev = torch.where(real, padded.gather(1, (n - 1 - j).clamp(min=0)), PAD)

    def shift_in(first: int, y: torch.Tensor) -> torch.Tensor:  # first, then y up to n symbols
        return torch.cat([y.new_full((b, 1), first), y[:, :t]], 1)

    def close(y: torch.Tensor, last: int) -> torch.Tensor:  # y, then ``last`` at position n
        return torch.where(j == n, torch.full_like(y, last), y)

    inp = torch.cat([shift_in(SOS, fwd), shift_in(EOS, rev)])
    tgt = torch.cat([close(fwd, EOS), close(rev, SOS)])
    return inp, tgt


@register_model("bttr", BTTRConfig)
class BTTR(nn.Module, PretrainedMixin):
    encoder_class, decoder_class = Encoder, Decoder  # families built on BTTR (comer, bttr_legacy) swap them
    # the tensors with one row per vocabulary entry: fine-tuning on a grown vocabulary keeps
    # their old rows and adds new ones (tellkit.checkpoint.load_weights_into)
    vocabulary_rows = ("decoder.embed.weight", "decoder.out.weight", "decoder.out.bias")
    optional_weight_prefixes = ("decoder.forest.",)  # the position-forest heads (training only)

    def __init__(self, config: BTTRConfig):
        super().__init__()
        self.config = config
        self.encoder = self.encoder_class(config)
        self.decoder = self.decoder_class(config)

    def encode(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        return self.encoder(image, image_mask)

    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Bidirectional teacher-forced loss: both directions share the decoder and the memory.
        Evaluated without gradients (validation loss) it encodes by size and the two directions
        of an image read one copy of its memory, as the search does (same values)."""
        inp, tgt = bidirectional_targets(batch["labels"], batch["label_lengths"])
        if not self.training and not torch.is_grad_enabled():
            memory, mmask = self.encode_by_size(batch["image"], batch.get("image_mask"))
            owner = torch.arange(memory.shape[0], device=memory.device).repeat(2)
            logits = self.decoder(inp, kvs=self.decoder.project_shared(memory, mmask, owner))
            return {**logits_loss(logits, tgt, ignore_index=PAD), "logits": logits}
        memory, mmask = self.encode(batch["image"], batch.get("image_mask"))
        logits = self.decoder(inp, memory.repeat(2, 1, 1), torch.cat([mmask, mmask]))
        out = {**logits_loss(logits, tgt, ignore_index=PAD), "logits": logits}
        if getattr(self.decoder, "last_hidden", None) is not None:
            out = self._forest_loss(out, self.decoder.last_hidden, batch["labels"], batch["label_lengths"])
        return out

    def _forest_loss(self, out: dict[str, Any], hidden: torch.Tensor, labels: torch.Tensor,
                     lengths: torch.Tensor) -> dict[str, Any]:
        """``position_forest``: the loss becomes (ce + w * layer CE + w * position CE) / (1 + 2w),
        PosFormer's mix, the two CEs over the symbols of both directions (not the end tokens)."""
        layer_t, pos_t = forest_targets(labels, lengths, hidden.shape[1])
        w = float(self.config.position_forest)
        heads = self.decoder.forest
        parts = {}
        for name, t in (("layer", layer_t), ("position", pos_t)):
            logits = heads[name](hidden).float()
            parts[name] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.to(hidden.device).reshape(-1),
                                          ignore_index=forest.IGNORE)
        loss = (out["loss"] + w * parts["layer"] + w * parts["position"]) / (1 + 2 * w)
        return {**out, "loss": loss, "forest_layer_loss": parts["layer"].detach(),
                "forest_position_loss": parts["position"].detach()}

    # --- decoding API used by tellkit.models.bttr_search ------------------------------
    def incremental(self, memory: torch.Tensor, memory_mask: torch.Tensor, owner: torch.Tensor,
                    use_cache: bool = True) -> IncrementalDecoder:
        """A :class:`tellkit.decoding.state.IncrementalDecoder` with one row per ``owner`` entry
        (the row of ``memory`` that decoder row reads). With the cache the memory keys/values
        are projected once per image and each step feeds only the newest token; without it every
        step re-runs the decoder on the whole prefix, as the reference does."""
        return _BTTRIncremental(self.decoder, memory, memory_mask, owner, use_cache)

    def sequence_logprob(self, inputs: torch.Tensor, targets: torch.Tensor, memory, memory_mask,
                         owner: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced sum of log p(targets) per row (PAD targets ignored): [N]. ``owner`` [N]:
        the row of ``memory`` each row reads (default: row i reads memory row i)."""
        if owner is None:
            logits = self.decoder(inputs, memory, memory_mask)
        else:
            logits = self.decoder(inputs, kvs=self.decoder.project_shared(memory, memory_mask, owner))
        lp = F.log_softmax(logits.float(), -1)
        tok = lp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return (tok * (targets != PAD)).sum(-1)

    def encode_by_size(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        """:meth:`encode` for inference: the images of each distinct size go through the encoder
        together, unpadded (no padded pixel is computed or masked), and their features are
        placed in the layout the padded batch would have (the same values where real: the
        encoder zeroes padding). Training keeps :meth:`encode` (batch-norm statistics).

        Without gradients in eval mode the last batch's result is kept, keyed by the very input
        tensors (storage and in-place version), the encoder's parameters (likewise) and the
        autocast dtype: an evaluation that computes the validation loss and then searches the
        same batch encodes it once."""
        key = self._memo_key(image, image_mask)
        memo = self.__dict__.get("_encode_memo")
        if key is not None and memo is not None and memo[0] == key:
            return memo[1]
        out = self._encode_by_size(image, image_mask)
        # the inputs are held with the result: their storage cannot be reused by another tensor
        self.__dict__["_encode_memo"] = None if key is None else (key, out, image, image_mask)
        return out

    def _memo_key(self, image: torch.Tensor, image_mask: torch.Tensor | None):
        if self.training or torch.is_grad_enabled():
            return None
        kind = image.device.type
        state = tuple((t.data_ptr(), t._version) for t in (*self.encoder.parameters(), *self.encoder.buffers()))

        def ident(t):
            return None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype)

        return (ident(image), ident(image_mask), torch.is_autocast_enabled(kind),
                torch.get_autocast_dtype(kind), state)

    def _encode_by_size(self, image: torch.Tensor, image_mask: torch.Tensor | None):
        if image_mask is None or bool(image_mask.all()):
            return self.encode(image, image_mask)
        heights = image_mask.any(2).sum(1).tolist()
        widths = image_mask.any(1).sum(1).tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for i, hw in enumerate(zip(heights, widths)):
            groups.setdefault(hw, []).append(i)
        gh, gw = self.encoder.grid_size(*image.shape[-2:])
        memory = mask = None
        for (h, w), idx in groups.items():
            index = torch.tensor(idx, device=image.device)
            part = image.index_select(0, index)[..., :h, :w].contiguous(memory_format=torch.channels_last)
            mem, mmask = self.encode(part, None)
            ph, pw = self.encoder.grid_size(h, w)
            if memory is None:
                memory = mem.new_zeros(image.shape[0], gh, gw, mem.shape[-1])
                mask = torch.zeros(image.shape[0], gh, gw, dtype=torch.bool, device=image.device)
            memory[index, :ph, :pw] = mem.view(len(idx), ph, pw, -1)
            mask[index, :ph, :pw] = True
        return memory.flatten(1, 2), (mask.flatten(1) if mmask.dim() == 2 else mask)

    @torch.no_grad()
    def generate(self, image: torch.Tensor, image_mask: torch.Tensor | None = None, beam_size: int | None = None,
                 max_len: int | None = None, bidirectional: bool = True, rescore: bool = True,
                 use_cache: bool = True, alpha: float | None = None,
                 stop: RunawayStop | None = None) -> dict[str, Any]:
        """Approximate joint search (see :mod:`tellkit.models.bttr_search`); ``stop``: a runaway
        policy that ends a search early (:mod:`tellkit.decoding.runaway`).
        -> {"tokens": list[list[int]] (no sos/eos), "scores": list[float]}"""
        c = self.config
        return joint_search(self, image, image_mask, beam_size=beam_size or c.beam_size,
                            max_len=max_len or c.max_len, alpha=c.alpha if alpha is None else alpha,
                            bidirectional=bidirectional, rescore=rescore, use_cache=use_cache, stop=stop)


class _BTTRIncremental:
    """See :meth:`BTTR.incremental`."""

    def __init__(self, decoder: Decoder, memory: torch.Tensor, memory_mask: torch.Tensor, owner: torch.Tensor,
                 use_cache: bool):
        self.decoder = decoder
        index = owner.to(memory.device)
        self.shared = use_cache and decoder.shares_memory
        if self.shared:  # projected once per image; the rows of an image read that one copy
            self.memory = decoder.project_shared(memory, memory_mask, index)
            self.states: list[dict] | None = [{} for _ in decoder.layers]
        elif use_cache:  # projected once per image, then one copy per decoder row
            kvs = [kv.index_select(index) for kv in decoder.project_memory(memory, memory_mask)]
            self.memory = RowContext(kvs, owner)
            self.states = [{} for _ in decoder.layers]
        else:
            self.memory = RowContext((memory.index_select(0, index), memory_mask.index_select(0, index)), owner)
            self.states = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.states is None:
            mem, mask = self.memory.value
            logits = self.decoder(tokens, mem, mask)[:, -1]
        else:
            t = tokens.shape[1]
            kvs = self.memory if self.shared else self.memory.value
            logits = self.decoder(tokens[:, -1:], states=self.states, start=t - 1, kvs=kvs)[:, -1]
        return F.log_softmax(logits.float(), -1)

    def reorder(self, index: torch.Tensor) -> None:
        if self.states is not None:
            self.states = reorder_state(self.states, index)
        if self.shared:
            self.memory = SharedKV.reindex(self.memory, index)
        else:
            self.memory.reorder(index)
