r"""Green-Wood/BTTR Lightning checkpoints (``*.ckpt``) <-> tellkit BTTR.

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

CoMER (Green-Wood/CoMER, BTTR plus coverage) is recognised by its Attention Refinement Module
(``decoder.model.arm.*``) or its decoder input LayerNorm (``decoder.norm``), under
``comer_model.``, and converts to the ``comer`` family (the returned config names it). Its
encoder projection is a bare conv (``encoder.feature_proj.weight``); the rest is named as in
BTTR, plus::

    comer_model.decoder.norm                             LayerNorm after embedding + positions
    comer_model.decoder.model.arm.conv / proj            5x5 conv (bias), 1x1 conv (no bias)
    comer_model.decoder.model.arm.post_norm.bn           BatchNorm over real pixels

The ARM's input channels give the coverage kinds: 2 x nhead is both (the paper's); nhead alone
is one of them, named by ``-o cross_coverage=true`` or ``-o self_coverage=true``.

Sizes (growth rate, depth, d_model, heads, layers) are read from the tensor shapes. Attention
heads cannot be seen in shapes: ``nhead`` (default 8, the paper's) is an option.

The vocabulary: the reference numbers ``<pad> <sos> <eos>`` 0..2 and then the lines of its
``dictionary.txt``. tellkit's order is the same three followed by the 110 CROHME symbols sorted
(the reference's file lists them sorted too). Give ``dictionary=PATH`` to map the rows by
symbol whatever the file's order; a symbol on one side only is an error unless
``allow_vocab_mismatch=true``, which drops the reference's extra symbols and gives tellkit's
missing ones an output bias of -10000 (never predicted). CoMER's dictionary is BTTR's with
``\Pi`` in place of ``'`` (:data:`COMER_SYMBOLS`, used unless ``dictionary=`` is given): that one
difference is always accepted (``\Pi`` is dropped, ``'`` never predicted).

:func:`to_reference` goes the other way (``tellkit export DIR --format reference --out X.ckpt``),
through the same name table, so the two directions cannot drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tellkit.data.latex import Vocab
from tellkit.errors import TellkitError

FAMILY = "bttr"
_PREFIXES = ("bttr.", "model.bttr.", "comer_model.", "")


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for pre in _PREFIXES:
        if f"{pre}encoder.model.conv1.weight" in state:
            return {k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}
    return {}


def matches(state: dict[str, torch.Tensor]) -> bool:
    s = _strip(state)
    return "decoder.proj.weight" in s and any(k.startswith("decoder.model.layers.") for k in s)


def is_comer(s: dict[str, torch.Tensor]) -> bool:
    """A (prefix-stripped) CoMER state: an ARM, or at least the decoder's input LayerNorm."""
    return "decoder.norm.weight" in s or "decoder.model.arm.conv.weight" in s


def _comer_symbols() -> list[str]:
    return sorted((set(Vocab().itos[3:]) - {"'"}) | {"\\Pi"})


# the 110 symbols of Green-Wood/CoMER's dictionary.txt, in its (sorted) order
COMER_SYMBOLS = _comer_symbols()
COMER_DIFFERENCE = ({"'"}, {"\\Pi"})  # (tellkit only, CoMER only): always accepted


def _count(s: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in s for m in [rx.match(k)] if m})


_BN = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_ATTENTION = (("self_attn", "self_attn"), ("multihead_attn", "cross_attn"))  # reference, tellkit


def _name_pairs(config: dict, comer: bool = False) -> list[tuple[str, str]]:
    """(reference name, tellkit name) of every tensor except the attention input projections
    (stacked q|k|v in the reference, three linears in tellkit). Used in both directions.
    ``comer``: CoMER's names (bare projection conv, input LayerNorm, ARM)."""
    pairs: list[tuple[str, str]] = []

    def bn(ref: str, own: str) -> None:
        pairs.extend((f"{ref}.{n}", f"{own}.{n}") for n in _BN)

    enc = "encoder.densenet"
    pairs.append(("encoder.model.conv1.weight", f"{enc}.stem.weight"))
    bn("encoder.model.norm1", f"{enc}.stem_bn")
    blocks, depth = config["num_blocks"], config["block_depth"]
    for b in range(blocks):
        for i in range(depth):
            ref, own = f"encoder.model.dense{b + 1}.{i}", f"{enc}.blocks.{b}.{i}"
            pairs += [(f"{ref}.conv1.weight", f"{own}.conv1.weight"), (f"{ref}.conv2.weight", f"{own}.conv2.weight")]
            bn(f"{ref}.bn1", f"{own}.bn1")
            bn(f"{ref}.bn2", f"{own}.bn2")
        if b < blocks - 1:
            pairs.append((f"encoder.model.trans{b + 1}.conv1.weight", f"{enc}.transitions.{b}.conv.weight"))
            bn(f"encoder.model.trans{b + 1}.bn1", f"{enc}.transitions.{b}.bn")
    bn("encoder.model.post_norm", f"{enc}.post_bn")
    proj = "encoder.feature_proj" if comer else "encoder.feature_proj.0"
    for n in ("weight", "bias"):
        pairs += [(f"{proj}.{n}", f"encoder.proj.{n}"), (f"encoder.norm.{n}", f"encoder.norm.{n}"),
                  (f"decoder.word_embed.1.{n}", f"decoder.embed_norm.{n}"), (f"decoder.proj.{n}", f"decoder.out.{n}")]
    pairs.append(("decoder.word_embed.0.weight", "decoder.embed.weight"))
    for i in range(config["num_decoder_layers"]):
        ref, own = f"decoder.model.layers.{i}", f"decoder.layers.{i}"
        for n in ("weight", "bias"):
            for r, o in _ATTENTION:
                pairs.append((f"{ref}.{r}.out_proj.{n}", f"{own}.{o}.out_proj.{n}"))
            pairs += [(f"{ref}.linear1.{n}", f"{own}.ff.0.{n}"), (f"{ref}.linear2.{n}", f"{own}.ff.3.{n}")]
            pairs += [(f"{ref}.norm{k}.{n}", f"{own}.norm{k}.{n}") for k in (1, 2, 3)]
    if comer:
        pairs += [(f"decoder.norm.{n}", f"decoder.input_norm.{n}") for n in ("weight", "bias")]
        if config["cross_coverage"] or config["self_coverage"]:
            pairs += [("decoder.model.arm.conv.weight", "decoder.arm.conv.weight"),
                      ("decoder.model.arm.conv.bias", "decoder.arm.conv.bias"),
                      ("decoder.model.arm.proj.weight", "decoder.arm.proj.weight")]
            bn("decoder.model.arm.post_norm.bn", "decoder.arm.norm")
    return pairs


def convert(state: dict[str, torch.Tensor], nhead: int = 8, dictionary: str | None = None,
            allow_vocab_mismatch: bool = False, dropout: float = 0.3, encoder_dropout: float = 0.2,
            beam_size: int = 10, max_len: int = 200, alpha: float = 1.0, cross_coverage: bool | None = None,
            self_coverage: bool | None = None):
    s = _strip(state)
    if not s:
        raise TellkitError("not a BTTR checkpoint (no encoder.model.conv1.weight)")
    comer = is_comer(s)
    if not comer and (cross_coverage is not None or self_coverage is not None):
        raise TellkitError("cross_coverage / self_coverage: this is a BTTR checkpoint (no CoMER coverage module)")
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
                  beam_size=int(beam_size), max_len=int(max_len), alpha=float(alpha))
    if comer:
        config.update(name="comer", **_comer_coverage(s, int(nhead), cross_coverage, self_coverage))

    out: dict[str, torch.Tensor] = {}
    for ref, own in _name_pairs(config, comer):
        if ref in s:
            out[own] = s[ref]
        elif not ref.endswith(".num_batches_tracked"):
            raise TellkitError(f"not a complete {'CoMER' if comer else 'BTTR'} checkpoint: {ref} is missing")
    for i in range(layers):
        for ref, own in _ATTENTION:
            src, dst = f"decoder.model.layers.{i}.{ref}", f"decoder.layers.{i}.{own}"
            for kind in ("weight", "bias"):
                for j, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{dst}.{part}.{kind}"] = s[f"{src}.in_proj_{kind}"][j * d_model:(j + 1) * d_model]

    tolerated = COMER_DIFFERENCE if comer else (set(), set())
    if dictionary is not None:
        _remap_vocab(out, config, _read_dictionary(Path(dictionary)), str(dictionary), bool(allow_vocab_mismatch),
                     tolerated)
    elif comer:
        _remap_vocab(out, config, COMER_SYMBOLS, "CoMER's dictionary", bool(allow_vocab_mismatch), tolerated)
    elif config["vocab_size"] != 113:
        raise TellkitError(f"the checkpoint has {config['vocab_size']} output symbols, tellkit's vocabulary 113; "
                           "pass dictionary=PATH (the reference's dictionary.txt)")
    return config, {k: v.detach().clone().contiguous() for k, v in out.items()}


def _comer_coverage(s: dict, nhead: int, cross: bool | None, self_: bool | None) -> dict[str, Any]:
    """CoMER's ARM sizes and coverage kinds, from its conv's shape and the options."""
    if "decoder.model.arm.conv.weight" not in s:
        if cross or self_:
            raise TellkitError("this CoMER checkpoint has no coverage module (decoder.model.arm)")
        return {"dc": 32, "cross_coverage": False, "self_coverage": False}
    conv = s["decoder.model.arm.conv.weight"]
    dc, cin = int(conv.shape[0]), int(conv.shape[1])
    if cin == 2 * nhead:
        if cross is False or self_ is False:
            raise TellkitError(f"the coverage module reads {cin} = 2 x nhead channels: both coverages are on")
        return {"dc": dc, "cross_coverage": True, "self_coverage": True}
    if cin != nhead:
        raise TellkitError(f"the coverage module reads {cin} channels: neither nhead={nhead} nor twice it "
                           "(-o nhead=N)")
    if bool(cross) == bool(self_):
        raise TellkitError(f"the coverage module reads nhead={nhead} channels: one kind of coverage; say which "
                           "with -o cross_coverage=true or -o self_coverage=true")
    return {"dc": dc, "cross_coverage": bool(cross), "self_coverage": bool(self_)}


def _read_dictionary(path: Path) -> list[str]:
    if not path.is_file():
        raise TellkitError(f"dictionary file not found: {path}")
    return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def _remap_vocab(out: dict, config: dict, symbols: list[str], where_from: str, allow: bool,
                 tolerated: tuple[set, set] = (set(), set())) -> None:
    """Reorder the embedding / output rows from the reference dictionary's order to tellkit's.
    ``tolerated``: (tellkit-only, reference-only) symbols accepted without ``allow``."""
    theirs = ["<pad>", "<sos>", "<eos>"] + symbols
    if len(theirs) != config["vocab_size"]:
        raise TellkitError(f"{where_from}: {len(symbols)} symbols + 3 specials = {len(theirs)}, but the checkpoint "
                           f"has {config['vocab_size']} output rows")
    vocab = Vocab()
    where = {t: i for i, t in enumerate(theirs)}
    missing = [t for t in vocab.itos if t not in where and t not in tolerated[0]]
    extra = [t for t in theirs if t not in vocab.stoi and t not in tolerated[1]]
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


# --- the other way: a tellkit BTTR as a reference Lightning checkpoint ---------------------------
# LitBTTR's constructor arguments that are not model sizes: the reference's defaults.
REFERENCE_TRAINING_HPARAMS = {"learning_rate": 1.0, "patience": 20}


def to_reference(config: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A tellkit BTTR (config fields, state dict) -> the reference's Lightning checkpoint dict:
    ``state_dict`` under ``bttr.`` with the reference's names and stacked q|k|v projections,
    ``hyper_parameters`` as ``LitBTTR``'s constructor takes them. Only what the reference can
    build is accepted (its DenseNet has 3 blocks, a 2k-channel stem, compression 0.5, grey input)."""
    fixed = {"in_channels": 1, "num_blocks": 3, "stem_channels": 2 * config["growth_rate"], "compression": 0.5,
             "vocab_size": 113}
    differ = {k: config[k] for k, v in fixed.items() if config[k] != v}
    if differ:
        raise TellkitError(f"the reference BTTR cannot hold {differ} (it builds {fixed})")
    out = {}
    for ref, own in _name_pairs(config):
        if own in state:
            out[f"bttr.{ref}"] = state[own]
        elif not own.endswith(".num_batches_tracked"):
            raise TellkitError(f"not a complete tellkit BTTR: {own} is missing")
    for i in range(config["num_decoder_layers"]):
        for ref, own in _ATTENTION:
            src, dst = f"decoder.layers.{i}.{own}", f"bttr.decoder.model.layers.{i}.{ref}"
            for kind in ("weight", "bias"):
                qkv = [state[f"{src}.{part}.{kind}"] for part in ("q_proj", "k_proj", "v_proj")]
                out[f"{dst}.in_proj_{kind}"] = torch.cat(qkv)
    hparams = {"d_model": config["d_model"], "growth_rate": config["growth_rate"],
               "num_layers": config["block_depth"], "nhead": config["nhead"],
               "num_decoder_layers": config["num_decoder_layers"], "dim_feedforward": config["dim_feedforward"],
               "dropout": config["dropout"], "beam_size": config["beam_size"], "max_len": config["max_len"],
               "alpha": config["alpha"], **REFERENCE_TRAINING_HPARAMS}
    return {"epoch": 0, "global_step": 0, "pytorch-lightning_version": "1.2.0",
            "state_dict": {k: v.detach().float().contiguous().clone() for k, v in out.items()},
            "hyper_parameters": hparams}
