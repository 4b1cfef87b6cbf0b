"""Self-critical sequence training (Rennie et al. 2017, "Self-critical Sequence Training for Image
Captioning"): after cross-entropy training, the captioner is trained on the score of captions it
writes itself. For every image of a batch the model draws ``samples`` captions; each is scored
with CIDEr-D against the image's references (:class:`tellkit.metrics.cider_d.CiderD`, document
frequencies from the training references); a caption's weight is its reward minus a baseline,
either the mean reward of the image's other drawn captions (Luo 2020, "A Better Variant of
Self-Critical Sequence Training") or the reward of the image's greedy caption (the original). The
loss is the REINFORCE estimate ``-sum_t (r - b) log p(w_t)`` over the drawn captions' tokens,
divided by their number, which the model computes in its teacher-forced pass with
``batch["sequence_weights"]``; the trainer (:mod:`tellkit.training.loop`) is unchanged. With
``xe_weight`` > 0 the image's own reference caption joins the batch with that weight, so the
loss mixes in its cross-entropy (which keeps the captions fluent and long).

A recipe turns it on with an ``scst:`` section (:class:`tellkit.recipes.SelfCriticalConfig`)
and starts from a cross-entropy checkpoint (``train.init_from``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tellkit.errors import TellkitError
from tellkit.metrics.cider_d import CiderD, prepare
from tellkit.recipes import SelfCriticalConfig

# batch entries that are one value per image but not tensors (repeated per drawn caption)
_PER_IMAGE_LISTS = ("ids", "image_ids", "references")


class SelfCritical:
    """Turns a collated caption batch into the batch of drawn captions with their weights.

    ``reward``: the CIDEr-D scorer; ``decode``: caption token ids -> text; ``bos_id`` / ``eos_id`` /
    ``pad_id``: the caption vocabulary's special ids."""

    def __init__(self, cfg: SelfCriticalConfig, reward: CiderD, decode: Callable[[list[int]], str], *,
                 bos_id: int, eos_id: int, pad_id: int, generator: torch.Generator | None = None):
        self.cfg, self.reward, self.decode = cfg, reward, decode
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.generator = generator
        # running means since the last read (:meth:`take_stats`)
        self._sum = {"reward": 0.0, "baseline": 0.0}
        self._n = 0

    def score(self, token_lists: Sequence[list[int]], references: Sequence[Sequence[str]]) -> list[float]:
        """CIDEr-D of each caption against its references (``references``: one list per caption;
        a list shared by several captions is normalised once)."""
        lc = self.cfg.lowercase
        prepared: dict[int, list[str]] = {}
        scores = []
        for t, refs in zip(token_lists, references):
            ready = prepared.get(id(refs))
            if ready is None:
                ready = prepared[id(refs)] = [prepare(r, lc) for r in refs]
            scores.append(self.reward.score(prepare(self.decode(t), lc), ready))
        return scores

    def batch(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if not hasattr(model, "sample"):
            raise TellkitError(f"scst: the '{getattr(model, 'family', type(model).__name__)}' model cannot draw "
                               "captions (no sample()); self-critical training needs Transform and Tell or "
                               "Show, Attend and Tell")
        cfg, K = self.cfg, int(self.cfg.samples)
        refs = batch["references"]
        B = len(refs)
        drawn = model.sample(batch, num_samples=K, max_len=cfg.max_len, min_len=cfg.min_len,
                             temperature=cfg.temperature, generator=self.generator)
        rewards = torch.tensor(self.score(drawn["tokens"], [r for r in refs for _ in range(K)]),
                               dtype=torch.float32).view(B, K)
        if cfg.baseline == "mean":
            baseline = (rewards.sum(1, keepdim=True) - rewards) / (K - 1)
        else:
            was_training = model.training
            model.eval()
            try:
                greedy = model.generate(batch, max_len=cfg.max_len, min_len=cfg.min_len, beam_size=1)["tokens"]
            finally:
                model.train(was_training)
            baseline = torch.tensor(self.score(greedy, refs), dtype=torch.float32)[:, None].expand(B, K)
        self._sum["reward"] += float(rewards.mean()) * B
        self._sum["baseline"] += float(baseline.mean()) * B
        self._n += B
        out = self.expand(batch, drawn["tokens"], (rewards - baseline).reshape(-1), K)
        if cfg.xe_weight > 0:
            out = self.add_references(out, batch, cfg.xe_weight)
        return out

    def expand(self, batch: dict[str, Any], token_lists: Sequence[list[int]], weights: torch.Tensor,
               K: int) -> dict[str, Any]:
        """The batch of the ``B * K`` drawn captions: contexts repeated per caption, captions
        as BOS + tokens + EOS padded, ``sequence_weights`` [B * K]."""
        caption = batch["caption"]
        device = caption.device
        T = max(len(t) for t in token_lists) + 2
        cap = torch.full((len(token_lists), T), self.pad_id, dtype=torch.long)
        for i, t in enumerate(token_lists):
            cap[i, : len(t) + 2] = torch.tensor([self.bos_id, *t, self.eos_id], dtype=torch.long)
        out = _per_row(batch, caption.size(0), lambda k, v: v.repeat_interleave(K, dim=0),
                       lambda k, v: [x for x in v for _ in range(K)])
        out["caption"] = cap.to(device)
        out["sequence_weights"] = weights.to(device)
        return out

    def add_references(self, drawn: dict[str, Any], batch: dict[str, Any], weight: float) -> dict[str, Any]:
        """``drawn`` with the batch's own captions appended as rows of weight ``weight``: their
        cross-entropy joins the loss (one token mean over all rows)."""
        ref = batch["caption"]
        cap, w = drawn["caption"], drawn["sequence_weights"]
        T = max(cap.size(1), ref.size(1))
        pad = lambda x: torch.nn.functional.pad(x, (0, T - x.size(1)), value=self.pad_id)  # noqa: E731
        out = _per_row(drawn, cap.size(0), lambda k, v: torch.cat([v, batch[k]]), lambda k, v: [*v, *batch[k]])
        out["caption"] = torch.cat([pad(cap), pad(ref)])
        out["sequence_weights"] = torch.cat([w, torch.full((ref.size(0),), float(weight), dtype=w.dtype,
                                                          device=w.device)])
        return out

    def take_stats(self) -> dict[str, float]:
        """Mean reward of the drawn captions since the last call (and of the greedy baseline
        when it is the greedy caption's); empty if none."""
        if not self._n:
            return {}
        stats = {k: v / self._n for k, v in self._sum.items()}
        if self.cfg.baseline == "mean":  # the mean of the others averages to the mean reward itself
            del stats["baseline"]
        self._sum = {"reward": 0.0, "baseline": 0.0}
        self._n = 0
        return stats


def _per_row(batch: dict[str, Any], rows: int, tensor_op, list_op) -> dict[str, Any]:
    """``batch`` with ``tensor_op(key, value)`` applied to its tensors of ``rows`` rows and
    ``list_op(key, value)`` to its per-image lists; captions and their weights are left out
    (the caller writes them), anything else is kept as it is."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k in ("caption", "sequence_weights"):
            continue
        if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == rows:
            out[k] = tensor_op(k, v)
        elif k in _PER_IMAGE_LISTS and isinstance(v, (list, tuple)):
            out[k] = list_op(k, v)
        else:
            out[k] = v
    return out
