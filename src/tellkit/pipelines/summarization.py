"""Transcript (+ video features) -> summary: the inference pipeline of the summarization family
(VG-BART / VG-T5, ``vg_gplm``, and the How2 ``seq2seq`` baseline) that ``tellkit summarize``
calls and a server can call.

``Summarizer.load(checkpoint)`` reads a checkpoint folder or a run folder of ``tellkit train``
(its best checkpoint), the tokenizer saved beside it (else the backbone's), and the recipe stored
with it: the ``data`` section says how inputs were prepared in training (``max_source_tokens``,
``max_frames``, ``source_prefix``), the ``eval`` section holds the decoding settings
(:class:`tellkit.recipes.SummaryGeneration`). The tensors are built by the
same dataset collation as training and evaluation, so a summary here equals the one
``tellkit evaluate`` writes for the same example with one sample per batch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tellkit.checkpoint import load_model, read_checkpoint_config, resolve_checkpoint
from tellkit.data.how2 import collate_how2, load_features
from tellkit.errors import TellkitError
from tellkit.models.vg_gplm import load_tokenizer
from tellkit.pipelines.base import checkpoint_info
from tellkit.recipes import How2DataConfig, SummaryGeneration, section

FAMILIES = ("vg_gplm", "seq2seq")


class Summarizer:
    """``summarize(transcript, features=None) -> {"summary", "frames"}`` with one trained model."""

    def __init__(self, model: Any, tokenizer: Any, data: Any, generation: Any, info: dict[str, Any],
                 device: Any = "cpu"):
        import torch  # heavy

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.data = data  # tellkit.recipes.How2DataConfig
        self.generation = generation  # tellkit.recipes.SummaryGeneration
        self.info = info
        self.device = torch.device(device)

    @classmethod
    def load(cls, checkpoint: str | os.PathLike, device: str = "cpu", **generation: Any) -> Summarizer:
        """``generation``: overrides of the stored decoding settings (``beam_size``, ``max_len``,
        ``min_len``, ``no_repeat_ngram_size``, ``length_penalty``; None keeps the stored value)."""
        import torch  # heavy

        ckpt = resolve_checkpoint(checkpoint)
        meta = read_checkpoint_config(ckpt)
        if meta["family"] not in FAMILIES:
            raise TellkitError(
                f"{ckpt}: a '{meta['family']}' checkpoint, not a summarization one ({', '.join(FAMILIES)})"
            )
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise TellkitError(f"device: {exc}") from exc
        data = section(meta, "data", How2DataConfig, "stored recipe: data")
        gen = SummaryGeneration.from_section(meta.get("eval"), **generation)
        model = load_model(ckpt, map_location=dev)
        gen.check_positions(_position_limit(model), f"the '{meta['family']}' model")
        tok = load_tokenizer(model.config.backbone, ckpt)
        return cls(model, tok, data, gen, checkpoint_info(meta["family"], ckpt, meta), dev)

    @property
    def uses_video(self) -> bool:
        m = self.model
        return bool(len(getattr(m, "encoder_fusion", ())) + len(getattr(m, "decoder_fusion", ())))

    def summarize(self, transcript: str, features: Any = None) -> dict[str, Any]:
        """One summary. ``features``: a ``.npy`` path or a float array [T, video_dim]; needed
        when the model fuses video, ignored (``video_ignored``: true) when it is text-only."""
        import numpy as np  # heavy
        import torch  # heavy

        transcript = " ".join(str(transcript).split())
        if not transcript:
            raise TellkitError("the transcript is empty")
        video = None
        dim = getattr(self.model.config, "video_dim", 2048)
        if self.uses_video:
            if features is None:
                raise TellkitError(f"this model fuses video: give video features (float32, shape (T, {dim}))")
            if isinstance(features, (str, Path)):
                video = load_features(features, self.data.max_frames, dim)
            else:
                arr = np.asarray(features, dtype=np.float32)
                if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != dim:
                    raise TellkitError(f"video features must have shape (T, {dim}) with T >= 1, got {arr.shape}")
                if not np.isfinite(arr).all():
                    raise TellkitError("video features contain NaN or infinity")
                video = np.ascontiguousarray(arr[: self.data.max_frames])
        tok = self.tokenizer
        enc = tok(self.data.source_prefix + transcript, max_length=self.data.max_source_tokens, truncation=True,
                  add_special_tokens=self.data.source_special_tokens)  # as training built the source
        sample = {"id": "input", "input_ids": list(enc["input_ids"]), "labels": [tok.pad_token_id], "video": video,
                  "summary": ""}
        batch = collate_how2([sample], tok.pad_token_id, video_dim=dim, frames=None)
        batch = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with torch.no_grad():
            out = self.model.generate(batch, **self.generation.kwargs())
        summary = tok.decode(out["tokens"][0], skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
        return {
            "summary": summary,
            "frames": 0 if video is None else int(video.shape[0]),
            "video_ignored": features is not None and not self.uses_video,
        }


def _position_limit(model: Any) -> int | None:
    """Decoder positions of a backbone with a learned position table (BART); None for T5's
    relative positions (no fixed table)."""
    hf = getattr(getattr(model, "backbone", None), "config", None)
    n = getattr(hf, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None
