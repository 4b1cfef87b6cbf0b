"""Show, Attend and Tell (Xu, Ba, Kiros, Cho, Courville, Salakhutdinov, Zemel, Bengio: "Show,
Attend and Tell: Neural Image Caption Generation with Visual Attention", ICML 2015), the
deterministic "soft" attention model.

    a_i (i = 1..N)  image grid vectors (the paper: VGG 14 x 14 x 512; here the task's grid)
    h_0, c_0        = tanh(W_h mean(a)), tanh(W_c mean(a))
    e_ti            = w^T tanh(W_a a_i + U_a h_{t-1})          additive attention
    alpha_t         = softmax_i(e_ti)
    z_t             = sigmoid(W_beta h_{t-1}) * sum_i alpha_ti a_i     (the gating scalar beta)
    h_t, c_t        = LSTM([E y_{t-1}; z_t], h_{t-1}, c_{t-1})
    p(y_t)          = softmax(L_o drop(f(E y_{t-1} + L_h drop(h_t) + L_z z_t)))   the deep output layer
    loss            = -sum_t log p(y_t) + lambda * sum_i (1 - sum_t alpha_ti)^2

The last term is the doubly stochastic regulariser: over the whole caption, every grid
location should receive about one unit of attention. The loss is divided by the number of
target tokens (the training loop's contract); ``nll_bits`` reports the caption part alone.

Where the paper and the authors' code (kelvinxu/arctic-captions, ``capgen.py``) differ, a config
field says which one runs:

- ``deep_output_tanh``: f is the identity in the paper's equation 7; the code applies tanh
  (``logit = tanh(ff_logit_lstm(h) + emb + ff_logit_ctx(z))``). False (the paper) by default.
- ``first_input``: what the LSTM and the deep output read as E y_{-1}: ``bos``, the embedding of
  the caption vocabulary's BOS id, or ``zeros``, the zero vector the code feeds (its captions
  start with no BOS word). The paper does not say. ``bos`` by default.
- ``doubly_stochastic_norm``: ``caption`` is the paper's equation 14 (per caption: lambda times
  the sum over locations, beside the caption's summed NLL); ``batch`` is the code's
  ``alpha_c * ((1 - alphas.sum(0)) ** 2).sum(0).mean()`` added to the batch-mean NLL: summed over
  the batch and averaged over locations, i.e. an effective lambda * B / N per caption (B captions,
  N locations). The code's batches hold captions of one length (``HomogeneousData``), so no step
  is padded there; here the sum runs over each caption's real steps (its words and EOS).

The defaults keep checkpoints made before these fields existed reading as they were trained.
Dropout (``dropout``) acts where the code puts it: on h_t before L_h and on the deep output
before L_o (never on the recurrent state or the LSTM's input).

``attention: hard`` is the paper's stochastic "hard" attention (its section 4.1): at every step
one grid location s_t ~ Multinoulli(alpha_t) is read, z_t = a_{s_t}. Training maximises the
variational lower bound sum_s p(s|a) log p(y|s,a) with one sampled s per caption and the
paper's REINFORCE estimator:

    d/dW  log p(y|s~,a)  +  lambda_r (log p(y|s~,a) - b) d/dW log p(s~|a)  +  lambda_e d/dW H[s~]

with b an exponential moving average of log p(y|s~,a) (decay 0.9, a buffer saved with the
weights), H the entropy of the attention distributions over the caption's steps, and, as in the
paper, for half of the images (drawn per image and batch) s~ replaced by its expectation alpha
(the soft context; no estimator terms for those). The doubly stochastic penalty is the soft
model's and is not used with hard attention. Generation reads the expected context alpha (a
deterministic search); the paper gives no value for lambda_e (``entropy_weight``).

Self-critical training (:mod:`tellkit.training.self_critical`) draws captions with :meth:`draw`,
which keeps, for every drawn token, its log-probability from the pass that drew it (same dropout
masks), and hands the model a batch with a ``self_critical`` entry that computes the loss.

Other differences from the paper and its code: frozen tellkit image encoder (no fine-tuning);
RoBERTa BPE ids as the vocabulary (adaptive softmax); one linear layer for the attention's image
projection and for the initial state (the code's Flickr8k/COCO runs used two, ``n_layers_att`` /
``n_layers_init``, and an LSTM of 1,800 units); the search is the project's greedy / beam search.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.errors import TellkitError
from tellkit.layers.adaptive import AdaptiveInput
from tellkit.layers.loss import token_loss, weight_sequences
from tellkit.models.baselines.common import (
    VocabOutput,
    attention_lists,
    context_set,
    draw,
    masked_mean,
    masked_softmax,
    sample,
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
    # "caption" (the paper's eq. 14) | "batch" (the authors' code: summed over the batch, averaged
    # over locations: lambda * B / N per caption)
    doubly_stochastic_norm: str = "caption"
    deep_output_tanh: bool = False  # tanh on the deep output (the authors' code); the paper's eq. 7 has none
    first_input: str = "bos"  # E y_{-1}: "bos" (the BOS id's embedding) | "zeros" (the authors' code)
    adaptive_cutoffs: tuple[int, ...] = ()  # () = full softmax (the paper); e.g. [5000, 20000] = adaptive
    adaptive_factor: float = 4.0
    # the input embedding in the same frequency bands as the adaptive softmax (smaller bands for
    # rarer ids, projected to embed_dim; tellkit.layers.adaptive.AdaptiveInput) instead of one
    # vocab_size x embed_dim table: about a fifth of its size with RoBERTa's 50,265 ids
    adaptive_input: bool = False
    max_len: int = 100
    # the context sets the captioning task must provide: the image grid only
    contexts: tuple[str, ...] = ("image",)
    # "soft" (deterministic, the default) or "hard" (stochastic, REINFORCE; see the module text)
    attention: str = "soft"
    reinforce_weight: float = 1.0  # hard: lambda_r
    entropy_weight: float = 0.01  # hard: lambda_e
    expected_context_prob: float = 0.5  # hard: share of images read with the expected context
    baseline_decay: float = 0.9  # hard: the moving-average baseline's decay

    def __post_init__(self):
        self.adaptive_cutoffs = tuple(self.adaptive_cutoffs)
        self.contexts = tuple(self.contexts)
        if self.attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', got {self.attention!r}")
        if self.doubly_stochastic_norm not in ("caption", "batch"):
            raise ValueError("doubly_stochastic_norm must be 'caption' or 'batch', "
                             f"got {self.doubly_stochastic_norm!r}")
        if self.first_input not in ("bos", "zeros"):
            raise ValueError(f"first_input must be 'bos' or 'zeros', got {self.first_input!r}")
        if not 0.0 <= self.expected_context_prob <= 1.0 or not 0.0 <= self.baseline_decay < 1.0:
            raise ValueError("expected_context_prob must be in [0, 1] and baseline_decay in [0, 1)")
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
        self.embed = (AdaptiveInput(cfg.vocab_size, E, cfg.adaptive_cutoffs, cfg.adaptive_factor, cfg.pad_id)
                      if cfg.adaptive_input else nn.Embedding(cfg.vocab_size, E, padding_idx=cfg.pad_id))
        self.cell = nn.LSTMCell(E + D, H)
        self.out_hidden = nn.Linear(H, E)  # L_h
        self.out_context = nn.Linear(D, E, bias=False)  # L_z
        self.out = VocabOutput(cfg.vocab_size, E, cfg.adaptive_cutoffs, cfg.adaptive_factor)  # L_o
        if cfg.attention == "hard":  # the REINFORCE baseline b and whether it has started
            self.register_buffer("reward_baseline", torch.zeros(()))
            self.register_buffer("baseline_started", torch.zeros((), dtype=torch.bool))

    @property
    def samples_attention(self) -> bool:
        """Hard attention draws locations in training; searches read the expected context."""
        return self.config.attention == "hard" and self.training

    # -- one decoding step ------------------------------------------------------------------
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        a, valid = context_set(batch, "image", self.config.image_dim)
        mean = masked_mean(a, valid)
        return {"a": a, "valid": valid, "wa": self.att_image(a),
                "h": torch.tanh(self.init_h(mean)), "c": torch.tanh(self.init_c(mean))}

    def step(self, y_prev: torch.Tensor, s: dict[str, torch.Tensor], emb: torch.Tensor | None = None):
        """One word: returns (deep output vector [B, E], attention [B, N], new state). ``emb``:
        the word's embedding when the caller has it (teacher forcing embeds the whole caption in
        one lookup: one embedding backward, not one dense vocabulary-sized gradient per step)."""
        e = self.att_score(torch.tanh(s["wa"] + self.att_hidden(s["h"])[:, None, :])).squeeze(-1)
        alpha = masked_softmax(e, s["valid"]).to(s["a"].dtype)
        read = alpha
        if self.samples_attention:  # one location per caption whose image draws, else alpha
            picked = torch.multinomial(alpha.float().clamp(min=0) + (~s["valid"].any(-1, keepdim=True)).float(), 1)
            one_hot = torch.zeros_like(alpha).scatter_(1, picked, 1.0)
            draws = s["draws"][:, None]
            read = torch.where(draws, one_hot, alpha)
            p = alpha.float()
            logp = torch.log(p.gather(1, picked).squeeze(1).clamp(min=1e-12))
            s = {**s, "logp_s": logp * s["draws"], "entropy": -(p * torch.log(p.clamp(min=1e-12))).sum(-1)}
        z = torch.bmm(read[:, None, :], s["a"]).squeeze(1)
        if self.beta is not None:
            z = torch.sigmoid(self.beta(s["h"])) * z
        emb = self.embed(y_prev) if emb is None else emb
        cfg = self.config
        if cfg.first_input == "zeros":  # the first step reads a zero vector, not the BOS embedding
            emb = emb * (y_prev != cfg.bos_id).to(emb.dtype)[:, None]
        h, c = self.cell(torch.cat([emb, z], dim=-1), (s["h"], s["c"]))
        deep = emb + self.out_hidden(F.dropout(h, cfg.dropout, self.training)) + self.out_context(z)
        if cfg.deep_output_tanh:
            deep = torch.tanh(deep)
        return F.dropout(deep, cfg.dropout, self.training), alpha, {**s, "h": h, "c": c}

    def teacher_forced(self, batch: dict[str, Any], inp: torch.Tensor, hard: dict | None = None):
        """Deep outputs [B, T, E] and attention [B, T, N] for input tokens ``inp`` [B, T]. With
        hard attention in training, ``hard`` receives the per-step log p(s~_t) and entropies
        ([B, T] each) and which captions drew (``draws`` [B])."""
        s = self.encode(batch)
        if self.samples_attention:
            B = s["a"].size(0)
            s["draws"] = torch.rand(B, device=s["a"].device) >= self.config.expected_context_prob
        logits, alphas, logps, ents = [], [], [], []
        embs = self.embed(inp)
        for t in range(inp.size(1)):
            lg, alpha, s = self.step(inp[:, t], s, embs[:, t])
            logits.append(lg)
            alphas.append(alpha)
            if self.samples_attention:
                logps.append(s["logp_s"])
                ents.append(s["entropy"])
        if hard is not None and logps:
            hard.update(logp=torch.stack(logps, 1), entropy=torch.stack(ents, 1), draws=s["draws"])
        return torch.stack(logits, 1), torch.stack(alphas, 1), s["valid"]

    def _reinforce(self, hard: dict, target_lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The hard-attention estimator's terms as a summed surrogate (added to the summed NLL):
        -lambda_r (log p(y|s~) - b) sum_t log p(s~_t) - lambda_e sum_t H_t; updates b."""
        cfg = self.config
        reward = target_lp.detach().float().sum(1)  # log p(y | s~, a) per caption
        draws = hard["draws"]
        m = mask.float()
        surrogate = -cfg.entropy_weight * (hard["entropy"] * m).sum()
        if bool(draws.any()):
            b = self.reward_baseline
            advantage = (reward - b) * draws.float()
            surrogate = surrogate - cfg.reinforce_weight * (advantage * (hard["logp"] * m).sum(1)).sum()
            with torch.no_grad():
                mean = reward[draws].mean()
                new = torch.where(self.baseline_started, cfg.baseline_decay * b + (1 - cfg.baseline_decay) * mean, mean)
                self.reward_baseline.copy_(new)
                self.baseline_started.fill_(True)
        return surrogate

    # -- training -----------------------------------------------------------------------------
    def attention_penalty(self, alpha: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The doubly stochastic regulariser, summed like the caption NLL it is added to:
        ``alpha`` [B, T, N] over a caption's real steps ``mask`` [B, T] and real locations
        ``valid`` [B, N]; ``caption``: lambda * sum_b sum_i (1 - sum_t alpha_bti)^2 (the paper);
        ``batch``: the code's batch sum of location means, times B (its NLL is a batch mean)."""
        cfg = self.config
        total = (alpha.float() * mask[..., None]).sum(1)  # [B, N]: attention each location received
        per_caption = (((1.0 - total) ** 2) * valid).sum(1)  # [B]
        if cfg.doubly_stochastic_norm == "batch":
            per_caption = per_caption / valid.sum(1).clamp(min=1) * alpha.size(0)
        return cfg.doubly_stochastic * per_caption.sum()

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        policy = batch.get("self_critical")
        if policy is not None:  # self-critical training: the loss of captions drawn in this pass
            return policy(self, batch)
        inp, target, mask = shift(batch["caption"], self.config.pad_id)
        hard: dict[str, torch.Tensor] = {}
        deep, alpha, valid = self.teacher_forced(batch, inp, hard)
        reg = None
        if self.config.doubly_stochastic > 0 and self.config.attention == "soft":
            reg = self.attention_penalty(alpha, mask, valid)
        target_lp = weight_sequences(self.out.target_log_probs(deep[mask], target[mask]),
                                     batch.get("sequence_weights"), mask)
        if hard:
            per_token = torch.zeros(mask.shape, dtype=target_lp.dtype, device=target_lp.device)
            per_token[mask] = target_lp
            reg = self._reinforce(hard, per_token, mask)
        out = token_loss(target_lp, mask.sum(), reg)
        if reg is not None:
            out["attention_reg"] = reg.detach() / out["ntokens"].clamp(min=1)
        return out

    # -- generation ---------------------------------------------------------------------------
    def _draw_step(self, last: torch.Tensor, s: dict):
        deep, _, s = self.step(last, s)
        return deep, s

    def _search_step(self, last: torch.Tensor, s: dict):
        deep, _, s = self.step(last, s)
        return self.out.log_probs(deep), s

    def sample(self, batch: dict[str, Any], num_samples: int = 1, max_len: int | None = None, min_len: int = 1,
               temperature: float = 1.0, generator: torch.Generator | None = None) -> dict[str, Any]:
        """``num_samples`` captions drawn from the model for each image (self-critical
        training; soft attention only: hard attention's drawn locations have no search state)."""
        cfg = self.config
        if cfg.attention != "soft":
            raise TellkitError("Show, Attend and Tell draws captions with soft attention only "
                               f"(model.attention is '{cfg.attention}')")
        s = self.encode(batch)
        return sample(self._search_step, s, s["a"].size(0), num_samples, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                      pad_id=cfg.pad_id, max_len=max_len or cfg.max_len, min_len=min_len,
                      temperature=temperature, generator=generator, device=s["a"].device)

    def draw(self, batch: dict[str, Any], num_samples: int = 1, max_len: int | None = None, min_len: int = 1,
             temperature: float = 1.0, generator: torch.Generator | None = None,
             greedy: bool = False) -> dict[str, Any]:
        """``num_samples`` captions per image drawn in the model's current mode (dropout on in
        training), keeping the graph: ``log_probs`` [B * K, max_len] holds each drawn token's
        log-probability from this very pass (see :func:`tellkit.models.baselines.common.draw`)."""
        cfg = self.config
        if cfg.attention != "soft":
            raise TellkitError("Show, Attend and Tell draws captions with soft attention only "
                               f"(model.attention is '{cfg.attention}')")
        s = self.encode(batch)
        return draw(self._draw_step, self.out, s, s["a"].size(0), num_samples, bos_id=cfg.bos_id, eos_id=cfg.eos_id,
                    pad_id=cfg.pad_id, max_len=max_len or cfg.max_len, min_len=min_len, temperature=temperature,
                    generator=generator, greedy=greedy, device=s["a"].device)

    def caption_log_probs(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced log p of each target token of ``batch["caption"]`` [B, T-1] and the
        target mask, without the attention penalty (self-critical training's cross-entropy)."""
        inp, target, mask = shift(batch["caption"], self.config.pad_id)
        deep, _, _ = self.teacher_forced(batch, inp)
        lp = torch.zeros(mask.shape, dtype=torch.float32, device=deep.device)
        return lp.masked_scatter(mask, self.out.target_log_probs(deep[mask], target[mask])), mask

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
