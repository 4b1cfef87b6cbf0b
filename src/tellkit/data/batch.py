"""The captioning batch contract: what an encoded item holds, how items are padded into a batch,
and how a model reads one context set out of a batch.

Mask convention, everywhere in the batch path: ``<name>_mask`` is bool with **True = a real
entry** (an image grid cell, a face, an object, an article token); False marks padding. Models
turn it into PyTorch's ``key_padding_mask`` (True = ignore) only at the attention call, as
``~mask``. An empty set (no face found, no object detector) is a row of all-False entries (or
zero columns when no item of the batch has one); attention layers with a zero-attention slot
handle it.

Producers: :class:`tellkit.encoders.bundle.EncoderBundle` (images / articles -> items, with or
without the feature cache) and :func:`collate_captions` (items -> batch). Consumers: every
captioning model (``transform_and_tell``, ``show_tell``, ``show_attend_tell``,
``lstm_captioner``) through :func:`read_context`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from tellkit.errors import TellkitError


class CaptionItem(TypedDict, total=False):
    """One encoded sample, unpadded (what a captioning dataset's ``__getitem__`` returns).

    Only the contexts the model reads are present."""

    id: str
    image_id: str | None
    references: list[str]  # the captions it is scored against
    caption: torch.Tensor  # long [T]: <s> caption ids </s> (absent at inference)
    image: torch.Tensor  # float [N, C]: the image's grid vectors
    faces: torch.Tensor  # float [F, 512], F <= encoders.max_faces (may be 0)
    objects: torch.Tensor  # float [O, 2048] (O = 0 when no detector output is available)
    article: torch.Tensor  # float [n_layers, L, D]: every hidden state of the article encoder
    article_ids: torch.Tensor  # long [L]: caption-vocabulary id of each article token, -1: none


class CaptionBatch(TypedDict, total=False):
    """Items padded by :func:`collate_captions` (B items; masks: True = a real entry)."""

    ids: list[str]
    image_ids: list[str | None]
    references: list[list[str] | None]
    caption: torch.Tensor  # long [B, T], padded with the tokenizer's pad id
    image: torch.Tensor  # float [B, N, C]
    image_mask: torch.Tensor  # bool [B, N]
    faces: torch.Tensor  # float [B, F, 512]
    faces_mask: torch.Tensor  # bool [B, F]
    objects: torch.Tensor  # float [B, O, 2048]
    objects_mask: torch.Tensor  # bool [B, O]
    article: torch.Tensor  # float [B, n_layers, L, D]
    article_mask: torch.Tensor  # bool [B, L]
    article_ids: torch.Tensor  # long [B, L], -1 at padding


def collate_captions(items: Sequence[CaptionItem], contexts: Sequence[str], pad_id: int = 1) -> CaptionBatch:
    """Pad items into a :class:`CaptionBatch`; only the named ``contexts`` are batched."""
    B = len(items)
    batch: dict[str, Any] = {"ids": [it.get("id") for it in items], "image_ids": [it.get("image_id") for it in items],
                             "references": [it.get("references") for it in items]}
    if B and "caption" in items[0]:
        T = max(len(it["caption"]) for it in items)
        cap = torch.full((B, T), pad_id, dtype=torch.long)
        for b, it in enumerate(items):
            cap[b, : len(it["caption"])] = it["caption"]
        batch["caption"] = cap
    for name in ("image", "faces", "objects"):
        if name not in contexts:
            continue
        n = max(it[name].shape[0] for it in items)
        dim = items[0][name].shape[-1]
        x = torch.zeros(B, n, dim)
        m = torch.zeros(B, n, dtype=torch.bool)
        for b, it in enumerate(items):
            k = it[name].shape[0]
            x[b, :k], m[b, :k] = it[name], True
        batch[name], batch[f"{name}_mask"] = x, m
    if "article" in contexts:
        layers, _, dim = items[0]["article"].shape
        L = max(it["article"].shape[1] for it in items)
        x = torch.zeros(B, layers, L, dim)
        m = torch.zeros(B, L, dtype=torch.bool)
        ids = torch.full((B, L), -1, dtype=torch.long)
        for b, it in enumerate(items):
            k = it["article"].shape[1]
            x[b, :, :k], m[b, :k], ids[b, :k] = it["article"], True, it["article_ids"]
        batch["article"], batch["article_mask"], batch["article_ids"] = x, m, ids
    return batch  # type: ignore[return-value]


def read_context(batch: CaptionBatch | dict[str, Any], name: str, dim: int, mix: nn.Module | None = None,
                 layers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch[name]`` as (features float [B, N, dim], valid bool [B, N], True = real), checked.

    A 4-D article [B, n_layers, L, C] is mixed by ``mix`` (a
    :class:`~tellkit.layers.layer_mix.LayerMix` over ``layers`` layers) or, without one, read at
    its last layer. A missing ``<name>_mask`` means every entry is real."""
    x = batch.get(name)
    if x is None:
        raise TellkitError(f"batch has no '{name}' context, which this model uses")
    if x.dim() == 4:
        if mix is not None:
            if x.size(1) != layers:
                raise TellkitError(f"{name} must be [B, {layers} layers, L, {dim}], got {tuple(x.shape)}")
            x = mix(x, layer_dim=1)
        else:
            x = x[:, -1]
    if x.dim() != 3 or x.size(-1) != dim:
        raise TellkitError(f"{name} features must be [B, N, {dim}], got {tuple(x.shape)}")
    valid = batch.get(f"{name}_mask")
    valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if valid is None else valid.bool()
    if valid.shape != x.shape[:2]:
        raise TellkitError(f"{name}_mask has shape {tuple(valid.shape)}, expected {tuple(x.shape[:2])}")
    return x, valid
