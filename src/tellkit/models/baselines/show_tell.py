"""Show and Tell (Vinyals, Toshev, Bengio, Erhan: "Show and Tell: A Neural Image Caption
Generator", CVPR 2015): one image vector, then an LSTM language model.

    v   = W_img mean(image grid)                       the image, embedded like a word
    h_0 = LSTM(v)                                      the image is the input at t = -1 only
    h_t = LSTM(E w_{t-1}, h_{t-1}),  p(w_t) = softmax(W_out dropout(h_t))

Differences from the paper: the CNN is tellkit's frozen image encoder and its vector is the
mean of the grid the captioning task provides (the paper used GoogLeNet's pooled output, with
BatchNorm, fine-tuned); words are RoBERTa's byte-level BPE ids (the project's caption
vocabulary) instead of a word list of frequent words; no model ensembles. Decoding uses the
project's search (greedy, or beam as in the paper's beam of 20 when asked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.layers.loss import token_loss
from tellkit.models.baselines.common import VocabOutput, context_set, masked_mean, search, shift
from tellkit.registry import register_model


@dataclass
class ShowTellConfig:
    vocab_size: int = 50265  # RoBERTa byte-level BPE ids
    bos_id: int = 0
    pad_id: int = 1
    eos_id: int = 2
    image_dim: int = 2048  # channels of the image grid (ResNet-152: 2048, MobileNetV2: 1280)
    embed_dim: int = 512  # word and image embedding size (the paper: 512)
    hidden_dim: int = 512  # LSTM memory size (the paper: 512)
    num_layers: int = 1
    dropout: float = 0.5
    tie_embeddings: bool = False  # output weights = input embeddings (needs embed_dim == hidden_dim)
    adaptive_cutoffs: tuple[int, ...] = ()  # () = full softmax (the paper); e.g. [5000, 20000] = adaptive
    adaptive_factor: float = 4.0
    max_len: int = 100
    # the context sets the captioning task must provide: the image grid only
    contexts: tuple[str, ...] = ("image",)

    def __post_init__(self):
        self.contexts = tuple(self.contexts)
        if self.contexts != ("image",):
            raise ValueError(f"Show and Tell reads the image only: contexts must be [image], got {list(self.contexts)}")
        self.adaptive_cutoffs = tuple(self.adaptive_cutoffs)
        if self.tie_embeddings and (self.embed_dim != self.hidden_dim or self.adaptive_cutoffs):
            raise ValueError("tie_embeddings needs embed_dim == hidden_dim and a full softmax")
        if self.num_layers < 1:
            raise ValueError("num_layers must be >= 1")


@register_model("show_tell", ShowTellConfig)
class ShowTell(nn.Module, PretrainedMixin):
    def __init__(self, config: ShowTellConfig):
        super().__init__()
        self.config = cfg = config
        self.image_proj = nn.Linear(cfg.image_dim, cfg.embed_dim)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim, padding_idx=cfg.pad_id)
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden_dim, cfg.num_layers, batch_first=True,
                            dropout=cfg.dropout if cfg.num_layers > 1 else 0.0)
        self.out = VocabOutput(cfg.vocab_size, cfg.hidden_dim, cfg.adaptive_cutoffs, cfg.adaptive_factor)
        if cfg.tie_embeddings:
            self.out.linear.weight = self.embed.weight
        nn.init.uniform_(self.embed.weight, -0.08, 0.08)  # the paper's initialisation scale
        with torch.no_grad():
            self.embed.weight[cfg.pad_id].zero_()

    def start_state(self, batch: dict[str, Any]):
        """Feed the image vector: the LSTM state (h, c) before the first word."""
        img, valid = context_set(batch, "image", self.config.image_dim)
        v = F.dropout(self.image_proj(masked_mean(img, valid)), self.config.dropout, self.training)
        _, state = self.lstm(v[:, None, :])
        return state

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        inp, target, mask = shift(batch["caption"], self.config.pad_id)
        x = F.dropout(self.embed(inp), self.config.dropout, self.training)
        h, _ = self.lstm(x, self.start_state(batch))
        h = F.dropout(h, self.config.dropout, self.training)
        return token_loss(self.out.target_log_probs(h[mask], target[mask]), mask.sum())

    def _search_step(self, last: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        h, (hh, cc) = self.lstm(self.embed(last)[:, None, :], (state["h"].transpose(0, 1).contiguous(),
                                                                state["c"].transpose(0, 1).contiguous()))
        lp = self.out.log_probs(h[:, 0])
        # rows first, so that the search can reorder them
        return lp, {"h": hh.transpose(0, 1), "c": cc.transpose(0, 1)}

    @torch.no_grad()
    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 return_attention: bool = False, n_best: int = 1) -> dict[str, Any]:
        """Greedy or beam search. Show and Tell attends to nothing: with ``return_attention``
        each generated token gets an empty dict."""
        cfg = self.config
        h, c = self.start_state(batch)
        B = h.size(1)
        out = search(self._search_step, {"h": h.transpose(0, 1), "c": c.transpose(0, 1)}, B, bos_id=cfg.bos_id,
                     eos_id=cfg.eos_id, pad_id=cfg.pad_id, max_len=max_len or cfg.max_len, beam_size=beam_size,
                     length_penalty=length_penalty, min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size,
                     n_best=n_best, device=h.device)
        if return_attention:
            out["attention"] = [[{} for _ in range(len(t) + 1)] for t in out["tokens"]]
        return out
