"""Green-Wood/BTTR Lightning checkpoints (``*.ckpt``) -> tellkit BTTR.

The reference's ``LitBTTR`` keeps the model under ``bttr.`` with these parts::

    bttr.encoder.model.conv1 / norm1                    stem conv, BatchNorm
    bttr.encoder.model.dense{1,2,3}.<i>.conv1/bn1/conv2/bn2   bottleneck layers
    bttr.encoder.model.trans{1,2}.conv1/bn1              transitions
    bttr.encoder.model.post_norm                         BatchNorm after the last block
    bttr.encoder.feature_proj.0, bttr.encoder.norm       1x1 conv to d_model, LayerNorm
    bttr.decoder.word_embed.0 / .1                       Embedding, LayerNorm
    bttr.decoder.model.layers.<i>.self_attn / multihead_attn   in_proj (q|k|v stacked) + out_proj
    bttr.decoder.model.layers.<i>.linear1 / linear2 / norm1..3
    bttr.decoder.proj                                    output projection

Sizes (growth rate, depth, d_model, heads, layers) are read from the tensor shapes. Attention
heads cannot be seen in shapes: ``nhead`` (default 8, the paper's) is an option.

The vocabulary: the reference numbers ``<pad> <sos> <eos>`` 0..2 and then the lines of its
``dictionary.txt``. tellkit's order is the same three followed by the 110 CROHME symbols sorted
(the reference's file lists them sorted too). Give ``dictionary=PATH`` to map the rows by
symbol whatever the file's order; a symbol on one side only is an error unless
``allow_vocab_mismatch=true``, which drops the reference's extra symbols and gives tellkit's
missing ones an output bias of -10000 (never predicted).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from tellkit.errors import TellkitError

FAMILY = "bttr"
_PREFIXES = ("bttr.", "model.bttr.", "")


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for pre in _PREFIXES:
        if f"{pre}encoder.model.conv1.weight" in state:
            return {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}
    return {}


def matches(state: dict[str, torch.Tensor]) -> bool:
    s = _strip(state)
    return "decoder.proj.weight" in s and any(k.startswith("decoder.model.layers.") for k in s)


def _count(s: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in s for m in [rx.match(k)] if m})


def convert(state: dict[str, torch.Tensor], nhead: int = 8, dictionary: str | None = None,
            allow_vocab_mismatch: bool = False, dropout: float = 0.3, encoder_dropout: float = 0.2,
            beam_size: int = 10, max_len: int = 200, alpha: float = 1.0):
    s = _strip(state)
    if not s:
        raise TellkitError("not a BTTR checkpoint (no encoder.model.conv1.weight)")
    if "decoder.word_embed.1.weight" not in s:
        raise TellkitError("this BTTR checkpoint has no LayerNorm after the word embedding (an early "
                           "version of the reference); tellkit's BTTR cannot hold it exactly")
    stem = s["encoder.model.conv1.weight"]
    growth = s["encoder.model.dense1.0.conv2.weight"].shape[0]
    depth = _count(s, r"encoder\.model\.dense1\.(\d+)\.conv1\.weight")
    blocks = _count(s, r"encoder\.model\.dense(\d+)\.0\.conv1\.weight")
    d_model = s["encoder.norm.weight"].shape[0]
    layers = _count(s, r"decoder\.model\.layers\.(\d+)\.linear1\.weight")
    ffn = s["decoder.model.layers.0.linear1.weight"].shape[0]
    cin1 = s["encoder.model.trans1.conv1.weight"].shape[1] if blocks > 1 else None
    cout1 = s["encoder.model.trans1.conv1.weight"].shape[0] if blocks > 1 else None
    compression = (cout1 / cin1) if cin1 else 0.5
    if d_model % nhead:
        raise TellkitError(f"nhead={nhead} does not divide d_model={d_model}")
    config = dict(vocab_size=int(s["decoder.proj.weight"].shape[0]), in_channels=int(stem.shape[1]),
                  growth_rate=int(growth), num_blocks=int(blocks), block_depth=int(depth),
                  stem_channels=int(stem.shape[0]), compression=round(float(compression), 4),
                  encoder_dropout=float(encoder_dropout), d_model=int(d_model), nhead=int(nhead),
                  num_decoder_layers=int(layers), dim_feedforward=int(ffn), dropout=float(dropout),
                  beam_size=int(beam_size), max_len=int(max_len), alpha=float(alpha), variant="reference")

    out: dict[str, torch.Tensor] = {}

    def bn(src: str, dst: str) -> None:
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            if f"{src}.{name}" in s:
                out[f"{dst}.{name}"] = s[f"{src}.{name}"]

    enc = "encoder.densenet"
    out[f"{enc}.stem.weight"] = stem
    bn("encoder.model.norm1", f"{enc}.stem_bn")
    for b in range(blocks):
        for i in range(depth):
            src, dst = f"encoder.model.dense{b + 1}.{i}", f"{enc}.blocks.{b}.{i}"
            out[f"{dst}.conv1.weight"] = s[f"{src}.conv1.weight"]
            out[f"{dst}.conv2.weight"] = s[f"{src}.conv2.weight"]
            bn(f"{src}.bn1", f"{dst}.bn1")
            bn(f"{src}.bn2", f"{dst}.bn2")
        if b < blocks - 1:
            out[f"{enc}.transitions.{b}.conv.weight"] = s[f"encoder.model.trans{b + 1}.conv1.weight"]
            bn(f"encoder.model.trans{b + 1}.bn1", f"{enc}.transitions.{b}.bn")
    bn("encoder.model.post_norm", f"{enc}.post_bn")
    out["encoder.proj.weight"] = s["encoder.feature_proj.0.weight"]
    out["encoder.proj.bias"] = s["encoder.feature_proj.0.bias"]
    out["encoder.norm.weight"], out["encoder.norm.bias"] = s["encoder.norm.weight"], s["encoder.norm.bias"]

    out["decoder.embed.weight"] = s["decoder.word_embed.0.weight"]
    out["decoder.embed_norm.weight"] = s["decoder.word_embed.1.weight"]
    out["decoder.embed_norm.bias"] = s["decoder.word_embed.1.bias"]
    for i in range(layers):
        src, dst = f"decoder.model.layers.{i}", f"decoder.layers.{i}"
        for ref_name, own in (("self_attn", "self_attn"), ("multihead_attn", "cross_attn")):
            w = s[f"{src}.{ref_name}.in_proj_weight"]
            bias = s[f"{src}.{ref_name}.in_proj_bias"]
            for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{dst}.{own}.{part}.weight"] = w[j * d_model:(j + 1) * d_model]
                out[f"{dst}.{own}.{part}.bias"] = bias[j * d_model:(j + 1) * d_model]
            out[f"{dst}.{own}.out_proj.weight"] = s[f"{src}.{ref_name}.out_proj.weight"]
            out[f"{dst}.{own}.out_proj.bias"] = s[f"{src}.{ref_name}.out_proj.bias"]
        out[f"{dst}.ff.0.weight"], out[f"{dst}.ff.0.bias"] = s[f"{src}.linear1.weight"], s[f"{src}.linear1.bias"]
        out[f"{dst}.ff.3.weight"], out[f"{dst}.ff.3.bias"] = s[f"{src}.linear2.weight"], s[f"{src}.linear2.bias"]
        for n in (1, 2, 3):
            out[f"{dst}.norm{n}.weight"] = s[f"{src}.norm{n}.weight"]
            out[f"{dst}.norm{n}.bias"] = s[f"{src}.norm{n}.bias"]
    out["decoder.out.weight"] = s["decoder.proj.weight"]
    out["decoder.out.bias"] = s["decoder.proj.bias"]

    if dictionary is not None:
        _remap_vocab(out, config, Path(dictionary), bool(allow_vocab_mismatch))
    elif config["vocab_size"] != 113:
        raise TellkitError(f"the checkpoint has {config['vocab_size']} output symbols, tellkit's vocabulary 113; "
                           "pass dictionary=PATH (the reference's dictionary.txt)")
    return config, {k: v.detach().clone().contiguous() for k, v in out.items()}


def _remap_vocab(out: dict, config: dict, path: Path, allow: bool) -> None:
    """Reorder the embedding / output rows from the reference dictionary's order to tellkit's."""
    from tellkit.data.latex import Vocab

    if not path.is_file():
        raise TellkitError(f"dictionary file not found: {path}")
    symbols = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    theirs = ["<pad>", "<sos>", "<eos>"] + symbols
    if len(theirs) != config["vocab_size"]:
        raise TellkitError(f"{path}: {len(symbols)} symbols + 3 specials = {len(theirs)}, but the checkpoint "
                           f"has {config['vocab_size']} output rows")
    vocab = Vocab()
    where = {t: i for i, t in enumerate(theirs)}
    missing = [t for t in vocab.itos if t not in where]
    extra = [t for t in theirs if t not in vocab.stoi]
    if (missing or extra) and not allow:
        raise TellkitError(f"vocabularies differ: tellkit has {missing} that the checkpoint lacks, the checkpoint "
                           f"has {extra} that tellkit lacks (allow_vocab_mismatch=true to convert anyway)")
    for key, is_bias in (("decoder.embed.weight", False), ("decoder.out.weight", False), ("decoder.out.bias", True)):
        src = out[key]
        new = torch.zeros((len(vocab),) + tuple(src.shape[1:]), dtype=src.dtype)
        for i, tok in enumerate(vocab.itos):
            if tok in where:
                new[i] = src[where[tok]]
            elif is_bias:
                new[i] = -1e4  # a symbol the reference never learned: never predicted
        out[key] = new
    config["vocab_size"] = len(vocab)
