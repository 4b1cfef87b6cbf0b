"""The LSTM rows of Transform and Tell's ablation (Tran, Mathews, Xie, CVPR 2020, Table 4:
"LSTM + GloVe", "LSTM + weighted RoBERTa"): an LSTM decoder that reads the SAME context sets
as the Transform and Tell decoder (image grid, article tokens, optionally faces and objects),
with the same adaptive input / adaptive softmax over RoBERTa's BPE vocabulary.

Why a file of its own and not Show-Attend-and-Tell with more contexts: the paper's LSTM
baseline (reference ``lstm_decoder_flattened``) is a fairseq-style LSTM with Luong-style
attention AFTER the recurrent step and input feeding, one attention per context whose outputs
are concatenated and projected; Show-Attend-and-Tell attends BEFORE the step with additive
attention, a gate and a deep output layer, over one image. Different equations, so a
different file.

Per step t (d = hidden size, one attention per context k with features s_{k,j}):

    x_t         = [AdaptiveInput(y_{t-1}); f_{t-1}]                  input feeding
    h_t         = stacked LSTMCells(x_t)                              learned initial h, c
    a_{k,t}     = softmax_j(s_{k,j} . W_k h_t)                        (padding masked)
    o_{k,t}     = tanh(U_k [sum_j a_{k,t,j} s_{k,j}; h_t])            d-dimensional
    f_t         = P [o_{1,t}; ...; o_{K,t}]                           -> adaptive softmax

The article may be the encoder's stacked hidden states [B, layers, L, C]: with
``article_layers > 1`` they are mixed by learned softmax weights ("weighted RoBERTa"), with 1
the last layer is read; static word vectors ("GloVe") come as [B, L, 300] (or [B, 1, L, C]).
An empty set (no faces) attends to nothing and contributes tanh(U_k [0; h_t]).
Differences from the reference: none in the equations known to us; initialisation is
PyTorch's default instead of uniform(-0.1, 0.1) for the LSTM cells.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.errors import TellkitError
from tellkit.layers.adaptive import AdaptiveInput, AdaptiveSoftmax
from tellkit.layers.layer_mix import LayerMix
from tellkit.layers.loss import token_loss
from tellkit.models.baselines.common import attention_lists, context_set, masked_softmax, search, shift
from tellkit.registry import register_model

CONTEXTS = ("image", "article", "faces", "objects")


@dataclass
class LSTMCaptionerConfig:
    vocab_size: int = 50265
    bos_id: int = 0
    pad_id: int = 1
    eos_id: int = 2
    embed_dim: int = 1024  # adaptive input / softmax width
    hidden_dim: int = 1024
    num_layers: int = 2
    dropout: float = 0.1
    adaptive_cutoffs: tuple[int, ...] = (5000, 20000)
    adaptive_factor: float = 1.0
    contexts: tuple[str, ...] = ("image", "article")
    image_dim: int = 2048
    article_dim: int = 1024
    article_layers: int = 25  # 1 = last layer (or static vectors); > 1 = learned weighted mix
    face_dim: int = 512
    object_dim: int = 2048
    max_len: int = 100

    def __post_init__(self):
        self.contexts = tuple(self.contexts)
        self.adaptive_cutoffs = tuple(self.adaptive_cutoffs)
        bad = [c for c in self.contexts if c not in CONTEXTS]
        if bad or not self.contexts or len(set(self.contexts)) != len(self.contexts):
            raise ValueError(f"contexts must be distinct names from {CONTEXTS}, got {list(self.contexts)}")
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")

    def context_dim(self, name: str) -> int:
        return {"image": self.image_dim, "article": self.article_dim, "faces": self.face_dim,
                "objects": self.object_dim}[name]


class ContextAttention(nn.Module):
    """Luong-style ("general") attention of the decoder state over one context set."""

    def __init__(self, hidden: int, source: int):
        super().__init__()
        self.query = nn.Linear(hidden, source, bias=True)
        self.out = nn.Linear(source + hidden, hidden, bias=True)

    def forward(self, h: torch.Tensor, src: torch.Tensor, valid: torch.Tensor):
        scores = torch.bmm(src, self.query(h)[:, :, None]).squeeze(-1)  # [B, S]
        alpha = masked_softmax(scores, valid).to(src.dtype)
        ctx = torch.bmm(alpha[:, None, :], src).squeeze(1)
        return torch.tanh(self.out(torch.cat([ctx, h], dim=-1))), alpha


@register_model("lstm_captioner", LSTMCaptionerConfig)
class LSTMCaptioner(nn.Module, PretrainedMixin):
    def __init__(self, config: LSTMCaptionerConfig):
        super().__init__()
        self.config = cfg = config
        H = cfg.hidden_dim
        self.embed = AdaptiveInput(cfg.vocab_size, cfg.embed_dim, cfg.adaptive_cutoffs, cfg.adaptive_factor, cfg.pad_id)
        self.cells = nn.ModuleList(nn.LSTMCell((cfg.embed_dim + H) if i == 0 else H, H) for i in range(cfg.num_layers))
        self.h0 = nn.Parameter(torch.zeros(cfg.num_layers, H))
        self.c0 = nn.Parameter(torch.zeros(cfg.num_layers, H))
        mix_layers = "article" in cfg.contexts and cfg.article_layers > 1
        self.article_mix = LayerMix(cfg.article_layers) if mix_layers else None
        self.attn = nn.ModuleDict({name: ContextAttention(H, cfg.context_dim(name)) for name in cfg.contexts})
        self.attn_proj = nn.Linear(len(cfg.contexts) * H, H)
        self.out_proj = nn.Linear(H, cfg.embed_dim, bias=False) if H != cfg.embed_dim else None
        self.softmax = AdaptiveSoftmax(cfg.vocab_size, cfg.embed_dim, cfg.adaptive_cutoffs, cfg.adaptive_factor,
                                       tied_to=self.embed)

    # -- contexts and one step --------------------------------------------------------------
    def encode(self, batch: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        feats, valid = {}, {}
        for name in cfg.contexts:
            mix = self.article_mix if name == "article" else None
            feats[name], valid[name] = context_set(batch, name, cfg.context_dim(name), mix, cfg.article_layers)
        B = {f.size(0) for f in feats.values()}
        if len(B) != 1:
            raise TellkitError(f"contexts disagree on the batch size: {sorted(B)}")
        n = B.pop()
        return {"feats": feats, "valid": valid,
                "h": [self.h0[i].expand(n, -1) for i in range(cfg.num_layers)],
                "c": [self.c0[i].expand(n, -1) for i in range(cfg.num_layers)],
                "feed": self.h0.new_zeros(n, cfg.hidden_dim)}

    def step(self, y_prev: torch.Tensor, s: dict[str, Any], emb: torch.Tensor | None = None):
        """One word: (output vector [B, embed_dim], attention {context: [B, S]}, new state).
        ``emb``: the word's embedding when the caller looked the whole caption up at once."""
        p = self.config.dropout
        emb = self.embed(y_prev) if emb is None else emb
        x = torch.cat([F.dropout(emb, p, self.training), s["feed"]], dim=-1)
        hs, cs = [], []
        for i, cell in enumerate(self.cells):
            h, c = cell(x, (s["h"][i], s["c"][i]))
            hs.append(h)
            cs.append(c)
            x = F.dropout(h, p, self.training)
        outs, alphas = [], {}
        for name, attn in self.attn.items():
            o, alphas[name] = attn(h, s["feats"][name], s["valid"][name])
            outs.append(o)
        feed = self.attn_proj(F.dropout(torch.cat(outs, dim=-1), p, self.training))
        y = self.out_proj(feed) if self.out_proj is not None else feed
        return y, alphas, {**s, "h": hs, "c": cs, "feed": feed}

    def teacher_forced(self, batch: dict[str, Any], inp: torch.Tensor):
        s = self.encode(batch)
        ys, alphas = [], {name: [] for name in self.config.contexts}
        embs = self.embed(inp)  # one lookup: one embedding backward, not one per step
        for t in range(inp.size(1)):
            y, a, s = self.step(inp[:, t], s, embs[:, t])
            ys.append(y)
            for name, w in a.items():
                alphas[name].append(w)
        return torch.stack(ys, 1), {k: torch.stack(v, 1) for k, v in alphas.items()}, s["valid"]

    # -- training -----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inp, target, mask = shift(batch["caption"], self.config.pad_id)
        y, _, _ = self.teacher_forced(batch, inp)
        lp = self.softmax.target_log_probs(y[mask], target[mask])
        return token_loss(lp, mask.sum())

    # -- generation ---------------------------------------------------------------------------
    def _search_step(self, last: torch.Tensor, s: dict):
        y, _, s = self.step(last, s)
        return self.softmax.log_probs(y), s

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 return_attention: bool = False, n_best: int = 1) -> dict[str, Any]:
        """Greedy or beam search; ``return_attention``: per generated token (EOS included),
        context -> weights over its real entries."""
        cfg = self.config
        s = self.encode(batch)
        B = s["feed"].size(0)
        out = search(self._search_step, s, B, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
                     max_len=max_len or cfg.max_len, beam_size=beam_size, length_penalty=length_penalty,
                     min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size, n_best=n_best,
                     device=s["feed"].device)
        if return_attention:
            out["attention"] = []
            for b, toks in enumerate(out["tokens"]):
                sub = {k: v[b:b + 1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                inp = torch.tensor([[cfg.bos_id, *toks]], device=s["feed"].device)
                _, alphas, valid = self.teacher_forced(sub, inp)
                out["attention"].append(attention_lists(alphas, valid, 0, len(toks) + 1))
        return out
