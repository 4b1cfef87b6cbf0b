"""Import the official Transform and Tell checkpoint (alasdairtran/transform-and-tell, the
AllenNLP ``best.th`` state dict) into tellkit's ``transform_and_tell`` model.

The reference names (AllenNLP model -> ``decoder`` -> fairseq-style modules) map onto tellkit's:

    decoder.embedder.token_embedder_adaptive.embeddings.{b}.0 / .1   embed.embeddings.{b} / embed.projections.{b}
    decoder.adaptive_softmax.head.class_proj, .tail.{t}.0             softmax.class_proj, softmax.tail_proj.{t}
    decoder.adaptive_softmax.head.word_proj, .tail.{t}.2              tied to the embeddings (checked, dropped)
    decoder.layers.{i}.linear1 / linear2 (weight_g, weight_v, bias)   layers.{i}.conv.linear1 / linear2
    decoder.layers.{i}.conv.weight_linear                             layers.{i}.conv.conv.weight_linear
    decoder.layers.{i}.conv_layer_norm                                layers.{i}.conv_norm
    decoder.layers.{i}.context_attns.{image,article,faces,obj}        layers.{i}.context_attn.{image,...,objects}
        q/k/v_proj_weight, or in_proj_weight [3d, d] when keys are d-wide (the article), in_proj_bias [3d]
    decoder.layers.{i}.context_attn_lns.{...}                         layers.{i}.context_norm.{...}
    decoder.layers.{i}.context_fc / fc1 / fc2 / final_layer_norm      layers.{i}.context_proj / fc1 / fc2 / final_norm
    bert_weight                                                       article_mix.weights

The ResNet stored alongside (``resnet.*``: its weights and the BatchNorm running statistics that
the reference's training updated) is carried into the converted model's image encoder:
:func:`encoder_files` gives it as ``image_encoder.safetensors``, written beside the model, and
the checkpoint's ``encoders`` section names it, so the converted model reads the image features
the reference evaluated with. RoBERTa (``roberta.*``, frozen, no BatchNorm) and buffers (sinusoid
tables, ``_float_tensor``, ``version``) are not part of the tellkit model and are left out. The model is
configured as the reference ran it: weight-normalised linears, positions from 2, per-band
embedding padding. A linear stored without weight normalisation (a plain ``weight``) is split
into g = row norms and v = weight, which gives the same layer.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from tellkit.checkpoint import IMAGE_ENCODER_FILE
from tellkit.config import load_yaml, resolve_config_path
from tellkit.encoders.resnet import BLOCKS
from tellkit.errors import TellkitError

FAMILY = "transform_and_tell"

_EMB = "decoder.embedder.token_embedder_adaptive.embeddings"
_SM = "decoder.adaptive_softmax"
# reference context name -> tellkit context name, in the reference's concatenation order
_CONTEXTS = {"image": "image", "article": "article", "faces": "faces", "obj": "objects"}
_SKIP = re.compile(r"^(resnet|roberta)\.|(^|\.)(_float_tensor|version|weights)$")




def encoder_files(state: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """-> (the converted checkpoint's ``encoders`` section, {file name: tensors} to write beside
    the model): the checkpoint's ResNet (weights and BatchNorm running statistics, in tellkit's
    ResNet layout, which is torchvision's). Empty when the checkpoint holds no ResNet."""
    resnet = {k[len("resnet."):]: v for k, v in state.items() if k.startswith("resnet.")}
    if not resnet:
        return {}, {}
    blocks = tuple(len({k.split(".")[1] for k in resnet if k.startswith(f"layer{i}.")}) for i in range(1, 5))
    name = next((n for n, b in BLOCKS.items() if b == blocks), None)
    if name is None:
        raise TellkitError(f"the checkpoint's resnet.* tensors have {blocks} blocks per stage, not a ResNet "
                           f"tellkit builds ({', '.join(BLOCKS)})")
    if "fc.weight" not in resnet:  # the reference's feature extractor keeps its (unused) classifier
        raise TellkitError("the checkpoint's resnet.* tensors have no fc layer; not the reference's ResNet")
    tensors = {k: v.detach().clone().contiguous() for k, v in resnet.items()}  # own storage each
    return {"image": name, "image_weights": IMAGE_ENCODER_FILE}, {IMAGE_ENCODER_FILE: tensors}


# the paper recipes a converted checkpoint may take its sections from (-o recipe=NAME)
RECIPES = ("tat/nytimes_faces", "tat/nytimes_full", "tat/goodnews")
# the reference's article encoders by width (the checkpoint records only the width and layer count)
ARTICLE_ENCODERS = {1024: "roberta-large", 768: "roberta-base"}


def _recipe_name(recipe: str, contexts: list[str]) -> str:
    if recipe and recipe not in RECIPES:
        raise TellkitError(f"-o recipe={recipe}: not a Transform and Tell paper recipe ({', '.join(RECIPES)})")
    return recipe or ("tat/nytimes_full" if "objects" in contexts else "tat/nytimes_faces")


def recipe_sections(config: dict[str, Any], carried: dict[str, Any], recipe: str = "", **_: Any) -> dict[str, Any]:
    """The sections a converted model runs with, those of the paper recipe it was trained with
    (``recipe``; by default ``tat/nytimes_full`` for a model that reads objects, else
    ``tat/nytimes_faces``): ``task``, ``encoders`` (the encoders as the reference ran them:
    RoBERTa by hub name, ResNet-152, MTCNN + FaceNet VGGFace2, YOLOv3 objects; ``carried``, the
    encoder files the checkpoint holds, win), ``data`` (the article context) and ``eval`` (greedy,
    100 steps); ``train`` too, for fine-tuning. ``model`` is the converted config itself."""
    name = _recipe_name(recipe, list(config.get("contexts", [])))
    sections = {k: v for k, v in load_yaml(resolve_config_path(name)).items() if k not in ("model", "base")}
    encoders = dict(sections.get("encoders") or {})
    article = ARTICLE_ENCODERS.get(int(config.get("article_dim", 0)))
    if article is not None:
        encoders["article"] = article
    else:  # not a RoBERTa width: the user names the encoder (encoders.article=...)
        encoders.pop("article", None)
    if "objects" in config.get("contexts", []):
        encoders.setdefault("objects", "yolov3_resnet152")  # YOLOv3 boxes through ResNet-152, as tat/nytimes_full
    sections["encoders"] = {**encoders, **carried}
    sections["converted_recipe"] = name
    return sections


def matches(state: dict[str, torch.Tensor]) -> bool:
    return f"{_EMB}.0.0.weight" in state and any(k.startswith("decoder.layers.0.context_attns.") for k in state)


def _take(state: dict[str, torch.Tensor], used: set[str], key: str) -> torch.Tensor:
    if key not in state:
        raise TellkitError(f"the checkpoint has no '{key}' (not the reference Transform and Tell layout?)")
    used.add(key)
    return state[key]


def _linear(state, used, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    """A GehringLinear: weight_g/weight_v (+ bias), or a plain weight that is re-parametrised."""
    if f"{src}.weight_v" in state:
        out[f"{dst}.weight_v"] = _take(state, used, f"{src}.weight_v")
        out[f"{dst}.weight_g"] = _take(state, used, f"{src}.weight_g").reshape(-1, 1)
    else:
        w = _take(state, used, f"{src}.weight")
        out[f"{dst}.weight_v"] = w
        out[f"{dst}.weight_g"] = w.norm(dim=1, keepdim=True)
    if f"{src}.bias" in state:
        out[f"{dst}.bias"] = _take(state, used, f"{src}.bias")


def _copy(state, used, src: str, dst: str, out: dict, names=("weight", "bias")) -> None:
    for n in names:
        if f"{src}.{n}" in state:
            out[f"{dst}.{n}"] = _take(state, used, f"{src}.{n}")


def convert(state: dict[str, torch.Tensor], num_heads: int = 16, recipe: str = "",
            **options: Any) -> tuple[dict, dict]:
    """-> (TransformAndTellConfig fields, tellkit state dict). ``num_heads``: attention / conv
    heads (not recorded in the weights; the reference used 16). ``recipe``: the paper recipe whose
    task, encoders, data and generation sections the converted folder records (see
    :func:`recipe_sections`)."""
    if options:
        raise TellkitError(f"unknown option(s) for the Transform and Tell converter: {', '.join(options)} "
                           "(known: num_heads, recipe)")
    _recipe_name(recipe, [])
    if not matches(state):
        raise TellkitError("not a Transform and Tell reference checkpoint (no adaptive embedder / context attention)")
    num_heads = int(num_heads)
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    adaptive = _adaptive(state, used, out)
    n_layers = 0
    while f"decoder.layers.{n_layers}.conv_layer_norm.weight" in state:
        n_layers += 1
    if n_layers == 0:
        raise TellkitError("the checkpoint has no decoder layers")
    contexts = [c for c in _CONTEXTS if f"decoder.layers.0.context_attns.{c}.out_proj.weight" in state]
    ctx_dims: dict[str, int] = {}
    kernel_sizes = [_layer(state, used, out, i, num_heads, contexts, ctx_dims) for i in range(n_layers)]
    article_layers = 1
    if "bert_weight" in state:
        out["article_mix.weights"] = _take(state, used, "bert_weight")
        article_layers = out["article_mix.weights"].numel()
    left = sorted(k for k in state if k not in used and not _SKIP.search(k))
    if left:
        raise TellkitError(f"{len(left)} tensor(s) of the checkpoint have no place in the tellkit model "
                           f"(e.g. {left[:4]}); not the configuration this converter knows")
    names = [_CONTEXTS[c] for c in contexts]
    attn0 = "layers.0.context_attn.{}.bias_k"
    config = {
        **adaptive, "num_layers": n_layers, "num_heads": num_heads, "ffn_dim": out["layers.0.fc1.weight_v"].shape[0],
        "kernel_sizes": kernel_sizes, "contexts": names, "article_layers": article_layers, "copy": False,
        "context_kv_bias": all(attn0.format(n) in out for n in names),
        "gehring_linear": True, "position_start": 2, "reference_embedding_padding": True,
    }
    for name, key in (("image", "image_dim"), ("article", "article_dim"), ("faces", "face_dim"),
                      ("objects", "object_dim")):
        if name in ctx_dims:
            config[key] = ctx_dims[name]
    return config, out


def _adaptive(state, used, out: dict) -> dict[str, Any]:
    """The adaptive input embedder and softmax (its tied copies checked); -> their config fields."""
    n_bands = 0
    while f"{_EMB}.{n_bands}.0.weight" in state:
        n_bands += 1
    band_sizes, band_dims = [], []
    for b in range(n_bands):
        emb = _take(state, used, f"{_EMB}.{b}.0.weight")
        proj = _take(state, used, f"{_EMB}.{b}.1.weight")
        out[f"embed.embeddings.{b}.weight"], out[f"embed.projections.{b}.weight"] = emb, proj
        band_sizes.append(emb.shape[0])
        band_dims.append(emb.shape[1])
    d = out["embed.projections.0.weight"].shape[0]
    cutoffs = [sum(band_sizes[: i + 1]) for i in range(n_bands - 1)]
    factor = 1.0 if n_bands == 1 else band_dims[0] / band_dims[1]
    if any(abs(band_dims[0] / factor**i - band_dims[i]) >= 1 for i in range(n_bands)):
        raise TellkitError(f"adaptive input band sizes {band_dims} do not follow one factor")
    out["softmax.class_proj.weight"] = _take(state, used, f"{_SM}.head.class_proj.weight")
    for t in range(n_bands - 1):
        out[f"softmax.tail_proj.{t}.weight"] = _take(state, used, f"{_SM}.tail.{t}.0.weight")
    # tied copies: must equal the embeddings they are tied to
    tied = [(f"{_SM}.head.word_proj.weight", 0)] + [(f"{_SM}.tail.{t}.2.weight", t + 1) for t in range(n_bands - 1)]
    for key, band in tied:
        if key in state:
            used.add(key)
            if not torch.equal(state[key], out[f"embed.embeddings.{band}.weight"]):
                raise TellkitError(f"{key} is not tied to adaptive input band {band}")
    return {"vocab_size": sum(band_sizes), "d_model": d, "adaptive_cutoffs": cutoffs, "adaptive_factor": factor}


def _layer(state, used, out: dict, i: int, num_heads: int, contexts: list[str], ctx_dims: dict[str, int]) -> int:
    """Decoder block ``i`` (dynamic convolution, context attentions, feed-forward); -> its kernel size."""
    src, dst = f"decoder.layers.{i}", f"layers.{i}"
    _linear(state, used, f"{src}.linear1", f"{dst}.conv.linear1", out)
    _linear(state, used, f"{src}.linear2", f"{dst}.conv.linear2", out)
    wl = _take(state, used, f"{src}.conv.weight_linear.weight")
    out[f"{dst}.conv.conv.weight_linear.weight"] = wl
    if wl.shape[0] % num_heads:
        raise TellkitError(f"{src}.conv.weight_linear has {wl.shape[0]} outputs, not a multiple of "
                           f"num_heads={num_heads}")
    for extra in ("weight_linear.bias", "conv_bias"):
        if f"{src}.conv.{extra}" in state:
            raise TellkitError(f"{src}.conv.{extra}: the reference decoder has none; this checkpoint "
                               "is another configuration")
    _copy(state, used, f"{src}.conv_layer_norm", f"{dst}.conv_norm", out)
    for ref_name in contexts:
        name = _CONTEXTS[ref_name]
        ctx_dims[name] = _context_attention(state, used, out, f"{src}.context_attns.{ref_name}",
                                            f"{dst}.context_attn.{name}")
        _copy(state, used, f"{src}.context_attn_lns.{ref_name}", f"{dst}.context_norm.{name}", out)
    _linear(state, used, f"{src}.context_fc", f"{dst}.context_proj", out)
    _linear(state, used, f"{src}.fc1", f"{dst}.fc1", out)
    _linear(state, used, f"{src}.fc2", f"{dst}.fc2", out)
    _copy(state, used, f"{src}.final_layer_norm", f"{dst}.final_norm", out)
    return wl.shape[0] // num_heads


def _context_attention(state, used, out: dict, a: str, t: str) -> int:
    """One context attention (reference ``a`` -> tellkit ``t``); -> the context's width."""
    if f"{a}.in_proj_weight" in state:  # keys as wide as the queries: one stacked matrix
        q, k, v = _take(state, used, f"{a}.in_proj_weight").chunk(3, dim=0)
    else:
        q = _take(state, used, f"{a}.q_proj_weight")
        k = _take(state, used, f"{a}.k_proj_weight")
        v = _take(state, used, f"{a}.v_proj_weight")
    qb, kb, vb = _take(state, used, f"{a}.in_proj_bias").chunk(3, dim=0)
    for proj, w, bias in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
        out[f"{t}.{proj}.weight"], out[f"{t}.{proj}.bias"] = w, bias
    _copy(state, used, f"{a}.out_proj", f"{t}.out_proj", out)
    for n in ("bias_k", "bias_v"):
        if f"{a}.{n}" in state:
            out[f"{t}.{n}"] = _take(state, used, f"{a}.{n}").reshape(1, 1, -1)
    return k.shape[1]
