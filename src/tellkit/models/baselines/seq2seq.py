"""Sequence-to-sequence with additive attention (Bahdanau, Cho, Bengio: "Neural Machine
Translation by Jointly Learning to Align and Translate", ICLR 2015), as the text-only baseline
of the summarization task (How2 transcript -> summary).

    encoder     h_j = [fwd GRU; bwd GRU](E x_j)                         (bidirectional)
    start       s_0 = tanh(W_s h_1^bwd)
    attention   e_ij = v^T tanh(W_a s_{i-1} + U_a h_j),  a_ij = softmax_j e_ij,  c_i = sum_j a_ij h_j
    decoder     s_i = GRU([E y_{i-1}; c_i], s_{i-1})
    output      t_i = maxout_2(T_s s_i + T_y E y_{i-1} + T_c c_i),  p(y_i) = softmax(W_o t_i)

It plugs into the summarization task (``task: summarize``, batches of ``input_ids``,
``attention_mask``, ``labels`` with -100 at padding) like VG-BART: ``backbone`` names the
tokenizer (an HF tokenizer folder or hub name; only its vocabulary is used: this model is
trained from scratch, so :meth:`load_backbone_weights` has nothing to load), ``fusion: none``
(no video). Differences from the paper: sub-word vocabulary of the given tokenizer instead of
30,000 words; the project's greedy / beam search (the paper: beam search); padding is masked.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.errors import TellkitError
from tellkit.layers.loss import logits_loss
from tellkit.models.baselines.common import masked_softmax, search
from tellkit.models.vg_gplm import load_tokenizer
from tellkit.registry import register_model


@dataclass
class Seq2SeqConfig:
    backbone: str = "facebook/bart-base"  # tokenizer source (folder or hub name); no weights are read
    vocab_size: int | None = None  # None: the tokenizer's size, filled in when the model is built
    pad_id: int | None = None  # None: from the tokenizer
    bos_id: int | None = None  # decoder start token (None: the tokenizer's BOS, else its PAD as T5)
    eos_id: int | None = None
    embed_dim: int = 620  # the paper: 620-d embeddings, 1000 hidden units, maxout 500
    hidden_dim: int = 1000
    attention_dim: int = 1000
    maxout_dim: int = 500
    dropout: float = 0.3
    max_len: int = 64
    # read by the summarization task (shared with VG-BART / VG-T5)
    fusion: str = "none"  # this baseline never reads video
    video_dim: int = 2048
    new_layer_lr_scale: float = 1.0

    def __post_init__(self):
        if self.fusion != "none":
            raise ValueError("the seq2seq baseline is text-only: fusion must be 'none'")


def _resolve_vocab(cfg: Seq2SeqConfig) -> None:
    """Fill vocab_size and special ids from the tokenizer when the config leaves them open."""
    if cfg.vocab_size is not None and None not in (cfg.pad_id, cfg.bos_id, cfg.eos_id):
        return

    tok = load_tokenizer(cfg.backbone)
    if cfg.vocab_size is None:
        cfg.vocab_size = len(tok)
    if cfg.pad_id is None:
        cfg.pad_id = tok.pad_token_id
    if cfg.eos_id is None:
        cfg.eos_id = tok.eos_token_id
    if cfg.bos_id is None:
        cfg.bos_id = tok.bos_token_id if tok.bos_token_id is not None else tok.pad_token_id
    if None in (cfg.pad_id, cfg.eos_id, cfg.bos_id):
        raise TellkitError(f"tokenizer '{cfg.backbone}' lacks a pad or eos token")


@register_model("seq2seq", Seq2SeqConfig)
class Seq2Seq(nn.Module, PretrainedMixin):
    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        _resolve_vocab(config)
        self.config = cfg = config
        E, H, A = cfg.embed_dim, cfg.hidden_dim, cfg.attention_dim
        self.embed_src = nn.Embedding(cfg.vocab_size, E, padding_idx=cfg.pad_id)
        self.embed_tgt = nn.Embedding(cfg.vocab_size, E, padding_idx=cfg.pad_id)
        self.encoder = nn.GRU(E, H, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(H, H)
        self.att_state = nn.Linear(H, A, bias=False)  # W_a
        self.att_source = nn.Linear(2 * H, A)  # U_a (applied once per source)
        self.att_score = nn.Linear(A, 1, bias=False)  # v
        self.decoder = nn.GRUCell(E + 2 * H, H)
        self.out_state = nn.Linear(H, 2 * cfg.maxout_dim)
        self.out_prev = nn.Linear(E, 2 * cfg.maxout_dim, bias=False)
        self.out_context = nn.Linear(2 * H, 2 * cfg.maxout_dim, bias=False)
        self.out = nn.Linear(cfg.maxout_dim, cfg.vocab_size)

    # -- the summarization task's hooks (shared with VG-BART / VG-T5) -----------------------
    def load_backbone_weights(self) -> None:
        """Nothing to load: the baseline is trained from scratch (only the tokenizer is used)."""

    def new_parameters(self) -> Iterator[nn.Parameter]:
        """No parameter gets a separate learning rate (there is no pre-trained part)."""
        return iter(())

    # -- encoder / decoder ------------------------------------------------------------------
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        valid = (input_ids != self.config.pad_id) if attention_mask is None else attention_mask.bool()
        lengths = valid.sum(1).clamp(min=1)
        x = F.dropout(self.embed_src(input_ids), self.config.dropout, self.training)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, last = self.encoder(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=input_ids.size(1))
        s0 = torch.tanh(self.init_state(last[1]))  # the backward GRU's state at the first word
        return {"h": h, "uh": self.att_source(h), "valid": valid, "s": s0}

    def step(self, y_prev: torch.Tensor, st: dict[str, torch.Tensor]):
        """One target word: (logits [B, V], attention [B, L], new state)."""
        e = self.att_score(torch.tanh(st["uh"] + self.att_state(st["s"])[:, None, :])).squeeze(-1)
        a = masked_softmax(e, st["valid"]).to(st["h"].dtype)
        c = torch.bmm(a[:, None, :], st["h"]).squeeze(1)
        emb = F.dropout(self.embed_tgt(y_prev), self.config.dropout, self.training)
        s = self.decoder(torch.cat([emb, c], dim=-1), st["s"])
        t = self.out_state(s) + self.out_prev(emb) + self.out_context(c)
        t = t.view(t.size(0), -1, 2).max(-1).values  # maxout over pairs
        logits = self.out(F.dropout(t, self.config.dropout, self.training))
        return logits, a, {**st, "s": s}

    def _targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels (-100 at padding) -> targets with PAD, without a leading BOS (never generated)."""
        cfg = self.config
        tgt = labels.masked_fill(labels < 0, cfg.pad_id)
        if tgt.size(1) > 1 and cfg.bos_id != cfg.pad_id and bool((tgt[:, 0] == cfg.bos_id).all()):
            tgt = tgt[:, 1:]
        return tgt

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        cfg = self.config
        target = self._targets(batch["labels"])
        start = torch.full_like(target[:, :1], cfg.bos_id)
        inp = torch.cat([start, target[:, :-1]], dim=1)
        st = self.encode(batch["input_ids"], batch.get("attention_mask"))
        logits = []
        for t in range(inp.size(1)):
            lg, _, st = self.step(inp[:, t], st)
            logits.append(lg)
        return logits_loss(torch.stack(logits, 1), target, ignore_index=cfg.pad_id)

    def _search_step(self, last: torch.Tensor, st: dict):
        logits, _, st = self.step(last, st)
        return torch.log_softmax(logits.float(), dim=-1), st

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 n_best: int = 1, **_: Any) -> dict[str, Any]:
        """Greedy or beam search -> ``tokens`` (ids without start/EOS) and ``scores``."""
        cfg = self.config
        st = self.encode(batch["input_ids"], batch.get("attention_mask"))
        return search(self._search_step, st, st["h"].size(0), bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
                      max_len=max_len or cfg.max_len, beam_size=beam_size, length_penalty=length_penalty,
                      min_len=max(1, min_len), no_repeat_ngram_size=no_repeat_ngram_size, n_best=n_best,
                      device=st["h"].device)
