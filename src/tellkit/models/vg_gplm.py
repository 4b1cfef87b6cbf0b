"""VG-BART / VG-T5: vision-guided generative pre-trained language models for multimodal
abstractive summarization (Yu, Dai, Liu, Fung, EMNLP 2021).

A Hugging Face BART or T5 (``backbone``: hub name or local folder) is kept intact; text-vision
fusion sub-layers (``tellkit.layers.fusion``: dot-product, its projected-video variant, or
multi-head; optional forget gate; residual + LayerNorm) are inserted through PyTorch forward
hooks on the backbone's public modules, so no HF source is copied or edited. Video features
[B, M, 2048] may first pass a visual transformer encoder (VTF: 4 post-norm layers, 8 heads,
FFN 2048; input x sqrt(2048), then sinusoidal frame positions; 100,745,216 parameters).

As the reference code (HLTCHKUST/VG-GPLMs) builds it:
- BART: one fusion block after encoder layer i (default the last); T5, last encoder layer:
  after the encoder's final LayerNorm and dropout (``t5_fusion_point: final_norm``; ``block``
  fuses after the last T5 block instead, before the final LayerNorm; earlier T5 layers always
  fuse after their block);
- multi-head fusion in d_c = 256 with one head; forget-gate output dropout;
- :meth:`VGGPLM.boosted_parameters` (fusion linears, attention, gate) are what the
  summarization task trains with ``lr x new_layer_lr_scale``; the VTF and the fusion LayerNorm
  train at the base rate.

Switches that reproduce the reference (on in the paper recipes ``configs/vg/how2_*.yaml``; the
labelled ``how2_bart_tellkit.yaml`` keeps tellkit's choices):
- ``softmax_over: text`` + ``mask_frames: false``: the dot-product softmax over text positions
  and no video mask in any fusion (tellkit: ``frames`` + ``true``, the paper's equations);
- ``reference_init``: the fusion and VTF as the reference's construction leaves them. BART's
  ``init_weights()`` draws every ``nn.Linear`` of the model (fusion linears, the attention's
  output projection, the VTF's linears) from N(0, ``init_std`` = 0.02) with zero biases; T5's
  touches no plain ``nn.Linear`` (PyTorch's defaults stay). In both, the VTF's four layers are
  deep copies of one layer, so what no init redraws (the attention's ``in_proj``, the LayerNorms,
  and for T5 everything) starts equal in all four;
- ``group_params_by_value``: :meth:`VGGPLM.parameter_groups` builds the base-rate group as the
  reference's ``configure_optimizers`` does, leaving out every parameter whose values equal
  (``torch.equal``, same shape) a boosted parameter. After ``reference_init`` the boosted biases
  are zero, so every other zero tensor of their shapes drops out of the optimiser and stays zero:
  with BART, dot-product + forget gate + VTF, 21 tensors (the fusion LayerNorm's bias and, per VTF
  layer, the attention output bias, both FFN biases and both LayerNorm biases), 41,728 numbers.

Differences from the reference, kept because they fix it:
- ``fusion: none`` (or ``fusion_enabled = False``) is the text-only baseline and reproduces the
  plain backbone exactly;
- decoding is HF ``generate`` with BART starting from ``<s>`` like its training labels;
  ``max_len`` counts new tokens (the reference's ``max_length=64`` includes the start token).

Shapes: ``input_ids``/``attention_mask`` [B, L], ``labels`` [B, T] (-100 = ignore),
``video`` [B, M, video_dim], ``video_mask`` [B, M] (True = real frame).
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tellkit.checkpoint import PretrainedMixin
from tellkit.errors import TellkitError
from tellkit.layers.fusion import FUSIONS, SOFTMAX_OVER, FusionBlock
from tellkit.layers.loss import logits_loss
from tellkit.registry import register_model
from tellkit.utils.optional import require

log = logging.getLogger(__name__)

# Architecture facts of the two published backbones, so that `tellkit model-info` can count
# parameters offline (no weights involved); used only when no local folder or HF cache has them.
KNOWN_BACKBONES: dict[str, dict[str, Any]] = {
    "facebook/bart-base": dict(
        model_type="bart", vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
        max_position_embeddings=1024, activation_function="gelu", pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0, forced_eos_token_id=2,
        scale_embedding=False,
    ),
    "t5-base": dict(
        model_type="t5", vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
        num_decoder_layers=12, num_heads=12, relative_attention_num_buckets=32, dropout_rate=0.1,
        layer_norm_epsilon=1e-6, feed_forward_proj="relu", pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, tie_word_embeddings=True,
    ),
}
KNOWN_BACKBONES["google-t5/t5-base"] = KNOWN_BACKBONES["t5-base"]


T5_FUSION_POINTS = ("final_norm", "block")


@dataclass
class VGGPLMConfig:
    backbone: str = "facebook/bart-base"  # HF hub name or local folder (BART or T5)
    backbone_config: dict[str, Any] | None = None  # the HF config, filled in when first built
    fusion: str = "dot_product"  # none | dot_product | dot_product_projected | multi_head
    fusion_layers: tuple[int, ...] = (-1,)  # encoder layers to fuse after (negative = from the end)
    decoder_fusion_layers: tuple[int, ...] = ()  # decoder layers to fuse after
    fusion_dim: int | None = 256  # multi-head common dim d_c (None = d_model)
    fusion_heads: int = 1
    forget_gate: bool = False
    softmax_over: str = "frames"  # dot-product attention normalised over frames (paper) or text (reference)
    mask_frames: bool = True  # mask padded frames in the fusion (False: they take part, as the reference)
    reference_init: bool = False  # fusion / VTF initialised as the reference's construction leaves them
    group_params_by_value: bool = False  # the reference's optimiser grouping by value (see parameter_groups)
    t5_fusion_point: str = "final_norm"  # T5 encoder: after the final LayerNorm + dropout, or after a block
    video_dim: int = 2048
    max_frames: int = 256
    visual_encoder: bool = False  # VTF over the video features before fusion
    vtf_layers: int = 4
    vtf_heads: int = 8
    vtf_ffn: int = 2048
    dropout: float = 0.1  # fusion output, forget gate and VTF dropout
    new_layer_lr_scale: float = 5.0  # lr factor for boosted_parameters() (the reference's img_lr_factor)

    def __post_init__(self) -> None:
        if self.fusion not in ("none", *FUSIONS):
            raise TellkitError(f"model.fusion must be one of none, {', '.join(FUSIONS)}; got {self.fusion!r}")
        if self.fusion == "none" and (self.forget_gate or self.visual_encoder):
            raise TellkitError("model.forget_gate / visual_encoder need a fusion (model.fusion is 'none')")
        if self.softmax_over not in SOFTMAX_OVER:
            raise TellkitError(
                f"model.softmax_over must be one of {', '.join(SOFTMAX_OVER)}; got {self.softmax_over!r}"
            )
        if self.t5_fusion_point not in T5_FUSION_POINTS:
            raise TellkitError(
                f"model.t5_fusion_point must be one of {', '.join(T5_FUSION_POINTS)}; got {self.t5_fusion_point!r}"
            )
        self.fusion_layers = tuple(int(i) for i in self.fusion_layers)
        self.decoder_fusion_layers = tuple(int(i) for i in self.decoder_fusion_layers)


# --- backbone resolution -------------------------------------------------------------------
def backbone_hf_config(cfg: VGGPLMConfig):
    """The backbone's HF config: from ``cfg.backbone_config`` if set, else from the local folder,
    the HF cache, the built-in table of known architectures, or the hub (in that order)."""
    transformers = _transformers()
    if cfg.backbone_config:
        d = dict(cfg.backbone_config)
        mt = d.pop("model_type", None)
        if mt not in ("bart", "t5"):
            raise TellkitError(f"model.backbone_config: model_type must be 'bart' or 't5', got {mt!r}")
        return transformers.AutoConfig.for_model(mt, **d)
    name = cfg.backbone
    local = Path(os.path.expanduser(name))
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise TellkitError(f"{local}: not a Hugging Face model folder (no config.json)")
        hf = transformers.AutoConfig.from_pretrained(str(local))
    else:
        try:
            hf = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError):
            if name in KNOWN_BACKBONES:
                d = dict(KNOWN_BACKBONES[name])
                log.info("backbone %s: architecture from tellkit's table (no local copy)", name)
                return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
            try:
                hf = transformers.AutoConfig.from_pretrained(name)
            except (OSError, ValueError) as exc:
                raise TellkitError(
                    f"backbone '{name}' is neither a local folder nor reachable on the HF hub ({_one_line(exc)})"
                ) from exc
    if hf.model_type not in ("bart", "t5"):
        raise TellkitError(f"backbone {name}: model_type '{hf.model_type}' is not supported (bart or t5)")
    return hf


def _transformers():

    return require("transformers", "all", "VG-BART / VG-T5 backbones")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _config_to_dict(hf) -> dict[str, Any]:
    d = hf.to_dict()
    for k in ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(k, None)
    return json.loads(json.dumps(d, default=str))  # plain JSON values only


# --- visual transformer encoder ------------------------------------------------------------
def interleaved_sinusoids(length: int, dim: int) -> torch.Tensor:
    """[length, dim] positions of "Attention is all you need": sin on even channels, cos on odd
    ones, frequency 10000^(-2i/dim) (the layout the reference's VTF uses)."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table.float()


class VisualTransformerEncoder(nn.Module):
    """Post-norm transformer encoder over video features: ``x * sqrt(dim) + positions``, dropout,
    then ``layers`` ReLU encoder layers with padded frames masked."""

    def __init__(self, dim: int, layers: int = 4, heads: int = 8, ffn: int = 2048, dropout: float = 0.1):
        super().__init__()
        self.dim = dim
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, ffn, dropout, activation="relu", batch_first=True)
            for _ in range(layers)
        )

    def forward(self, video: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = interleaved_sinusoids(video.size(1), self.dim).to(video.device, video.dtype)
        x = self.dropout(video * math.sqrt(self.dim) + pos)
        # a sample with no real frame would give NaN rows: let it attend to its padding (its
        # fusion context is zeroed anyway by the masked attention)
        pad = ~(mask | ~mask.any(-1, keepdim=True))
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=pad)
        return x


# --- the model -----------------------------------------------------------------------------
@register_model("vg_gplm", VGGPLMConfig)
class VGGPLM(nn.Module, PretrainedMixin):
    """HF BART/T5 + text-vision fusion. ``model(batch) -> {"loss", "ntokens", "logits"}``."""

    def __init__(self, config: VGGPLMConfig):
        super().__init__()
        transformers = _transformers()
        hf_cfg = backbone_hf_config(config)
        config.backbone_config = _config_to_dict(hf_cfg)  # the checkpoint rebuilds without the folder
        self.config = config
        self.backbone = transformers.AutoModelForSeq2SeqLM.from_config(hf_cfg)
        self.is_t5 = hf_cfg.model_type == "t5"
        d_model = hf_cfg.d_model
        enc, dec = self._layers("encoder"), self._layers("decoder")
        self.fusion_enabled = True
        self._ctx: tuple[torch.Tensor, torch.Tensor] | None = None
        self.visual_encoder = None
        self.encoder_fusion = nn.ModuleDict()
        self.decoder_fusion = nn.ModuleDict()
        if config.fusion != "none":
            if config.visual_encoder:
                self.visual_encoder = VisualTransformerEncoder(
                    config.video_dim, config.vtf_layers, config.vtf_heads, config.vtf_ffn, config.dropout
                )
            for where, layers, wanted, blocks in (
                ("encoder", enc, config.fusion_layers, self.encoder_fusion),
                ("decoder", dec, config.decoder_fusion_layers, self.decoder_fusion),
            ):
                for i in sorted({self._norm_index(i, len(layers), where) for i in wanted}):
                    blocks[str(i)] = FusionBlock(
                        config.fusion, d_model, config.video_dim, d_common=config.fusion_dim,
                        heads=config.fusion_heads, dropout=config.dropout, forget_gate=config.forget_gate,
                        softmax_over=config.softmax_over, mask_frames=config.mask_frames,
                    )
                    last = i == len(layers) - 1
                    if where == "encoder" and self.is_t5 and last and config.t5_fusion_point == "final_norm":
                        # the encoder stack's output = final LayerNorm + dropout after the last block
                        self.backbone.get_encoder().register_forward_hook(self._make_hook(blocks[str(i)]))
                    else:
                        layers[i].register_forward_hook(self._make_hook(blocks[str(i)]))
            if not len(self.encoder_fusion) and not len(self.decoder_fusion):
                raise TellkitError("model.fusion is set but no fusion_layers / decoder_fusion_layers are given")
            if config.reference_init:
                self._reference_init(getattr(hf_cfg, "init_std", 0.02))

    @torch.no_grad()
    def _reference_init(self, std: float) -> None:
        """The reference's starting point for the new layers (see the module docstring)."""
        if self.visual_encoder is not None:  # deep copies of one layer
            first = self.visual_encoder.layers[0].state_dict()
            for layer in self.visual_encoder.layers[1:]:
                layer.load_state_dict(first)
        if self.is_t5:
            return  # T5's init_weights leaves plain nn.Linear layers at PyTorch's defaults
        for part in (self.visual_encoder, self.encoder_fusion, self.decoder_fusion):
            for m in part.modules() if part is not None else ():
                if isinstance(m, nn.Linear):  # includes nn.MultiheadAttention's out_proj
                    m.weight.normal_(0.0, std)
                    if m.bias is not None:
                        m.bias.zero_()

    # -- structure ---------------------------------------------------------------------------
    def _layers(self, where: str) -> nn.ModuleList:
        stack = self.backbone.get_encoder() if where == "encoder" else self.backbone.get_decoder()
        return stack.block if self.is_t5 else stack.layers

    @staticmethod
    def _norm_index(i: int, n: int, where: str) -> int:
        if not -n <= i < n:
            raise TellkitError(f"{where} fusion layer {i} is out of range for a {n}-layer {where}")
        return i % n

    def new_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters that are not the pre-trained backbone's (fusion layers and the VTF)."""
        for name, p in self.named_parameters():
            if not name.startswith("backbone."):
                yield p

    def boosted_parameters(self) -> Iterator[nn.Parameter]:
        """What the reference trains with ``lr x new_layer_lr_scale``: the fusion linears,
        attention and forget gates (not the fusion LayerNorms, not the VTF)."""
        for blocks in (self.encoder_fusion, self.decoder_fusion):
            for block in blocks.values():
                yield from block.boosted_parameters()

    def parameter_groups(self, lr: float) -> list[dict[str, Any]]:
        """Optimiser groups: ``boosted_parameters()`` at ``lr x new_layer_lr_scale``, the rest at
        ``lr``. With ``group_params_by_value`` the base group is built as the reference builds it:
        a parameter is left out when a boosted parameter of the same shape has equal values, so
        such parameters (zero biases and LayerNorm shifts, after ``reference_init``) are in no
        group and keep their initial values."""
        boosted = [p for p in self.boosted_parameters() if p.requires_grad]
        trainable = [p for p in self.parameters() if p.requires_grad]
        if self.config.group_params_by_value:
            base = [p for p in trainable
                    if not any(p.shape == q.shape and torch.equal(p, q) for q in boosted)]
        else:
            ids = {id(p) for p in boosted}
            base = [p for p in trainable if id(p) not in ids]
        groups = [{"params": base, "lr": lr}]
        if boosted:
            groups.append({"params": boosted, "lr": lr * self.config.new_layer_lr_scale})
        return groups

    def parameter_parts(self) -> dict[str, Any]:
        return {"backbone": self.backbone, "visual_encoder": self.visual_encoder,
                "encoder_fusion": self.encoder_fusion, "decoder_fusion": self.decoder_fusion}

    # -- fusion context (read by the hooks) ---------------------------------------------------
    def _make_hook(self, block: FusionBlock):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._ctx is None or not self.fusion_enabled:
                return None
            if isinstance(output, tuple):
                hidden = output[0]
            elif isinstance(output, torch.Tensor):
                hidden = output
            else:  # an encoder stack's ModelOutput
                hidden = output.last_hidden_state
            video, mask = self._ctx
            if video.size(0) != hidden.size(0):  # beam search: each sample repeated contiguously
                if hidden.size(0) % video.size(0):
                    raise RuntimeError(f"fusion: batch {hidden.size(0)} is not a multiple of {video.size(0)} videos")
                r = hidden.size(0) // video.size(0)
                video, mask = video.repeat_interleave(r, 0), mask.repeat_interleave(r, 0)
            fused = block(hidden, video.to(hidden.dtype), mask)
            if isinstance(output, tuple):
                return (fused, *output[1:])
            if isinstance(output, torch.Tensor):
                return fused
            output.last_hidden_state = fused
            return output

        return hook

    @contextlib.contextmanager
    def video_context(self, batch: dict[str, Any]):
        """Make the batch's (encoded) video visible to the fusion hooks for one forward/generate."""
        needs = self.fusion_enabled and (len(self.encoder_fusion) or len(self.decoder_fusion))
        if not needs:
            yield
            return
        video = batch.get("video")
        if video is None:
            raise TellkitError("this VG-GPLM model fuses video: the batch needs 'video' features (or use fusion: none)")
        if video.size(-1) != self.config.video_dim:
            raise TellkitError(f"video features have size {video.size(-1)}, the model expects {self.config.video_dim}")
        mask = batch.get("video_mask")
        if mask is None:
            mask = torch.ones(video.shape[:2], dtype=torch.bool, device=video.device)
        mask = mask.bool()
        video = video.float()
        if self.visual_encoder is not None:
            video = self.visual_encoder(video, mask)
        self._ctx = (video, mask)
        try:
            yield
        finally:
            self._ctx = None

    # -- training -----------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any]) -> dict[str, Any]:
        labels = batch["labels"]
        dec_in = self.backbone.prepare_decoder_input_ids_from_labels(labels=labels)
        with self.video_context(batch):
            out = self.backbone(
                input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), decoder_input_ids=dec_in
            )
        logits = out.logits
        return {**logits_loss(logits, labels, ignore_index=-100), "logits": logits}

    # -- decoding -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        batch: dict[str, Any],
        max_len: int = 64,
        beam_size: int = 5,
        no_repeat_ngram_size: int = 3,
        length_penalty: float = 1.0,
        min_len: int = 0,
    ) -> dict[str, Any]:
        """Beam search through HF ``generate``; ``tokens``: ids per sample without the decoder
        start, bos, eos or padding."""
        gen_cfg = copy.deepcopy(self.backbone.generation_config)
        gen_cfg.update(
            num_beams=beam_size, max_new_tokens=max_len, min_new_tokens=min_len, max_length=None,
            no_repeat_ngram_size=no_repeat_ngram_size, length_penalty=length_penalty, do_sample=False,
            early_stopping=beam_size > 1, num_return_sequences=1, output_scores=False, return_dict_in_generate=False,
        )
        if not self.is_t5 and getattr(gen_cfg, "forced_bos_token_id", None) is None:
            # BART summarizers start with <s> (bart-base's forced_bos_token_id = 0, absent from the
            # model config under transformers 5); the training labels start with <s> too
            gen_cfg.forced_bos_token_id = self.backbone.config.bos_token_id
        with self.video_context(batch):
            seqs = self.backbone.generate(
                input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), generation_config=gen_cfg
            )
        hf = self.backbone.config
        drop = {getattr(hf, k, None) for k in ("pad_token_id", "bos_token_id", "decoder_start_token_id")} - {None}
        eos = getattr(hf, "eos_token_id", None)
        tokens = []
        for row in seqs.tolist():
            row = row[1:]  # decoder start
            if eos in row:
                row = row[: row.index(eos)]
            tokens.append([t for t in row if t not in drop])
        return {"tokens": tokens}

    # -- weights and tokenizer ----------------------------------------------------------------
    def load_backbone_weights(self) -> None:
        """Copy the pre-trained backbone's weights (from its folder or the HF hub) into the model."""
        transformers = _transformers()
        try:
            hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(self.config.backbone)
        except (OSError, ValueError) as exc:
            raise TellkitError(
                f"cannot load backbone weights from '{self.config.backbone}' ({_one_line(exc)})"
            ) from exc
        missing, unexpected = self.backbone.load_state_dict(hf.state_dict(), strict=False)
        if unexpected or [k for k in missing if "embed_tokens" not in k and "lm_head" not in k]:
            raise TellkitError(
                f"backbone '{self.config.backbone}' does not match its config "
                f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
            )

    def save_pretrained(
        self, directory: str | os.PathLike, extra: dict[str, Any] | None = None, tokenizer: Any = None
    ) -> Path:
        """Checkpoint (config.json + model.safetensors); with ``tokenizer``, also ``tokenizer/``."""
        d = super().save_pretrained(directory, extra)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(Path(d) / "tokenizer"))
        return d


def load_tokenizer(source: str | os.PathLike, checkpoint: str | os.PathLike | None = None):
    """The tokenizer saved beside a checkpoint (``<ckpt>/tokenizer``) or the backbone's."""
    transformers = _transformers()
    candidates = []
    if checkpoint is not None and (Path(checkpoint) / "tokenizer").is_dir():
        candidates.append(str(Path(checkpoint) / "tokenizer"))
    candidates.append(str(source))
    errors = []
    for c in candidates:
        try:
            return transformers.AutoTokenizer.from_pretrained(c)
        except (OSError, ValueError) as exc:
            errors.append(f"{c}: {_one_line(exc)}")
    raise TellkitError("no tokenizer found (" + "; ".join(errors) + ")")


# --- tiny backbones for tests and demos (no weights exist offline) ---------------------------
def save_tiny_backbone(
    directory: str | os.PathLike,
    kind: str = "bart",
    texts: Sequence[str] = (),
    *,
    d_model: int = 16,
    layers: int = 2,
    heads: int = 2,
    ffn: int = 32,
    max_positions: int = 600,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised tiny BART or T5 and a word-level tokenizer trained on
    ``texts`` to ``directory`` (HF ``save_pretrained`` layout), usable as ``model.backbone``."""
    transformers = _transformers()
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers  # heavy

    if kind == "bart":
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
    elif kind == "t5":
        specials = ["<pad>", "</s>", "<unk>"]
    else:
        raise TellkitError(f"tiny backbone kind must be 'bart' or 't5', got {kind!r}")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(list(texts) or ["hello world"], trainers.WordLevelTrainer(special_tokens=specials))
    if kind == "bart":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
        )
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
        )
        cfg = transformers.BartConfig(
            vocab_size=tok.get_vocab_size(), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
            max_position_embeddings=max_positions, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, forced_bos_token_id=0, forced_eos_token_id=2,
        )
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
        )
        cfg = transformers.T5Config(
            vocab_size=tok.get_vocab_size(), d_model=d_model, d_kv=d_model // heads, d_ff=ffn, num_layers=layers,
            num_decoder_layers=layers, num_heads=heads, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    torch.manual_seed(seed)
    model = transformers.AutoModelForSeq2SeqLM.from_config(cfg)
    d = Path(directory)
    model.save_pretrained(str(d))
    fast.save_pretrained(str(d))
    return d
