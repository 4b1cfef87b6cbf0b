"""The exported graphs (:mod:`tellkit.export.onnx`) run by ONNX Runtime, behind the same
interfaces the PyTorch models give the searches, so that beam search, BTTR's joint search and
rescoring, and length normalisation are the project's own code on either runtime:

* :class:`OnnxBTTR` gives :func:`tellkit.models.bttr_search.joint_search` what
  :class:`tellkit.models.bttr.BTTR` gives it: ``encode_by_size`` (images grouped by size,
  unpadded, features laid out as the padded batch), ``incremental`` (a
  :class:`tellkit.decoding.state.IncrementalDecoder` over the step graph: its keys/values
  re-indexed when beams are re-ranked, the projected memory held once per image and dropped
  when an image's last row leaves) and ``sequence_logprob`` (the teacher-forced rescoring);
  ``generate`` is the joint search itself.
* :class:`OnnxShowAttendTell` runs :func:`tellkit.models.baselines.common.search` (greedy / beam)
  over the step graph, with the LSTM state and the attention inputs as the search's row state;
  ``generate`` returns what :meth:`ShowAttendTell.generate` returns (per-token attention too).
* :class:`OnnxImageEncoder` takes the place of a captioning bundle's frozen image encoder.

Everything runs on the CPU in float32; a session uses ``torch.get_num_threads()`` threads (as
PyTorch would) unless told otherwise.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tellkit.checkpoint import read_checkpoint_config
from tellkit.decoding.runaway import RunawayStop
from tellkit.errors import TellkitError
from tellkit.export.onnx import manifest
from tellkit.layers.attention import RowGroups
from tellkit.models.baselines.common import attention_lists, context_set, search
from tellkit.models.bttr_search import joint_search
from tellkit.utils.optional import require


def session(path: Path, threads: int | None = None):
    """An ONNX Runtime CPU session for the graph at ``path``."""
    ort = require("onnxruntime", "onnx", "the ONNX runtime")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = int(threads or torch.get_num_threads())
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().contiguous().numpy()


def _layout(owner: torch.Tensor, n_images: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_rows [n_images * width], row_slots [N]) for rows reading image ``owner`` [N]: the
    slots of each image, ``width`` of them, hold its rows in order (N marks an empty slot)."""
    groups = RowGroups(owner, n_images)
    n = owner.numel()
    row_slots = torch.arange(n) if groups.pos is None else groups.pos.cpu()
    slot_rows = torch.full((n_images * groups.width,), n, dtype=torch.long)
    slot_rows[row_slots] = torch.arange(n)
    return _np(slot_rows), _np(row_slots)


class OnnxModel:
    """The sessions of one ONNX folder, named by their role (``encoder``, ``step``, ...)."""

    def __init__(self, folder: str | os.PathLike, meta: dict[str, Any] | None = None, threads: int | None = None):
        self.folder = Path(folder)
        self.meta = read_checkpoint_config(self.folder) if meta is None else meta
        entry = manifest(self.meta)
        if entry is None:
            raise TellkitError(f"{self.folder}: not an ONNX export (run `tellkit export MODEL --format onnx`)")
        self.manifest = entry
        self.config = dict(self.meta["config"])
        self.sessions = {role: session(self.folder / name, threads) for role, name in entry["graphs"].items()}

    def run(self, role: str, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.sessions[role].run(None, feed)

    # what a pipeline or the evaluator asks of a model
    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self


class OnnxBTTR(OnnxModel):
    family = "bttr"

    def __init__(self, folder, meta=None, threads=None):
        super().__init__(folder, meta, threads)
        c = self.config
        self.n_layers = int(c.get("num_decoder_layers", 3))
        self.heads, self.d_model = int(c.get("nhead", 8)), int(c.get("d_model", 256))
        self.stages = 2 + max(int(c.get("num_blocks", 3)) - 1, 0)  # stride-2 steps of the encoder

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        for _ in range(self.stages):
            height, width = (height + 1) // 2, (width + 1) // 2
        return height, width

    def encode(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        """Images of one size, unpadded -> memory [B, h*w, d], mask [B, h*w] (all True)."""
        memory = torch.from_numpy(self.run("encoder", {"image": _np(image.float())})[0])
        return memory, torch.ones(memory.shape[:2], dtype=torch.bool)

    def encode_by_size(self, image: torch.Tensor, image_mask: torch.Tensor | None = None):
        """As :meth:`tellkit.models.bttr.BTTR.encode_by_size`: each distinct size through the
        encoder unpadded, the features placed in the padded batch's layout."""
        if image_mask is None or bool(image_mask.all()):
            return self.encode(image)
        heights = image_mask.any(2).sum(1).tolist()
        widths = image_mask.any(1).sum(1).tolist()
        groups: dict[tuple[int, int], list[int]] = {}
        for i, hw in enumerate(zip(heights, widths)):
            groups.setdefault(hw, []).append(i)
        gh, gw = self.grid_size(*image.shape[-2:])
        memory = torch.zeros(image.shape[0], gh, gw, self.d_model)
        mask = torch.zeros(image.shape[0], gh, gw, dtype=torch.bool)
        for (h, w), idx in groups.items():
            index = torch.tensor(idx)
            mem, _ = self.encode(image.index_select(0, index)[..., :h, :w])
            ph, pw = self.grid_size(h, w)
            memory[index, :ph, :pw] = mem.view(len(idx), ph, pw, -1)
            mask[index, :ph, :pw] = True
        return memory.flatten(1, 2), mask.flatten(1)

    def project(self, memory: torch.Tensor) -> list[np.ndarray]:
        """Per layer the memory's cross-attention key and value [M, heads, S, hd]."""
        return self.run("memory", {"memory": _np(memory.float())})

    def _memory_feed(self, kvs: list[np.ndarray], memory_mask: torch.Tensor, owner: torch.Tensor) -> dict:
        slot_rows, row_slots = _layout(owner, kvs[0].shape[0])
        feed = {"slot_rows": slot_rows, "row_slots": row_slots, "memory_pad": _np(~memory_mask)}
        for i in range(self.n_layers):
            feed[f"memory_key_{i}"], feed[f"memory_value_{i}"] = kvs[2 * i], kvs[2 * i + 1]
        return feed

    def incremental(self, memory: torch.Tensor, memory_mask: torch.Tensor, owner: torch.Tensor,
                    use_cache: bool = True) -> _IncrementalBTTR:
        if not use_cache:
            raise TellkitError("the ONNX runtime decodes incrementally (use_cache=False is PyTorch's reference mode)")
        return _IncrementalBTTR(self, memory, memory_mask, owner)

    def sequence_logprob(self, inputs: torch.Tensor, targets: torch.Tensor, memory: torch.Tensor,
                         memory_mask: torch.Tensor, owner: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced sum of log p(targets) per row [N] (PAD targets ignored)."""
        owner = torch.arange(inputs.shape[0]) if owner is None else owner.cpu()
        used = torch.bincount(owner, minlength=memory.shape[0]) > 0
        live = used.nonzero().squeeze(1)  # only the images some row reads (as PyTorch projects them)
        owner = (used.cumsum(0) - 1).index_select(0, owner)
        memory, memory_mask = memory.index_select(0, live), memory_mask.index_select(0, live)
        feed = {"inputs": _np(inputs.long()), "targets": _np(targets.long()),
                **self._memory_feed(self.project(memory), memory_mask, owner)}
        return torch.from_numpy(self.run("score", feed)[0])

    def generate(self, image: torch.Tensor, image_mask: torch.Tensor | None = None, beam_size: int | None = None,
                 max_len: int | None = None, bidirectional: bool = True, rescore: bool = True,
                 use_cache: bool = True, alpha: float | None = None, stop: RunawayStop | None = None) -> dict[str, Any]:
        """The joint search of :meth:`tellkit.models.bttr.BTTR.generate`, over the graphs."""
        c = self.config
        return joint_search(self, image.cpu(), None if image_mask is None else image_mask.cpu(),
                            beam_size=beam_size or int(c.get("beam_size", 10)),
                            max_len=max_len or int(c.get("max_len", 200)),
                            alpha=float(c.get("alpha", 1.0)) if alpha is None else alpha,
                            bidirectional=bidirectional, rescore=rescore, use_cache=use_cache, stop=stop)


class _IncrementalBTTR:
    """:class:`tellkit.decoding.state.IncrementalDecoder` over BTTR's step graph."""

    def __init__(self, model: OnnxBTTR, memory: torch.Tensor, memory_mask: torch.Tensor, owner: torch.Tensor):
        self.model = model
        owner = owner.cpu()
        used = torch.bincount(owner, minlength=memory.shape[0]) > 0
        live = used.nonzero().squeeze(1)
        self.owner = (used.cumsum(0) - 1).index_select(0, owner)
        self.kvs = model.project(memory.index_select(0, live))
        self.pad = memory_mask.index_select(0, live)
        hd = model.d_model // model.heads
        empty = np.zeros((owner.numel(), model.heads, 0, hd), np.float32)
        self.past = [empty] * (2 * model.n_layers)
        self.feed = model._memory_feed(self.kvs, self.pad, self.owner)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        feed = {"tokens": _np(tokens[:, -1].long()), "position": np.array([tokens.shape[1] - 1], np.int64),
                **self.feed}
        for i in range(self.model.n_layers):
            feed[f"past_key_{i}"], feed[f"past_value_{i}"] = self.past[2 * i], self.past[2 * i + 1]
        out = self.model.run("step", feed)
        self.past = out[1:]  # the next step's past, unless the beams are re-ranked first
        return torch.from_numpy(out[0])

    def reorder(self, index: torch.Tensor) -> None:
        idx = index.cpu()
        rows = _np(idx)
        self.past = [p.take(rows, axis=0) for p in self.past]
        owner = self.owner.index_select(0, idx)
        n_images = self.kvs[0].shape[0]
        used = torch.bincount(owner, minlength=n_images) > 0
        if not bool(used.all()):  # images with no row left leave the memory (one copy, once)
            live = _np(used.nonzero().squeeze(1))
            self.kvs = [kv.take(live, axis=0) for kv in self.kvs]
            self.pad = self.pad.index_select(0, torch.from_numpy(live))
            owner = (used.cumsum(0) - 1).index_select(0, owner)
        self.owner = owner
        self.feed = self.model._memory_feed(self.kvs, self.pad, self.owner)


class OnnxShowAttendTell(OnnxModel):
    family = "show_attend_tell"

    def __init__(self, folder, meta=None, threads=None):
        super().__init__(folder, meta, threads)
        c = self.config
        self.image_dim = int(c.get("image_dim", 2048))
        self.ids = {k: int(c.get(k, d)) for k, d in (("bos_id", 0), ("pad_id", 1), ("eos_id", 2))}
        self.default_max_len = int(c.get("max_len", 100))

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        a, valid = context_set(batch, "image", self.image_dim)
        a, valid = a.float().cpu().contiguous(), valid.cpu().contiguous()
        wa, h, c = (torch.from_numpy(x) for x in self.run("init", {"a": a.numpy(), "valid": valid.numpy()}))
        return {"a": a, "valid": valid, "wa": wa, "h": h, "c": c}

    def step(self, tokens: torch.Tensor, s: dict[str, torch.Tensor]):
        """One word for every row: (log_probs [N, V], attention [N, cells], new state)."""
        feed = {"tokens": _np(tokens.long()), **{k: _np(s[k]) for k in ("a", "valid", "wa", "h", "c")}}
        lp, alpha, h, c = (torch.from_numpy(x) for x in self.run("step", feed))
        return lp, alpha, {**s, "h": h, "c": c}

    def _search_step(self, last: torch.Tensor, s: dict[str, torch.Tensor]):
        lp, _, s = self.step(last, s)
        return lp, s

    def generate(self, batch: dict[str, Any], max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, min_len: int = 1, no_repeat_ngram_size: int = 0,
                 return_attention: bool = False, n_best: int = 1) -> dict[str, Any]:
        """Greedy or beam search, as :meth:`ShowAttendTell.generate`; ``return_attention``: the
        weights over the image grid of every generated token (EOS included)."""
        s = self.encode(batch)
        n = s["a"].shape[0]
        out = search(self._search_step, s, n, bos_id=self.ids["bos_id"], eos_id=self.ids["eos_id"],
                     pad_id=self.ids["pad_id"], max_len=max_len or self.default_max_len, beam_size=beam_size,
                     length_penalty=length_penalty, min_len=min_len, no_repeat_ngram_size=no_repeat_ngram_size,
                     n_best=n_best, device=torch.device("cpu"))
        if return_attention:
            out["attention"] = self._attention(s, out["tokens"])
        return out

    def _attention(self, s: dict[str, torch.Tensor], tokens: list[list[int]]) -> list:
        """The captions fed back through the step graph (all at once, teacher forced)."""
        n, steps = len(tokens), max(len(t) for t in tokens) + 1
        fed = torch.full((n, steps), self.ids["pad_id"], dtype=torch.long)
        fed[:, 0] = self.ids["bos_id"]
        for b, toks in enumerate(tokens):
            fed[b, 1: len(toks) + 1] = torch.tensor(toks, dtype=torch.long)
        alphas = []
        for t in range(steps):
            _, alpha, s = self.step(fed[:, t], s)
            alphas.append(alpha)
        alpha = torch.stack(alphas, 1)
        return [attention_lists({"image": alpha}, {"image": s["valid"]}, b, len(toks) + 1)
                for b, toks in enumerate(tokens)]


class OnnxImageEncoder:
    """Stands for a captioning bundle's frozen image encoder (``bundle.image_encoder``): the same
    pre-processing, the grid computed by the exported graph."""

    follows_train_mode = False
    training = False

    def __init__(self, encoder, model: OnnxModel):
        self.torch_encoder = encoder
        self.name, self.out_dim, self.preprocess = encoder.name, encoder.out_dim, encoder.preprocess
        self.backbone = encoder.backbone  # only its device is read
        self.model = model
        self.size = list(model.manifest.get("image_size") or [])

    def transform_for(self, resample: str | None = None):
        return self.torch_encoder.transform_for(resample)

    def __call__(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.size and list(pixels.shape[-2:]) != self.size:
            raise TellkitError(f"the exported image encoder reads {self.size[0]} x {self.size[1]} pixels, "
                               f"got {tuple(pixels.shape[-2:])}")
        grid = torch.from_numpy(self.model.run("image_encoder", {"pixels": _np(pixels.float())})[0])
        return grid, torch.ones(grid.shape[:2], dtype=torch.bool)

    def encode(self, images, resample: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self(self.transform_for(resample).batch(list(images)))

    def train(self, mode: bool = True):
        return self

    def to(self, device):
        if torch.device(device).type != "cpu":
            raise TellkitError("the ONNX runtime runs on the CPU")
        return self


MODELS = {"bttr": OnnxBTTR, "show_attend_tell": OnnxShowAttendTell}


def open_model(folder: str | os.PathLike, meta: dict[str, Any] | None = None, threads: int | None = None):
    """The runtime model of an ONNX folder (:class:`OnnxBTTR` or :class:`OnnxShowAttendTell`)."""
    meta = read_checkpoint_config(folder) if meta is None else meta
    cls = MODELS.get(meta.get("family"))
    if cls is None:
        raise TellkitError(f"{folder}: no ONNX runtime for '{meta.get('family')}' models")
    return cls(folder, meta, threads)
