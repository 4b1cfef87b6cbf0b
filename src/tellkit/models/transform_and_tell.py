"""Transform and Tell (Tran, Mathews, Xie: "Transform and Tell: Entity-Aware News Image
Captioning", CVPR 2020), the decoder and its context attention.

Pipeline: frozen encoders give SETS of context vectors (image grid, article token states from
every encoder layer, face embeddings, object features; see ``tellkit.encoders``). This module
is everything trained on top of them:

    tokens -> adaptive input (x sqrt(d)) + sinusoidal positions
    N x block:  dynamic conv over past tokens            -> residual + LayerNorm
                attention to each context (own residual + LayerNorm), in parallel
                concatenate -> Linear(n_ctx * d, d)
                FFN d -> 4d -> ReLU -> d                  -> residual + LayerNorm
    adaptive softmax tied to the adaptive input  [+ optional copy head over article tokens]

Article vectors are a learned softmax-weighted sum over the encoder's hidden states.
Faithful to the reference configuration (fairseq-style dynamic conv with GLU and weight
softmax, context attention with key/value bias and a zero-attention slot, adaptive input
factor 1 with cutoffs [5000, 20000], weight-normalised ``GehringLinear`` projections, layer mix
initialised uniform(0, 1), the first token at position 2 as fairseq numbers positions);
``configs/tat/nytimes_full.yaml`` has 200,461,337 trainable parameters, exactly as the reference
counts, and the reference's weights port with ``tellkit convert``. Differences: the copy head
copies only from the article given as input (the reference's withdrawn copy results leaked the
caption); the loss is the exact adaptive-softmax cross-entropy (``reference_adaptive_loss``
gives the reference's, which drops the in-cluster term of the ids 5001 and 20001).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.decoding.search import run_sample, run_search
from tellkit.decoding.state import RowContext, reorder_state
from tellkit.errors import TellkitError
from tellkit.layers import rows
from tellkit.layers.adaptive import AdaptiveInput, AdaptiveSoftmax
from tellkit.layers.attention import MultiheadAttention, ProjectedKV
from tellkit.layers.dynamic_conv import DynamicConvLayer
from tellkit.layers.layer_mix import LayerMix
from tellkit.layers.linear import GehringLinear
from tellkit.layers.loss import token_loss, weight_sequences
from tellkit.layers.positional import SinusoidalPositions
from tellkit.registry import register_model
from tellkit.utils.precision import autocast_input

CONTEXTS = ("image", "article", "faces", "objects")


@dataclass
class TransformAndTellConfig:
    # vocabulary (RoBERTa's byte-level BPE ids)
    vocab_size: int = 50265
    bos_id: int = 0
    pad_id: int = 1
    eos_id: int = 2
    # decoder
    d_model: int = 1024
    num_layers: int = 4
    num_heads: int = 16
    ffn_dim: int = 4096
    kernel_sizes: tuple[int, ...] = (3, 7, 15, 31)
    glu: bool = True
    weight_softmax: bool = True
    dropout: float = 0.1
    attention_dropout: float = 0.1
    input_dropout: float = 0.1
    relu_dropout: float = 0.0
    weight_dropout: float = 0.1
    scale_embeddings: bool = True
    # number of the first caption position (the reference: padding_idx + 1 = 2; padding
    # positions then get the zero encoding); 0 numbers from zero
    position_start: int = 0
    # linear layers of the blocks: the reference's GehringLinear (N(0, 1/fan_in) + weight
    # normalisation, one extra parameter per output) or plain Xavier-initialised nn.Linear
    gehring_linear: bool = False
    # the reference's adaptive input has padding_idx 0 in every band: ids 0, 5000, 20000 embed to
    # zero and are never trained
    reference_embedding_padding: bool = False
    # the reference's AdaptiveLoss ignores target 1 inside each tail cluster too (ids 5001 and
    # 20001 lose their in-cluster term); False = the exact cross-entropy
    reference_adaptive_loss: bool = False
    # article layer-mix weights: "uniform" (the reference: uniform(0, 1)) or "zeros"
    layer_mix_init: str = "uniform"
    # adaptive input / softmax
    adaptive_cutoffs: tuple[int, ...] = (5000, 20000)
    adaptive_factor: float = 1.0
    adaptive_softmax_dropout: float = 0.0
    tie_adaptive_proj: bool = False
    # contexts, in the order their attention outputs are concatenated
    contexts: tuple[str, ...] = ("image", "article", "faces")
    image_dim: int = 2048
    article_dim: int = 1024
    article_layers: int = 25
    face_dim: int = 512
    object_dim: int = 2048
    context_kv_bias: bool = True
    context_zero_attn: bool = True
    # copying from the article (pointer-generator style)
    copy: bool = False
    # generation default (the reference: greedy, at most 100 tokens)
    max_len: int = 100

    def __post_init__(self):
        self.kernel_sizes = tuple(self.kernel_sizes)
        self.contexts = tuple(self.contexts)
        self.adaptive_cutoffs = tuple(self.adaptive_cutoffs)
        if len(self.kernel_sizes) != self.num_layers:
            raise ValueError(f"kernel_sizes has {len(self.kernel_sizes)} entries for {self.num_layers} layers")
        bad = [c for c in self.contexts if c not in CONTEXTS]
        if bad or len(set(self.contexts)) != len(self.contexts):
            raise ValueError(f"contexts must be distinct names from {CONTEXTS}, got {list(self.contexts)}")
        if not self.contexts:
            raise ValueError("at least one context is needed")
        if self.copy and "article" not in self.contexts:
            raise ValueError("copy needs the article context")
        if self.d_model % self.num_heads:
            raise ValueError("d_model must be divisible by num_heads")
        if self.position_start < 0:
            raise ValueError("position_start must be >= 0")

    def context_dim(self, name: str) -> int:
        return {"image": self.image_dim, "article": self.article_dim, "faces": self.face_dim,
                "objects": self.object_dim}[name]


# ---------------------------------------------------------------------------------------
class DecoderBlock(nn.Module):
    def __init__(self, cfg: TransformAndTellConfig, kernel_size: int):
        super().__init__()
        d = cfg.d_model
        self.dropout, self.relu_dropout = cfg.dropout, cfg.relu_dropout
        self.conv = DynamicConvLayer(d, kernel_size, cfg.num_heads, cfg.weight_dropout, cfg.input_dropout,
                                     cfg.glu, cfg.weight_softmax, gehring_linear=cfg.gehring_linear)
        self.conv_norm = nn.LayerNorm(d)
        self.context_attn = nn.ModuleDict({
            name: MultiheadAttention(d, cfg.num_heads, kdim=cfg.context_dim(name), vdim=cfg.context_dim(name),
                                     dropout=cfg.attention_dropout, add_bias_kv=cfg.context_kv_bias,
                                     add_zero_attn=cfg.context_zero_attn)
            for name in cfg.contexts})
        self.context_norm = nn.ModuleDict({name: nn.LayerNorm(d) for name in cfg.contexts})
        if cfg.gehring_linear:
            self.context_proj = GehringLinear(len(cfg.contexts) * d, d)
            self.fc1 = GehringLinear(d, cfg.ffn_dim)
            self.fc2 = GehringLinear(cfg.ffn_dim, d)
        else:
            self.context_proj = nn.Linear(len(cfg.contexts) * d, d)
            self.fc1 = nn.Linear(d, cfg.ffn_dim)
            self.fc2 = nn.Linear(cfg.ffn_dim, d)
            for lin in (self.context_proj, self.fc1, self.fc2):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)
        self.final_norm = nn.LayerNorm(d)

    def project_contexts(self, contexts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, ProjectedKV]:
        return {name: attn.project_kv(contexts[name][0], key_padding_mask=~contexts[name][1])
                for name, attn in self.context_attn.items()}

    def forward(self, x: torch.Tensor, kvs: dict[str, ProjectedKV], state: dict | None = None,
                need_weights: bool = False):
        residual = x
        x = self.conv(x, state)
        x = self.conv_norm(residual + F.dropout(x, self.dropout, self.training))
        outs, weights = [], {}
        for name, attn in self.context_attn.items():
            y, w = attn.attend(x, kvs[name], need_weights=need_weights)
            outs.append(self.context_norm[name](x + F.dropout(y, self.dropout, self.training)))
            weights[name] = w
        x = rows.linear(self.context_proj, torch.cat(outs, dim=-1))
        residual = x
        y = F.dropout(F.relu(rows.linear(self.fc1, x)), self.relu_dropout, self.training)
        x = self.final_norm(residual + F.dropout(rows.linear(self.fc2, y), self.dropout, self.training))
        return x, weights


class CopyHead(nn.Module):
    """Attention from the final decoder state to the article; its (head-averaged) weights are
    the probability of copying each article token, mixed with the vocabulary distribution by
    a learned gate: p(w) = g p_vocab(w) + (1 - g) sum_{i: id_i = w} a_i. Article tokens with no
    caption id (id -1) or padding cannot be copied."""

    def __init__(self, cfg: TransformAndTellConfig):
        super().__init__()
        self.attn = MultiheadAttention(cfg.d_model, cfg.num_heads, kdim=cfg.article_dim, vdim=cfg.article_dim,
                                       dropout=cfg.attention_dropout)
        self.gate = nn.Linear(2 * cfg.d_model, 1)

    def forward(self, h: torch.Tensor, kv: ProjectedKV, copyable: torch.Tensor):
        ctx, w = self.attn.attend(h, kv, need_weights=True)  # w: [B, T, L]
        gate = torch.sigmoid(rows.linear(self.gate, torch.cat([h, ctx], dim=-1)).squeeze(-1).float())
        gate = torch.where(copyable.any(dim=1)[:, None], gate, torch.ones_like(gate))  # nothing to copy
        return gate, w.float()


@dataclass
class Contexts:
    feats: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (features [B,S,C], valid [B,S], True = real)
    article_ids: torch.Tensor | None = None  # [B, L] caption ids of article tokens (-1: none)
    layer_kvs: list[dict[str, ProjectedKV]] = field(default_factory=list)
    copy_kv: ProjectedKV | None = None

    def index_select(self, index: torch.Tensor) -> Contexts:
        return Contexts(
            {k: (f.index_select(0, index), m.index_select(0, index)) for k, (f, m) in self.feats.items()},
            None if self.article_ids is None else self.article_ids.index_select(0, index),
            [{k: kv.index_select(index) for k, kv in layer.items()} for layer in self.layer_kvs],
            None if self.copy_kv is None else self.copy_kv.index_select(index))


@register_model("transform_and_tell", TransformAndTellConfig)
class TransformAndTell(nn.Module, PretrainedMixin):
    def __init__(self, config: TransformAndTellConfig):
        super().__init__()
        self.config = cfg = config
        d = cfg.d_model
        self.embed_scale = math.sqrt(d) if cfg.scale_embeddings else 1.0
        self.embed = AdaptiveInput(cfg.vocab_size, d, cfg.adaptive_cutoffs, cfg.adaptive_factor, cfg.pad_id,
                                   band_padding_idx=0 if cfg.reference_embedding_padding else None)
        self.positions = SinusoidalPositions(d)
        self.article_mix = (LayerMix(cfg.article_layers, init=cfg.layer_mix_init)
                            if "article" in cfg.contexts and cfg.article_layers > 1 else None)
        self.layers = nn.ModuleList(DecoderBlock(cfg, k) for k in cfg.kernel_sizes)
        self.softmax = AdaptiveSoftmax(cfg.vocab_size, d, cfg.adaptive_cutoffs, cfg.adaptive_factor,
                                       cfg.adaptive_softmax_dropout, tied_to=self.embed, tie_proj=cfg.tie_adaptive_proj)
        self.copy_head = CopyHead(cfg) if cfg.copy else None

    # -- contexts ---------------------------------------------------------------------------
    def encode_contexts(self, batch: dict[str, Any]) -> Contexts:
        """Validate the batch's context tensors (``tellkit.data.batch.CaptionBatch``), mix article
        layers; masks stay True = a real entry until the attention call."""
        cfg = self.config
        feats = {}
        B = None
        for name in cfg.contexts:
            x = batch.get(name)
            if x is None:
                raise TellkitError(f"batch has no '{name}' context, which this model uses "
                                   f"(contexts: {list(cfg.contexts)})")
            if name == "article" and self.article_mix is not None:
                if x.dim() != 4 or x.size(1) != cfg.article_layers:
                    raise TellkitError(f"article must be [B, {cfg.article_layers} layers, L, {cfg.article_dim}], "
                                       f"got {tuple(x.shape)}")
                x = self.article_mix(x, layer_dim=1)
            elif name == "article" and x.dim() == 4:
                x = x[:, -1]
            if x.dim() != 3 or x.size(-1) != cfg.context_dim(name):
                raise TellkitError(f"{name} features must be [B, N, {cfg.context_dim(name)}], got {tuple(x.shape)}")
            if B is not None and x.size(0) != B:
                raise TellkitError(f"{name} has batch size {x.size(0)}, expected {B}")
            B = x.size(0)
            valid = batch.get(f"{name}_mask")
            valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if valid is None else valid.bool()
            if valid.shape != x.shape[:2]:
                raise TellkitError(f"{name}_mask has shape {tuple(valid.shape)}, expected {tuple(x.shape[:2])}")
            feats[name] = (x, valid)
        ctx = Contexts(feats)
        if self.copy_head is not None:
            ids = batch.get("article_ids")
            if ids is None:
                raise TellkitError("the copy head needs 'article_ids' (caption ids of the article tokens)")
            ctx.article_ids = ids.long()
        return ctx

    def project_contexts(self, ctx: Contexts) -> Contexts:
        """Compute every layer's context keys/values once per input (not once per step). Under
        autocast each context is cast once here, not by each of the layers' products."""
        feats = {name: (autocast_input(x), valid) for name, (x, valid) in ctx.feats.items()}
        ctx.layer_kvs = [layer.project_contexts(feats) for layer in self.layers]
        if self.copy_head is not None:
            art, valid = feats["article"]
            uncopyable = ~valid | (ctx.article_ids < 0)
            ctx.copy_kv = self.copy_head.attn.project_kv(art, key_padding_mask=uncopyable)
        return ctx

    # -- decoder ------------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Scaled adaptive input + sinusoidal position of ``tokens`` [B, T] whose first column is
        caption position ``start`` (numbered from ``position_start``)."""
        dtype = self.embed.projections[0].weight.dtype
        pos = self.positions(tokens.size(1), start + self.config.position_start).to(dtype)
        if self.config.position_start > 0:  # fairseq: padding takes the zero position encoding
            pos = pos.unsqueeze(0) * (tokens != self.config.pad_id).unsqueeze(-1).to(dtype)
        return self.embed(tokens) * self.embed_scale + pos

    def decode(self, tokens: torch.Tensor, ctx: Contexts, states: list[dict] | None = None, start: int = 0,
               need_weights: bool = False):
        """Run the decoder on ``tokens`` [B, T] whose first position is ``start``."""
        x = self.embed_tokens(tokens, start)
        x = F.dropout(x, self.config.dropout, self.training)
        attn = []
        for i, layer in enumerate(self.layers):
            x, w = layer(x, ctx.layer_kvs[i], None if states is None else states[i], need_weights)
            attn.append(w)
        return x, attn

    def _copy_terms(self, h: torch.Tensor, ctx: Contexts):
        copyable = ~ctx.copy_kv.key_padding_mask[:, : ctx.copy_kv.num_real]
        return self.copy_head(h, ctx.copy_kv, copyable)

    def next_log_probs(self, h: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        """Full log-distribution [B, T, V] from decoder states (vocabulary + copying)."""
        lp = self.softmax.log_probs(h)
        if self.copy_head is None:
            return lp
        gate, w = self._copy_terms(h, ctx)
        ids = ctx.article_ids.clamp(min=0)[:, None, :].expand(-1, h.size(1), -1)
        copy = torch.zeros_like(lp).scatter_add_(2, ids, w)
        return torch.log(gate[..., None] * lp.exp() + (1 - gate[..., None]) * copy)

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Teacher-forced loss: mean cross-entropy (nats) over the caption's target tokens. With
        ``batch["sequence_weights"]`` [B] each caption's token log-probabilities are weighted
        by its row's value (self-critical training: the reward advantage of a drawn caption)."""
        cap = batch["caption"]
        inp, target = cap[:, :-1], cap[:, 1:]
        ctx = self.project_contexts(self.encode_contexts(batch))
        h, _ = self.decode(inp, ctx)
        mask = target != self.config.pad_id
        ignore = self.config.pad_id if self.config.reference_adaptive_loss else None
        lp = self.softmax.target_log_probs(h[mask], target[mask], ignore_in_cluster=ignore)
        if self.copy_head is not None:
            gate, w = self._copy_terms(h, ctx)
            hit = (ctx.article_ids[:, None, :] == target[:, :, None]).to(w.dtype)
            copy_p = (w * hit).sum(-1)[mask]
            g = gate[mask]
            lp = torch.logaddexp(torch.log(g) + lp, torch.log1p(-g) + torch.log(copy_p))
        return token_loss(weight_sequences(lp, batch.get("sequence_weights"), mask), mask.sum())

    @torch.no_grad()
    def log_probs(self, batch: dict[str, Any]) -> torch.Tensor:
        """Teacher-forced full log-probabilities [B, T-1, V] of each next caption token."""
        ctx = self.project_contexts(self.encode_contexts(batch))
        h, _ = self.decode(batch["caption"][:, :-1], ctx)
        return self.next_log_probs(h, ctx)

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 return_attention: bool = False, n_best: int = 1, prepack: bool = True) -> dict[str, Any]:
        """Greedy (``beam_size=1``, the reference's choice) or beam search, batched, with
        incremental state. Returns ``tokens`` (caption ids, no BOS/EOS), ``scores``, and with
        ``return_attention`` per-token attention over each context (mean over heads, layers).

        ``prepack``: float32 products on a CPU, and bfloat16-autocast ones, use oneDNN-packed
        copies of the weights (:func:`tellkit.layers.rows.prepacked`: faster, equal to rounding;
        the copies take as much memory as the float32 weights, half that in bfloat16, and stay
        while the weights do). ``False``: the plain ``F.linear`` products."""
        with rows.prepacked(prepack):
            return self._generate(batch, max_len, beam_size, length_penalty, min_len, no_repeat_ngram_size,
                                  return_attention, n_best)

    def _generate(self, batch, max_len, beam_size, length_penalty, min_len, no_repeat_ngram_size,
                  return_attention, n_best) -> dict[str, Any]:
        cfg = self.config
        max_len = max_len or cfg.max_len
        ctx = self.encode_contexts(batch)
        B = next(iter(ctx.feats.values()))[0].size(0)
        device = next(iter(ctx.feats.values()))[0].device
        ctx = self.project_contexts(ctx)
        common = dict(bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id, max_len=max_len, min_len=min_len,
                      no_repeat_ngram_size=no_repeat_ngram_size, device=device)
        out = run_search(lambda sel: _Incremental(self, ctx) if sel is None else
                         _Incremental(self, ctx.index_select(sel), sel),
                         B, beam_size=beam_size, length_penalty=length_penalty, n_best=n_best, **common)
        if return_attention:
            out["attention"] = self._attention_for(ctx, out["tokens"])
        return out

    @torch.no_grad()
    def sample(self, batch: dict[str, Any], num_samples: int = 1, max_len: int | None = None, min_len: int = 1,
               temperature: float = 1.0, generator: torch.Generator | None = None,
               prepack: bool = True) -> dict[str, Any]:
        """``num_samples`` captions drawn from the model for each input (rows of input b are
        consecutive): ``tokens`` (no BOS/EOS) and ``log_probs`` (their summed log-probabilities).
        ``prepack``: as for :meth:`generate`."""
        with rows.prepacked(prepack):
            return self._sample(batch, num_samples, max_len, min_len, temperature, generator)

    def _sample(self, batch, num_samples, max_len, min_len, temperature, generator) -> dict[str, Any]:
        cfg = self.config
        ctx = self.encode_contexts(batch)
        B = next(iter(ctx.feats.values()))[0].size(0)
        device = next(iter(ctx.feats.values()))[0].device
        ctx = self.project_contexts(ctx)
        return run_sample(lambda sel: _Incremental(self, ctx.index_select(sel), sel), B, num_samples,
                          bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id, max_len=max_len or cfg.max_len,
                          min_len=min_len, temperature=temperature, generator=generator, device=device)

    def _attention_for(self, ctx: Contexts, token_lists: list[list[int]]) -> list[list[dict[str, list[float]]]]:
        """Re-run the chosen captions teacher-forced to read the attention each token was
        generated with (identical to generation-time attention in eval mode)."""
        cfg = self.config
        result = []
        for b, toks in enumerate(token_lists):
            sub = ctx.index_select(torch.tensor([b], device=ctx.feats[cfg.contexts[0]][0].device))
            inp = torch.tensor([[cfg.bos_id, *toks]], device=sub.feats[cfg.contexts[0]][0].device)
            _, attn = self.decode(inp, sub, need_weights=True)
            per_token = []
            for t in range(len(toks) + 1):  # the last row produced EOS
                entry = {}
                for name in cfg.contexts:
                    w = torch.stack([layer[name][0, t] for layer in attn]).mean(0)
                    valid = sub.feats[name][1][0]
                    entry[name] = w[valid].tolist()
                per_token.append(entry)
            result.append(per_token)
        return result

    def parameter_parts(self) -> dict[str, Any]:
        return {"adaptive_input": self.embed, "decoder_blocks": self.layers,
                "adaptive_softmax_own": self.softmax, "article_layer_mix": self.article_mix,
                **({"copy_head": self.copy_head} if self.copy_head is not None else {})}


class _Incremental:
    """:class:`tellkit.decoding.state.IncrementalDecoder` over the model: one new token per
    step, per-layer conv histories (the last K-1 inputs only) and context keys/values
    computed once. ``row_sample``: the input of each row of ``ctx`` (default: one row each)."""

    def __init__(self, model: TransformAndTell, ctx: Contexts, row_sample: torch.Tensor | None = None):
        self.model = model
        self.states: list[dict] = [{} for _ in model.layers]
        n = next(iter(ctx.feats.values()))[0].size(0)
        self.ctx = RowContext(ctx, torch.arange(n) if row_sample is None else row_sample)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.size(1) - 1
        h, _ = self.model.decode(tokens[:, -1:], self.ctx.value, self.states, start=t)
        return self.model.next_log_probs(h, self.ctx.value)[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        self.states = reorder_state(self.states, index)
        self.ctx.reorder(index)
