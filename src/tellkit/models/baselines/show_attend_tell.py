"""Show, Attend and Tell (Xu, Ba, Kiros, Cho, Courville, Salakhutdinov, Zemel, Bengio: "Show,
Attend and Tell: Neural Image Caption Generation with Visual Attention", ICML 2015), the
deterministic "soft" attention model.

    a_i (i = 1..N)  image grid vectors (the paper: VGG 14 x 14 x 512; here the task's grid)
    h_0, c_0        = tanh(W_h mean(a)), tanh(W_c mean(a))
    e_ti            = w^T tanh(W_a a_i + U_a h_{t-1})          additive attention
    alpha_t         = softmax_i(e_ti)
    z_t             = sigmoid(W_beta h_{t-1}) * sum_i alpha_ti a_i     (the gating scalar beta)
    h_t, c_t        = LSTM([E y_{t-1}; z_t], h_{t-1}, c_{t-1})
    p(y_t)          = softmax(L_o dropout(E y_{t-1} + L_h h_t + L_z z_t))   the deep output layer
    loss            = -sum_t log p(y_t) + lambda * sum_i (1 - sum_t alpha_ti)^2

The last term is the doubly stochastic regulariser: over the whole caption, every grid
location should receive about one unit of attention. The loss is divided by the number of
target tokens (the training loop's contract); ``nll_bits`` reports the caption part alone.

Differences from the paper: frozen tellkit image encoder (no fine-tuning); RoBERTa BPE ids as
the vocabulary; the regulariser sums only over a caption's real steps (padding excluded); the
search is the project's greedy / beam search.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.layers.loss import token_loss
from tellkit.models.baselines.common import (
    VocabOutput,
    attention_lists,
    context_set,
    masked_mean,
    masked_softmax,
    search,
    shift,
)
from tellkit.registry import register_model


@dataclass
class ShowAttendTellConfig:
    vocab_size: int = 50265
    bos_id: int = 0
    pad_id: int = 1
    eos_id: int = 2
    image_dim: int = 2048
    embed_dim: int = 512
    hidden_dim: int = 1024
    attention_dim: int = 512
    dropout: float = 0.5
    gate: bool = True  # the beta gating scalar on the attended vector
    doubly_stochastic: float = 1.0  # lambda of the attention regulariser (the paper: 1)
    adaptive_cutoffs: tuple[int, ...] = ()  # () = full softmax (the paper); e.g. [5000, 20000] = adaptive
    adaptive_factor: float = 4.0
    max_len: int = 100
    # the context sets the captioning task must provide: the image grid only
    contexts: tuple[str, ...] = ("image",)

    def __post_init__(self):
        self.adaptive_cutoffs = tuple(self.adaptive_cutoffs)
        self.contexts = tuple(self.contexts)
        if self.contexts != ("image",):
            raise ValueError("Show, Attend and Tell reads the image only: contexts must be [image], "
                             f"got {list(self.contexts)}")


@register_model("show_attend_tell", ShowAttendTellConfig)
class ShowAttendTell(nn.Module, PretrainedMixin):
    def __init__(self, config: ShowAttendTellConfig):
        super().__init__()
        self.config = cfg = config
        D, H, E, A = cfg.image_dim, cfg.hidden_dim, cfg.embed_dim, cfg.attention_dim
        self.init_h = nn.Linear(D, H)
        self.init_c = nn.Linear(D, H)
        self.att_image = nn.Linear(D, A)  # W_a (applied once per image)
        self.att_hidden = nn.Linear(H, A, bias=False)  # U_a
        self.att_score = nn.Linear(A, 1)  # w
        self.beta = nn.Linear(H, 1) if cfg.gate else None
        self.embed = nn.Embedding(cfg.vocab_size, E, padding_idx=cfg.pad_id)
        self.cell = nn.LSTMCell(E + D, H)
        self.out_hidden = nn.Linear(H, E)  # L_h
        self.out_context = nn.Linear(D, E, bias=False)  # L_z
        self.out = VocabOutput(cfg.vocab_size, E, cfg.adaptive_cutoffs, cfg.adaptive_factor)  # L_o

    # -- one decoding step ------------------------------------------------------------------
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        a, valid = context_set(batch, "image", self.config.image_dim)
        mean = masked_mean(a, valid)
        return {"a": a, "valid": valid, "wa": self.att_image(a),
                "h": torch.tanh(self.init_h(mean)), "c": torch.tanh(self.init_c(mean))}

    def step(self, y_prev: torch.Tensor, s: dict[str, torch.Tensor]):
        """One word: returns (deep output vector [B, E], attention [B, N], new state)."""
        e = self.att_score(torch.tanh(s["wa"] + self.att_hidden(s["h"])[:, None, :])).squeeze(-1)
        alpha = masked_softmax(e, s["valid"]).to(s["a"].dtype)
        z = torch.bmm(alpha[:, None, :], s["a"]).squeeze(1)
        if self.beta is not None:
            z = torch.sigmoid(self.beta(s["h"])) * z
        emb = self.embed(y_prev)
        h, c = self.cell(torch.cat([F.dropout(emb, self.config.dropout, self.training), z], dim=-1), (s["h"], s["c"]))
        deep = emb + self.out_hidden(h) + self.out_context(z)
        return F.dropout(deep, self.config.dropout, self.training), alpha, {**s, "h": h, "c": c}

    def teacher_forced(self, batch: dict[str, Any], inp: torch.Tensor):
        """Deep outputs [B, T, E] and attention [B, T, N] for input tokens ``inp`` [B, T]."""
        s = self.encode(batch)
        logits, alphas = [], []
        for t in range(inp.size(1)):
            lg, alpha, s = self.step(inp[:, t], s)
            logits.append(lg)
            alphas.append(alpha)
        return torch.stack(logits, 1), torch.stack(alphas, 1), s["valid"]

    # -- training -----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inp, target, mask = shift(batch["caption"], self.config.pad_id)
        deep, alpha, valid = self.teacher_forced(batch, inp)
        reg = None
        if self.config.doubly_stochastic > 0:
            total = (alpha.float() * mask[..., None]).sum(1)  # [B, N]: attention each location received
            reg = self.config.doubly_stochastic * (((1.0 - total) ** 2) * valid).sum()
        out = token_loss(self.out.target_log_probs(deep[mask], target[mask]), mask.sum(), reg)
        if reg is not None:
            out["attention_reg"] = reg.detach() / out["ntokens"].clamp(min=1)
        return out

    # -- generation ---------------------------------------------------------------------------
    def _search_step(self, last: torch.Tensor, s: dict):
        deep, _, s = self.step(last, s)
        return self.out.log_probs(deep), s

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 return_attention: bool = False, n_best: int = 1) -> dict[str, Any]:
        """Greedy or beam search; ``return_attention`` gives, per generated token (EOS
        included), the weights over the image grid."""
        cfg = self.config
        s = self.encode(batch)
        B = s["a"].size(0)
        out = search(self._search_step, s, B, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
                     max_len=max_len or cfg.max_len, beam_size=beam_size, length_penalty=length_penalty,
                     min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size, n_best=n_best, device=s["a"].device)
        if return_attention:
            out["attention"] = []
            for b, toks in enumerate(out["tokens"]):
                sub = {k: v[b:b + 1] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                inp = torch.tensor([[cfg.bos_id, *toks]], device=s["a"].device)
                _, alpha, valid = self.teacher_forced(sub, inp)
                out["attention"].append(attention_lists({"image": alpha}, {"image": valid}, 0, len(toks) + 1))
        return out
