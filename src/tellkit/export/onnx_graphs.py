"""The pieces of a model that :mod:`tellkit.export.onnx` writes as ONNX graphs, each a small
``nn.Module`` over the trained model's own layers (no weight is copied or changed), written so
that tracing records one general graph: no data-dependent Python branch, every state an
explicit input and output.

BTTR (``bttr_*.onnx``):

* :class:`BTTREncoderGraph`: image [B, 1, H, W] (one size, unpadded) -> memory [B, h*w, d].
* :class:`BTTRMemoryGraph`: memory [M, S, d] -> per decoder layer the cross-attention keys and
  values [M, heads, S, head_dim] (the projected memory, once per image).
* :class:`BTTRStepGraph`: one incremental decoder step. Inputs: the newest token of every row,
  its position, per layer the self-attention keys/values of the earlier positions
  [N, heads, t, head_dim] and the projected memory of the images; outputs: log p(next token)
  [N, V] and the keys/values with the new position appended [N, heads, t+1, head_dim].
* :class:`BTTRScoreGraph`: teacher-forced sum of log p(targets) per row (the joint search's
  rescoring pass).

The rows of one image read that image's projected memory once (as
:class:`tellkit.layers.attention.SharedKV` does in PyTorch): ``slot_rows`` [M * width] lists,
image by image, the row in each of ``width`` slots (N: an empty slot), ``row_slots`` [N] the
slot of every row; the queries are gathered into [M, width, ...], attend to their image's keys
in one product, and are gathered back.

Show, Attend and Tell (``sat_*.onnx``), with the frozen image encoder (``image_encoder.onnx``:
normalised pixels [B, 3, H, W] -> grid vectors [B, N, C]):

* :class:`SATInitGraph`: grid a [B, N, D], valid [B, N] -> W_a a, h_0, c_0.
* :class:`SATStepGraph`: one word: the previous token, the attention inputs (a, valid, W_a a)
  and the LSTM state (h, c) -> log p(next token) [B, V], attention [B, N], new h, c.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.data.latex import PAD_ID
from tellkit.models.baselines.common import masked_softmax


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, d] -> [B, heads, L, d / heads]."""
    b, n, d = x.shape
    return x.reshape(b, n, heads, d // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, hd] -> [B, L, heads * hd]."""
    b, h, n, hd = x.shape
    return x.transpose(1, 2).reshape(b, n, h * hd)


def _attend_images(mha, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor,
                   slot_rows: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """Cross-attention of rows ``x`` [N, T, d] to the keys/values of their image (``k``, ``v``
    [M, heads, S, hd], ``pad`` [M, S] True = no key), through the slot layout (module docstring)."""
    n, t, d = x.shape
    m = k.shape[0]
    q = mha.q_proj(x) * mha.scaling
    flat = torch.cat([q.reshape(n, t * d), q.new_zeros(1, t * d)])  # row N: an empty slot
    q = _heads(flat.index_select(0, slot_rows).reshape(m, -1, d), mha.num_heads)  # [M, heads, width*T, hd]
    scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill(pad[:, None, None, :], float("-inf"))
    out = _merge(torch.matmul(torch.softmax(scores, -1), v))  # [M, width*T, d]
    out = out.reshape(-1, t * d).index_select(0, row_slots).reshape(n, t, d)
    return mha.out_proj(out)


def _positions(position: torch.Tensor, d_model: int) -> torch.Tensor:
    """``position`` [L] (float) -> [L, d] encodings, as :func:`tellkit.models.bttr.word_positions`."""
    w = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
    ang = position[:, None] * w[None]
    return torch.stack([ang.sin(), ang.cos()], -1).flatten(1)


class BTTREncoderGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.encoder = model.encoder

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        # no mask: one unpadded size per call (BTTR.encode_by_size groups the images by size)
        return self.encoder(image, None)[0]


class BTTRMemoryGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.layers = model.decoder.layers

    def forward(self, memory: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for layer in self.layers:
            mha = layer.cross_attn
            out += [_heads(mha.k_proj(memory), mha.num_heads), _heads(mha.v_proj(memory), mha.num_heads)]
        return tuple(out)


class _BTTRDecoderGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.decoder = model.decoder
        self.d_model = model.config.d_model

    def _block(self, layer, x, k, v, self_mask, memory, pad, slot_rows, row_slots):
        """One post-LN decoder layer: ``x`` [N, T, d] attends to keys/values ``k``/``v`` (``self_mask``
        [N or 1, 1, T, K] True = hidden, or None), then to its image's memory."""
        mha = layer.self_attn
        q = _heads(mha.q_proj(x) * mha.scaling, mha.num_heads)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self_mask is not None:
            scores = scores.masked_fill(self_mask, float("-inf"))
        h = mha.out_proj(_merge(torch.matmul(torch.softmax(scores, -1), v)))
        x = layer.norm1(x + h)
        mk, mv = memory
        x = layer.norm2(x + _attend_images(layer.cross_attn, x, mk, mv, pad, slot_rows, row_slots))
        first, _, _, second = layer.ff
        return layer.norm3(x + second(F.relu(first(x))))

    def _embed(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        return d.embed_norm(d.embed(tokens)) + _positions(position, self.d_model)


class BTTRStepGraph(_BTTRDecoderGraph):
    def forward(self, tokens, position, slot_rows, row_slots, memory_pad, *state):
        """``tokens`` [N] (int64), ``position`` [1] (int64), ``state``: per layer the past key and
        value [N, heads, t, hd], then per layer the memory key and value [M, heads, S, hd]."""
        n_layers = len(self.decoder.layers)
        past, memory = state[: 2 * n_layers], state[2 * n_layers:]
        x = self._embed(tokens[:, None], position.float())  # [N, 1, d]
        present = []
        for i, layer in enumerate(self.decoder.layers):
            mha = layer.self_attn
            k = torch.cat([past[2 * i], _heads(mha.k_proj(x), mha.num_heads)], 2)
            v = torch.cat([past[2 * i + 1], _heads(mha.v_proj(x), mha.num_heads)], 2)
            present += [k, v]
            x = self._block(layer, x, k, v, None, memory[2 * i: 2 * i + 2], memory_pad, slot_rows, row_slots)
        logits = self.decoder.out(x[:, 0])
        return (torch.log_softmax(logits.float(), -1), *present)


class BTTRScoreGraph(_BTTRDecoderGraph):
    def forward(self, inputs, targets, slot_rows, row_slots, memory_pad, *memory):
        """``inputs`` / ``targets`` [N, L] (PAD after each row's end) -> sum of log p(targets) [N]."""
        length = inputs.shape[1]
        steps = torch.arange(length, device=inputs.device)
        x = self._embed(inputs, steps.float())
        hidden = (steps[None, :] > steps[:, None])[None, None] | (inputs == PAD_ID)[:, None, None, :]
        for i, layer in enumerate(self.decoder.layers):
            mha = layer.self_attn
            k, v = _heads(mha.k_proj(x), mha.num_heads), _heads(mha.v_proj(x), mha.num_heads)
            x = self._block(layer, x, k, v, hidden, memory[2 * i: 2 * i + 2], memory_pad, slot_rows, row_slots)
        lp = torch.log_softmax(self.decoder.out(x).float(), -1)
        tok = lp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
        return (tok * (targets != PAD_ID).float()).sum(-1)


class _PaddedConv(nn.Module):
    """A TF 'same' convolution (:class:`tellkit.encoders.efficientnet_lite.Conv2d`) with the
    padding of one input size as constants (a trace would compute it with ONNX's truncating
    integer division, which rounds the other way for odd sizes)."""

    def __init__(self, conv: nn.Conv2d, pads: list[int]):
        super().__init__()
        self.conv, self.pads = conv, pads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Conv2d.forward(self.conv, F.pad(x, self.pads) if any(self.pads) else x)


def _same_pads(conv: nn.Conv2d, shape: torch.Size) -> list[int]:
    pads = []
    for size, k, s in zip(shape[-1:-3:-1], conv.kernel_size[::-1], conv.stride[::-1]):
        total = max((-(-size // s) - 1) * s + k - size, 0)  # width first, as F.pad wants
        pads += [total // 2, total - total // 2]
    return pads


class ImageEncoderGraph(nn.Module):
    """The frozen image encoder at one pixel size [3, H, W] (``size``), batched."""

    def __init__(self, encoder, size: tuple[int, int]):
        super().__init__()
        self.encoder = copy.deepcopy(encoder).eval()
        convs = {name: mod for name, mod in self.encoder.named_modules() if getattr(mod, "tf_same", False)}
        pads: dict[str, list[int]] = {}

        def record(name: str):
            def hook(mod, args):  # returns None: the input goes on unchanged
                pads.setdefault(name, _same_pads(mod, args[0].shape))
            return hook

        hooks = [mod.register_forward_pre_hook(record(name)) for name, mod in convs.items()]
        with torch.no_grad():
            self.encoder(torch.zeros(1, 3, *size))
        for h in hooks:
            h.remove()
        for name, mod in convs.items():
            parent, _, child = name.rpartition(".")
            setattr(self.encoder.get_submodule(parent) if parent else self.encoder, child, _PaddedConv(mod, pads[name]))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encoder(pixels)[0]


class SATInitGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, a: torch.Tensor, valid: torch.Tensor):
        m = self.model
        w = valid.to(a.dtype)[..., None]
        mean = (a * w).sum(1) / w.sum(1).clamp(min=1.0)  # tellkit.models.baselines.common.masked_mean
        return m.att_image(a), torch.tanh(m.init_h(mean)), torch.tanh(m.init_c(mean))


class SATStepGraph(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding; an adaptive (banded) one computed for every band and kept where
        the token falls (no data-dependent selection)."""
        emb = self.model.embed
        if isinstance(emb, nn.Embedding):
            return emb(tokens)
        out = None
        for (lo, hi), table, proj in zip(emb.bands, emb.embeddings, emb.projections):
            part = proj(table((tokens - lo).clamp(0, hi - lo - 1)))
            part = torch.where(((tokens >= lo) & (tokens < hi))[:, None], part, torch.zeros_like(part))
            out = part if out is None else out + part
        return out

    def forward(self, tokens, a, valid, wa, h, c):
        m, cfg = self.model, self.model.config
        e = m.att_score(torch.tanh(wa + m.att_hidden(h)[:, None, :])).squeeze(-1)
        alpha = masked_softmax(e, valid).to(a.dtype)
        z = torch.bmm(alpha[:, None, :], a).squeeze(1)
        if m.beta is not None:
            z = torch.sigmoid(m.beta(h)) * z
        emb = self.embed(tokens)
        if cfg.first_input == "zeros":
            emb = emb * (tokens != cfg.bos_id).to(emb.dtype)[:, None]
        cell = m.cell  # nn.LSTMCell written out: gates i, f, g, o
        gates = F.linear(torch.cat([emb, z], -1), cell.weight_ih, cell.bias_ih) + F.linear(h, cell.weight_hh,
                                                                                          cell.bias_hh)
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        deep = emb + m.out_hidden(h) + m.out_context(z)
        if cfg.deep_output_tanh:
            deep = torch.tanh(deep)
        return m.out.log_probs(deep), alpha, h, c
