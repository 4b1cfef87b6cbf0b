"""The article encoder: any Hugging Face encoder, read as ALL its hidden states so that the
captioner can learn a weighted mix of layers (Transform and Tell: x_i = sum_l alpha_l g_{l,i}).

    enc = ArticleEncoder()                    # offline default: all-MiniLM-L6-v2 (7 x 384)
    enc = ArticleEncoder("roberta-large")     # the paper's encoder by hub name (25 x 1024)
    out = enc.encode(["article text", ...], max_tokens=512)
    out["hidden"]   float[B, enc.num_layers, L, enc.dim]   (embeddings output + every layer)
    out["mask"]     bool[B, L]                             (True = a real token)
    out["tokens"]   list of token strings per text (unpadded), out["offsets"] their char spans
    ids = enc.caption_ids(texts, out["offsets"])  # long[B, L]: caption id of each token, -1: none

``caption_ids`` feeds the copy head (``article_ids`` in a Transform and Tell batch): copying
article token i emits caption id ``ids[b, i]``. Article and caption tokenizers differ (MiniLM:
uncased WordPiece; captions: RoBERTa's cased byte-level BPE), so the ids are found by character
offsets, never by vocabulary look-up: each article word is re-tokenized with the caption
tokenizer (as " word", the form it takes inside a caption) and article token i gets the caption
piece that starts at the same character of the ORIGINAL text (so case and accents come from the
article, not from the uncased WordPiece). A WordPiece continuation ("##ama") gets the piece
starting where it starts, if any, else -1; special tokens get -1. With RoBERTa as the article
encoder the ids equal the article's own ids for every word preceded by a space.

Inputs longer than ``max_tokens`` (specials included, at most the model's position limit) are
truncated; use :mod:`tellkit.encoders.context` to choose which paragraphs fill that budget.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from tellkit.encoders import weights as W
from tellkit.encoders.static_vectors import is_static_spec, load_article_vectors
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.errors import TellkitError

DEFAULT_MAX_TOKENS = 512


class ArticleEncoder(nn.Module):
    """A frozen Hugging Face encoder returning every hidden state; see the module docstring."""

    def __init__(self, name_or_path: str | os.PathLike | None = None,
                 caption_tokenizer: CaptionTokenizer | None = None):
        super().__init__()
        self.name = str(name_or_path) if name_or_path is not None else "all-MiniLM-L6-v2 (packaged)"
        path = str(name_or_path) if name_or_path is not None else str(W.minilm_dir())
        self.tokenizer, self.model = W.load_hf_encoder(path)
        cfg = self.model.config
        self.num_layers: int = cfg.num_hidden_layers + 1  # embedding output + each layer
        self.dim: int = cfg.hidden_size
        # RoBERTa's positions start at padding_idx + 1: 514 positions hold 512 tokens.
        roberta_like = getattr(cfg, "model_type", "") in ("roberta", "xlm-roberta", "camembert")
        offset = (cfg.pad_token_id + 1) if roberta_like else 0
        limits = [DEFAULT_MAX_TOKENS, getattr(cfg, "max_position_embeddings", 10**9) - offset]
        if 0 < getattr(self.tokenizer, "model_max_length", 0) < 10**6:
            limits.append(self.tokenizer.model_max_length)
        self.max_tokens: int = min(limits)
        self.num_special: int = self.tokenizer.num_special_tokens_to_add(pair=False)
        self._caption_tokenizer = caption_tokenizer
        # False (frozen): dropout always off; True: train() is obeyed, so a training step applies
        # the encoder's dropout (the Transform and Tell reference's mode; gradients stay off)
        self.follows_train_mode = False
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> ArticleEncoder:
        return super().train(mode and self.follows_train_mode)

    @property
    def caption_tokenizer(self) -> CaptionTokenizer:
        if self._caption_tokenizer is None:
            self._caption_tokenizer = CaptionTokenizer.load()
        return self._caption_tokenizer

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` without specials (the budget unit of the context builder)."""
        return len(self.tokenizer(text, add_special_tokens=False, truncation=False)["input_ids"])

    def _tokenize(self, texts: Sequence[str], max_tokens: int):
        return self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_tokens,
                              return_offsets_mapping=True, return_tensors="pt")

    @torch.no_grad()
    def encode(self, texts: Sequence[str], max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
        """Texts -> dict(hidden float[B, num_layers, L, dim], mask bool[B, L], tokens, offsets,
        input_ids long[B, L]). See the module docstring."""
        texts = list(texts)
        if not texts:
            raise TellkitError("article encoder: no texts to encode")
        batch = self._tokenize(texts, min(max_tokens, self.max_tokens))
        offsets = batch.pop("offset_mapping")
        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) for k, v in batch.items()}
        out = self.model(**inputs, output_hidden_states=True, return_dict=True)
        hidden = torch.stack(out.hidden_states, dim=1)  # [B, num_layers, L, dim]
        mask = batch["attention_mask"].bool()
        lengths = mask.sum(1).tolist()
        ids = batch["input_ids"]
        return {
            "hidden": hidden,
            "mask": mask.to(device),
            "input_ids": ids,
            "tokens": [self.tokenizer.convert_ids_to_tokens(ids[b, :n].tolist()) for b, n in enumerate(lengths)],
            "offsets": [[tuple(map(int, o)) for o in offsets[b, :n].tolist()] for b, n in enumerate(lengths)],
        }

    def caption_ids(self, texts: Sequence[str], offsets: Sequence[Sequence[tuple[int, int]]] | None = None,
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> torch.Tensor:
        """long[B, L]: the caption-vocabulary id of each article token, -1 where none (padding,
        special tokens, WordPiece continuations that start inside a caption piece). ``offsets``
        from :meth:`encode`; computed (tokenizer only) when omitted."""
        texts = list(texts)
        if offsets is None:
            enc = self._tokenize(texts, min(max_tokens, self.max_tokens))
            lengths = enc["attention_mask"].sum(1).tolist()
            offsets = [[tuple(o) for o in enc["offset_mapping"][b, :n].tolist()] for b, n in enumerate(lengths)]
        return self.caption_tokenizer.ids_for_spans(texts, offsets)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, num_layers={self.num_layers}, dim={self.dim}, max_tokens={self.max_tokens}"


PACKAGED_NAMES = (None, "minilm", "all-MiniLM-L6-v2")


def build_article_encoder(spec: str | os.PathLike | None = None):
    """The article encoder a recipe's ``encoders.article`` names, with one interface
    (``encode``, ``caption_ids``, ``count_tokens``, ``num_layers``, ``dim``, ``max_tokens``,
    ``num_special``):

    - ``None`` / ``minilm`` / ``all-MiniLM-L6-v2``: the packaged all-MiniLM-L6-v2 (every layer);
    - ``static``, ``static:NAME_OR_FOLDER``, ``glove:PATH``: a static word-vector table
      (:mod:`tellkit.encoders.static_vectors`, the "+ GloVe" rows of the ablation);
    - anything else: a Hugging Face encoder by hub name or local folder.
    """

    if is_static_spec(spec):
        return load_article_vectors(str(spec))
    return ArticleEncoder(None if spec in PACKAGED_NAMES else spec)
