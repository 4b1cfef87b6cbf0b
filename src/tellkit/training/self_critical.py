"""Self-critical sequence training (Rennie et al. 2017, "Self-critical Sequence Training for Image
Captioning"), as the reference implementation (ruotianluo/self-critical.pytorch) runs it: after
cross-entropy training, the captioner is trained on the score of captions it writes itself.

For every image of a batch the model draws ``samples`` captions in training mode (dropout on);
each is scored with CIDEr-D against the image's references (:class:`tellkit.metrics.cider_d.CiderD`,
document frequencies from the training references); a caption's advantage is its reward minus a
baseline, either the mean reward of the image's other drawn captions (Luo 2020, "A Better Variant
of Self-Critical Sequence Training") or the reward of the image's greedy caption (the original,
drawn in eval mode). The policy-gradient loss is ``-sum (r - b) log p(w_t)`` over the drawn
tokens (EOS included), divided by their number.

- **The log-probabilities come from the pass that drew the captions** (the reference's
  ``sample_logprobs``): the model's ``draw`` keeps the graph of its sampling pass, so the
  gradient is the policy gradient of the captions actually drawn under the dropout masks that
  drew them. Models without ``draw`` (Transform and Tell) re-read the drawn captions in a second,
  teacher-forced pass (fresh dropout masks; exact only without dropout).
- **The reward reads EOS**: as the reference's ``array_to_str``, a caption that ended by drawing
  EOS is scored with an end word (:data:`tellkit.metrics.cider_d.EOS_WORD`) appended, and so are
  the references and the document frequencies (its ``prepro_ngrams``); a caption cut at
  ``max_len`` without EOS has none, so complete captions gain against truncated ones.
- **The cross-entropy mix** (``xe_weight`` = w > 0) is the reference's
  ``(1 - structure_loss_weight) * lm_loss + structure_loss_weight * struc_loss``:
  ``w * XE + (1 - w) * PG``, XE being the token-mean cross-entropy of **all** the image's
  reference captions (the reference's ``seq_per_img`` = 5) and PG the token-mean policy term.
- **No attention penalty**: Rennie et al. have none; Show, Attend and Tell's doubly stochastic
  term is not part of the self-critical loss (its cross-entropy part included).

The trainer (:mod:`tellkit.training.loop`) is unchanged: :meth:`SelfCritical.batch` (the task's
``training_batch``) hands the model a batch whose ``self_critical`` entry computes this loss inside
the model's forward (so mixed precision covers the sampling pass too).

A recipe turns it on with an ``scst:`` section (:class:`tellkit.recipes.SelfCriticalConfig`)
and starts from a cross-entropy checkpoint (``train.init_from``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tellkit.errors import TellkitError
from tellkit.metrics.cider_d import EOS_WORD, CiderD, prepare
from tellkit.recipes import SelfCriticalConfig

# batch entries that are one value per image but not tensors (repeated per drawn caption)
_PER_IMAGE_LISTS = ("ids", "image_ids", "references")


def reward_text(text: str, finished: bool = True, lowercase: bool = True) -> str:
    """The text the reward scores: normalised (:func:`prepare`), with the end word when the
    caption ended by EOS (references always do)."""
    text = prepare(text, lowercase)
    return f"{text} {EOS_WORD}".strip() if finished else text


class SelfCritical:
    """Turns a collated caption batch into the self-critical loss of captions the model draws.

    ``reward``: the CIDEr-D scorer (its corpus prepared with :func:`reward_text`); ``decode``:
    caption token ids -> text; ``encode``: text -> token ids (the references' cross-entropy;
    ``max_caption_tokens`` cuts them as the training data does); ``bos_id`` / ``eos_id`` /
    ``pad_id``: the caption vocabulary's special ids."""

    def __init__(self, cfg: SelfCriticalConfig, reward: CiderD, decode: Callable[[list[int]], str], *,
                 bos_id: int, eos_id: int, pad_id: int, encode: Callable[[str], list[int]] | None = None,
                 max_caption_tokens: int | None = None, generator: torch.Generator | None = None):
        if not 0 <= cfg.xe_weight < 1:
            raise TellkitError(f"scst.xe_weight is the cross-entropy's share of the loss, in [0, 1), "
                               f"got {cfg.xe_weight}")
        if cfg.xe_weight > 0 and encode is None:
            raise TellkitError("scst.xe_weight > 0 needs the caption tokenizer (encode)")
        self.cfg, self.reward, self.decode, self.encode = cfg, reward, decode, encode
        self.max_caption_tokens = max_caption_tokens
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.generator = generator
        # running sums since the last read (:meth:`take_stats`)
        self._sum = {"reward": 0.0, "baseline": 0.0, "length": 0.0}
        self._n = 0

    @classmethod
    def for_references(cls, cfg: SelfCriticalConfig, train_references: Sequence[Sequence[str]], tokenizer, *,
                       max_caption_tokens: int | None = None, seed: int = 1) -> SelfCritical:
        """The trainer of a captioning task: CIDEr-D with the document frequencies of the
        training references (one list per image, each with the end word), ``tokenizer``'s
        ``encode`` / ``decode`` and special ids."""
        reward = CiderD([[reward_text(r, True, cfg.lowercase) for r in refs] for refs in train_references])
        return cls(cfg, reward, tokenizer.decode, encode=tokenizer.encode, max_caption_tokens=max_caption_tokens,
                   bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                   generator=torch.Generator().manual_seed(int(seed)))

    # -- the reward ---------------------------------------------------------------------------
    def score(self, token_lists: Sequence[list[int]], references: Sequence[Sequence[str]],
              finished: Sequence[bool] | None = None) -> list[float]:
        """CIDEr-D of each caption against its references (``references``: one list per caption;
        a list shared by several captions is prepared once). ``finished[i]``: caption i ended by
        drawing EOS (default: all did)."""
        lc = self.cfg.lowercase
        prepared: dict[int, list[str]] = {}
        scores = []
        for i, (t, refs) in enumerate(zip(token_lists, references)):
            ready = prepared.get(id(refs))
            if ready is None:
                ready = prepared[id(refs)] = [reward_text(r, True, lc) for r in refs]
            done = True if finished is None else bool(finished[i])
            scores.append(self.reward.score(reward_text(self.decode(t), done, lc), ready))
        return scores

    def advantages(self, model: nn.Module, batch: dict[str, Any], drawn: dict[str, Any]) -> torch.Tensor:
        """Reward minus baseline of each drawn caption [B * K] (rows of image b consecutive)."""
        cfg, K = self.cfg, int(self.cfg.samples)
        refs = batch["references"]
        B = len(refs)
        rewards = torch.tensor(self.score(drawn["tokens"], [r for r in refs for _ in range(K)], drawn.get("finished")),
                               dtype=torch.float32).view(B, K)
        if cfg.baseline == "mean":
            baseline = (rewards.sum(1, keepdim=True) - rewards) / (K - 1)
        else:
            greedy = self._greedy(model, batch)
            baseline = torch.tensor(self.score(greedy["tokens"], refs, greedy.get("finished")),
                                    dtype=torch.float32)[:, None].expand(B, K)
        self._sum["reward"] += float(rewards.mean()) * B
        self._sum["baseline"] += float(baseline.mean()) * B
        self._sum["length"] += sum(len(t) for t in drawn["tokens"]) / K
        self._n += B
        return (rewards - baseline).reshape(-1)

    def _greedy(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        """The image's greedy caption in eval mode (the reference's ``sc_sample_method: greedy``),
        cut at ``max_len`` like the drawn ones."""
        cfg = self.cfg
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                if hasattr(model, "draw"):
                    return model.draw(batch, num_samples=1, max_len=cfg.max_len, min_len=cfg.min_len, greedy=True)
                return model.generate(batch, max_len=cfg.max_len, min_len=cfg.min_len, beam_size=1)
        finally:
            model.train(was_training)

    # -- the batch the training step reads -------------------------------------------------------
    def batch(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        if hasattr(model, "draw") and hasattr(model, "caption_log_probs"):
            return {**batch, "self_critical": self.loss}
        if not hasattr(model, "sample"):
            raise TellkitError(f"scst: the '{getattr(model, 'family', type(model).__name__)}' model cannot draw "
                               "captions (no sample()); self-critical training needs Transform and Tell or "
                               "Show, Attend and Tell")
        return self.rescored_batch(model, batch)

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The self-critical loss of ``batch``'s images (called from the model's forward):
        captions drawn with the graph kept, their advantages, ``w * XE + (1 - w) * PG``."""
        cfg = self.cfg
        drawn = model.draw(batch, num_samples=int(cfg.samples), max_len=cfg.max_len, min_len=cfg.min_len,
                           temperature=cfg.temperature, generator=self.generator)
        adv = self.advantages(model, batch, drawn).to(drawn["log_probs"].device)
        mask = drawn["mask"]
        n_pg = mask.sum()
        pg = -(adv[:, None] * drawn["log_probs"] * mask).sum() / n_pg.clamp(min=1)
        out: dict[str, torch.Tensor] = {"policy_loss": pg.detach()}
        ntokens = n_pg
        loss = pg
        if cfg.xe_weight > 0:
            refs = self.reference_batch(batch)
            lp, ref_mask = model.caption_log_probs(refs)
            n_xe = ref_mask.sum()
            xe = -(lp * ref_mask).sum() / n_xe.clamp(min=1)
            loss = cfg.xe_weight * xe + (1.0 - cfg.xe_weight) * pg
            ntokens = ntokens + n_xe
            out["xe_loss"] = xe.detach()
        return {**out, "loss": loss, "ntokens": ntokens}

    def reference_captions(self, references: Sequence[Sequence[str]], device=None) -> torch.Tensor:
        """Every reference of every image as BOS + ids + EOS rows, padded [sum of counts, T]
        (cut at ``max_caption_tokens`` as the training data is)."""
        keep = self.max_caption_tokens
        rows = [[self.bos_id, *(self.encode(r)[:keep] if keep else self.encode(r)), self.eos_id]
                for refs in references for r in refs]
        cap = torch.full((len(rows), max(len(r) for r in rows)), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            cap[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return cap.to(device)

    def reference_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` with one row per reference caption (all five of a Flickr8k photo), the
        image's contexts repeated."""
        refs = batch["references"]
        counts = torch.tensor([len(r) for r in refs])
        device = batch["caption"].device
        out = _per_row(batch, len(refs), lambda k, v: v.repeat_interleave(counts.to(v.device), dim=0),
                       lambda k, v: [x for x, n in zip(v, counts.tolist()) for _ in range(n)])
        out["caption"] = self.reference_captions(refs, device)
        return out

    # -- models without draw(): a second, teacher-forced pass over the drawn captions --------------
    def rescored_batch(self, model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch of the ``B * K`` drawn captions (and, with ``xe_weight``, of the images'
        references) whose ``sequence_weights`` make the model's weighted token mean equal
        ``w * XE + (1 - w) * PG``."""
        cfg, K = self.cfg, int(self.cfg.samples)
        drawn = model.sample(batch, num_samples=K, max_len=cfg.max_len, min_len=cfg.min_len,
                             temperature=cfg.temperature, generator=self.generator)
        adv = self.advantages(model, batch, drawn)
        out = self.expand(batch, drawn["tokens"], adv, K)
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
        """``drawn`` with every reference caption of ``batch``'s images appended, the weights
        rescaled so that one token mean over all rows is ``weight * XE + (1 - weight) * PG``."""
        refs = self.reference_batch(batch)
        cap, w = drawn["caption"], drawn["sequence_weights"]
        ref = refs["caption"]
        n_pg = float((cap[:, 1:] != self.pad_id).sum())
        n_xe = float((ref[:, 1:] != self.pad_id).sum())
        total = n_pg + n_xe
        T = max(cap.size(1), ref.size(1))
        pad = lambda x: torch.nn.functional.pad(x, (0, T - x.size(1)), value=self.pad_id)  # noqa: E731
        out = _per_row(drawn, cap.size(0), lambda k, v: torch.cat([v, refs[k]]), lambda k, v: [*v, *refs[k]])
        out["caption"] = torch.cat([pad(cap), pad(ref)])
        out["sequence_weights"] = torch.cat([w * ((1.0 - weight) * total / n_pg),
                                             torch.full((ref.size(0),), weight * total / n_xe, dtype=w.dtype,
                                                        device=w.device)])
        return out

    def take_stats(self) -> dict[str, float]:
        """Mean reward of the drawn captions since the last call, their mean ``length`` (BPE
        tokens) and the greedy baseline's mean reward when it is the baseline; empty if none."""
        if not self._n:
            return {}
        stats = {k: v / self._n for k, v in self._sum.items()}
        if self.cfg.baseline == "mean":  # the mean of the others averages to the mean reward itself
            del stats["baseline"]
        self._sum = {"reward": 0.0, "baseline": 0.0, "length": 0.0}
        self._n = 0
        return stats


def _per_row(batch: dict[str, Any], rows: int, tensor_op, list_op) -> dict[str, Any]:
    """``batch`` with ``tensor_op(key, value)`` applied to its tensors of ``rows`` rows and
    ``list_op(key, value)`` to its per-image lists; captions, their weights and the
    self-critical entry are left out (the caller writes them), anything else is kept as it is."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k in ("caption", "sequence_weights", "self_critical"):
            continue
        if torch.is_tensor(v) and v.dim() > 0 and v.size(0) == rows:
            out[k] = tensor_op(k, v)
        elif k in _PER_IMAGE_LISTS and isinstance(v, (list, tuple)):
            out[k] = list_op(k, v)
        else:
            out[k] = v
    return out
