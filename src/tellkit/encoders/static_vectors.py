"""Static (non-contextual) word vectors for the "+ GloVe" rows of Transform and Tell's ablation
(Tran et al. 2020, Table 4): each article word gets one fixed vector from a fixed vocabulary,
whatever its context; words outside the vocabulary are DROPPED (the reference lower-cases the
article and keeps only tokens that have a vector, through spaCy's en_core_web_lg GloVe table).

    vecs = StaticVectors.from_glove("glove.840B.300d.txt")   # a user's GloVe text file
    vecs = StaticVectors.from_text_encoder()                 # offline: MiniLM's input embeddings
    out = vecs.encode(["article text", ...], max_tokens=512)
    out["hidden"]  float[B, 1, L, dim]   (one "layer": the captioner reads it as article_layers=1)
    out["mask"]    bool[B, L]            (True = a real word)
    out["tokens"], out["offsets"]        the kept words and their character spans in the text

The output has the keys and shapes of :class:`tellkit.encoders.text.ArticleEncoder.encode`
(``num_layers``, ``dim``, ``max_tokens``, ``num_special``, ``count_tokens``, ``caption_ids``
too), so a captioning pipeline can take either; :func:`load_article_vectors` builds one from a
recipe string.

The offline table: no GloVe file ships in any installable package, so the default is the input
(word-piece) embedding matrix of the packaged text encoder (all-MiniLM-L6-v2, 384-d, uncased):
a word is in the vocabulary when the encoder's tokenizer maps it to exactly ONE token; its
vector is that token's row. Like GloVe it is a fixed, context-free table of a fixed vocabulary
(~23.7K whole words for MiniLM); unlike GloVe it was trained inside a transformer, not from
co-occurrence counts.

Words are ``\\w+`` runs (with inner hyphens / apostrophes) and single punctuation marks, close
to spaCy's tokenization for running text.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from tellkit.encoders import weights as W
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.errors import TellkitError

_WORD = re.compile(r"\w+(?:[-'\u2019]\w+)*|[^\w\s]")
DEFAULT_MAX_TOKENS = 512


def split_words(text: str) -> list[tuple[str, int, int]]:
    """(word, start, end) for every word / punctuation mark of ``text``."""
    return [(m.group(), m.start(), m.end()) for m in _WORD.finditer(text)]


class StaticVectors:
    """A word -> vector table; see the module docstring."""

    num_layers = 1
    num_special = 0

    def __init__(self, words: Sequence[str], vectors: torch.Tensor, *, lowercase: bool = True, name: str = "static",
                 max_tokens: int = DEFAULT_MAX_TOKENS):
        if vectors.dim() != 2 or vectors.size(0) != len(words):
            raise TellkitError(f"static vectors: {len(words)} words but a table of shape {tuple(vectors.shape)}")
        if len(words) == 0:
            raise TellkitError("static vectors: the table is empty")
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.vectors = vectors.float()
        self.lowercase = lowercase
        self.name = name
        self.dim: int = int(vectors.size(1))
        self.max_tokens = max_tokens
        self._caption_tokenizer = None

    def __len__(self) -> int:
        return len(self.words)

    def __repr__(self) -> str:
        return f"StaticVectors(name={self.name!r}, words={len(self)}, dim={self.dim}, lowercase={self.lowercase})"

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_glove(cls, path: str | os.PathLike, *, vocabulary: Iterable[str] | None = None,
                   max_words: int | None = None, lowercase: bool = True) -> StaticVectors:
        """Read a GloVe text file (``word v_1 ... v_d`` per line; a word2vec ``count dim`` header
        line is skipped). ``vocabulary``: keep only these words (saves memory on the 2.2M-word
        files); ``max_words``: keep the first N lines (GloVe files are sorted by frequency).
        With ``lowercase`` (the reference's choice) the first vector of each lower-cased word
        wins."""
        p = Path(path)
        if not p.is_file():
            raise TellkitError(f"GloVe file not found: {p}")
        keep = None if vocabulary is None else {w.lower() if lowercase else w for w in vocabulary}
        words: list[str] = []
        rows: list[list[float]] = []
        seen: set[str] = set()
        dim = None
        with open(p, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                parts = line.rstrip("\n").rstrip(" ").split(" ")
                if n == 1 and len(parts) == 2 and all(x.isdigit() for x in parts):
                    continue  # word2vec header
                if len(parts) < 2:
                    continue
                if dim is None:
                    dim = len(parts) - 1
                # a few GloVe 840B entries contain spaces in the word: the LAST dim fields are numbers
                word, vals = " ".join(parts[: len(parts) - dim]), parts[len(parts) - dim:]
                if len(parts) - dim < 1:
                    raise TellkitError(f"{p}:{n}: expected a word and {dim} numbers")
                w = word.lower() if lowercase else word
                if w in seen or (keep is not None and w not in keep):
                    continue
                try:
                    rows.append([float(x) for x in vals])
                except ValueError:
                    raise TellkitError(f"{p}:{n}: not a GloVe line (expected a word and {dim} numbers)") from None
                words.append(w)
                seen.add(w)
                if max_words is not None and len(words) >= max_words:
                    break
        if not words:
            raise TellkitError(f"{p}: no word vectors read")
        return cls(words, torch.tensor(rows), lowercase=lowercase, name=f"glove:{p.name}")

    @classmethod
    def from_text_encoder(cls, name_or_path: str | os.PathLike | None = None) -> StaticVectors:
        """The input embedding matrix of a Hugging Face text encoder as a static table (offline
        default: the packaged all-MiniLM-L6-v2). Vocabulary: every token that is a whole word
        (no WordPiece '##' continuation, no special token), as the tokenizer normalises it."""

        path = str(name_or_path) if name_or_path is not None else str(W.minilm_dir())
        table = _local_input_embeddings(path)
        if table is None:  # a hub name, or weights not in one safetensors file: load the model
            tokenizer, model = W.load_hf_encoder(path)
            table = model.get_input_embeddings().weight.detach().float()
        else:
            tokenizer = _load_tokenizer(path)
        specials = set(tokenizer.all_special_tokens)
        vocab = tokenizer.get_vocab()
        lowercase = bool(getattr(tokenizer, "do_lower_case", False)) or _normalizer_lowercases(tokenizer)
        words, ids = [], []
        for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
            bracketed = tok.startswith("[") and tok.endswith("]")
            if tok in specials or tok.startswith("##") or bracketed or i >= table.size(0):
                continue
            word = tok[1:] if tok.startswith("\u0120") else tok  # byte-level BPE: 'Ġword' is ' word'
            if not word or (tok.startswith("<") and tok.endswith(">")):
                continue
            if _WORD.fullmatch(word) is None:
                continue
            words.append(word)
            ids.append(i)
        # one row per word (BPE vocabularies hold 'word' and 'Ġword': keep the first)
        uniq: dict[str, int] = {}
        for w, i in zip(words, ids):
            uniq.setdefault(w, i)
        name = "static:" + ("all-MiniLM-L6-v2" if name_or_path is None else str(name_or_path))
        return cls(list(uniq), table[list(uniq.values())], lowercase=lowercase, name=name)

    # --- the ArticleEncoder interface ---------------------------------------------------------
    def to(self, device) -> StaticVectors:
        """Kept for the encoder interface: the table stays on the CPU (a look-up, no compute)."""
        return self

    def eval(self) -> StaticVectors:
        return self

    def lookup(self, text: str) -> list[tuple[int, int, int]]:
        """(row, start, end) of every word of ``text`` that has a vector; the others are dropped."""
        out = []
        for w, s, e in split_words(text):
            i = self.index.get(w.lower() if self.lowercase else w)
            if i is not None:
                out.append((i, s, e))
        return out

    def count_tokens(self, text: str) -> int:
        """Known words of ``text`` (the budget unit of the context builder)."""
        return len(self.lookup(text))

    def encode(self, texts: Sequence[str], max_tokens: int = DEFAULT_MAX_TOKENS) -> dict:
        """Texts -> dict(hidden float[B, 1, L, dim], mask bool[B, L], input_ids long[B, L] (table
        rows, 0 at padding), tokens, offsets). At most ``max_tokens`` known words per text."""
        texts = list(texts)
        if not texts:
            raise TellkitError("static vectors: no texts to encode")
        found = [self.lookup(t)[: max(0, min(max_tokens, self.max_tokens))] for t in texts]
        L = max(len(f) for f in found)
        ids = torch.zeros(len(texts), L, dtype=torch.long)
        mask = torch.zeros(len(texts), L, dtype=torch.bool)
        for b, f in enumerate(found):
            if f:
                ids[b, : len(f)] = torch.tensor([i for i, _, _ in f])
                mask[b, : len(f)] = True
        hidden = self.vectors[ids] * mask[..., None]
        return {
            "hidden": hidden[:, None],
            "mask": mask,
            "input_ids": ids,
            "tokens": [[self.words[i] for i, _, _ in f] for f in found],
            "offsets": [[(s, e) for _, s, e in f] for f in found],
        }

    @property
    def caption_tokenizer(self):
        if self._caption_tokenizer is None:

            self._caption_tokenizer = CaptionTokenizer.load()
        return self._caption_tokenizer

    def caption_ids(self, texts: Sequence[str], offsets: Sequence[Sequence[tuple[int, int]]] | None = None,
                    max_tokens: int = DEFAULT_MAX_TOKENS) -> torch.Tensor:
        """long[B, L]: the caption-vocabulary id of each kept word (for the copy head), -1 where
        none; found by character offsets (``CaptionTokenizer.ids_for_spans``), as
        :meth:`ArticleEncoder.caption_ids`."""
        texts = list(texts)
        if offsets is None:
            offsets = self.encode(texts, max_tokens)["offsets"]
        return self.caption_tokenizer.ids_for_spans(texts, offsets)


def _local_input_embeddings(path: str) -> torch.Tensor | None:
    """The word-embedding matrix straight from ``<folder>/model.safetensors`` (no model build)."""
    f = Path(path) / "model.safetensors"
    if not f.is_file():
        return None
    from safetensors import safe_open  # heavy

    with safe_open(str(f), framework="pt") as st:
        keys = [k for k in st.keys() if k.endswith(("word_embeddings.weight", "embed_tokens.weight", "shared.weight"))]
        return st.get_tensor(sorted(keys, key=len)[0]).float() if keys else None


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer  # heavy

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - file errors of many kinds end up here
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TellkitError(f"static vectors: cannot load the tokenizer of '{path}': {msg}") from None


def _normalizer_lowercases(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    norm = getattr(backend, "normalizer", None)
    return norm is not None and "lowercase=True" in repr(norm)


def load_article_vectors(spec: str) -> StaticVectors:
    """A static table from a recipe string: ``glove:PATH`` (a GloVe text file), ``static`` (the
    packaged text encoder's input embeddings) or ``static:NAME_OR_FOLDER`` (another HF
    encoder's input embeddings)."""
    spec = str(spec)
    if spec.startswith("glove:"):
        return StaticVectors.from_glove(spec[len("glove:"):])
    if spec == "static":
        return StaticVectors.from_text_encoder()
    if spec.startswith("static:"):
        return StaticVectors.from_text_encoder(spec[len("static:"):])
    raise TellkitError(f"static word vectors: expected 'glove:PATH', 'static' or 'static:NAME', got {spec!r}")


def is_static_spec(spec) -> bool:
    """True for the recipe strings :func:`load_article_vectors` accepts."""
    return isinstance(spec, str) and (spec == "static" or spec.startswith(("static:", "glove:")))
