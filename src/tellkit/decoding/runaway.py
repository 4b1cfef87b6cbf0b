r"""Stopping a search whose output has run away, instead of letting it run to ``max_len``.

A model shown something it cannot read (random noise, a photo given to a formula reader) may
keep emitting tokens until the length limit: 200 tokens at beam 10 in both directions cost BTTR
4-11 s of CPU for an answer that is noise anyway. :class:`RunawayStop` says when every live
hypothesis of a search has run away:

* its score fell through the floor: the best live hypothesis averages less than ``floor`` nats
  per generated token (checked once it has ``after`` tokens);
* it repeats itself: every live hypothesis ends in the same token ``max_repeat`` times in a row;
* it cycles through a few tokens: in the last ``window`` tokens of every live hypothesis there
  are at most ``max_distinct`` different tokens, or one token makes up at least ``max_share`` of
  them. (The packaged BTTR model reads random noise with confidence, about -0.1 to -0.6 nats per
  token, as ``| ) | ( | ) | ( ...`` or ``| | | ...``: 1 to 4 different tokens in 32, one of
  them half or more. Among the 8,835 CROHME training expressions, every 32 consecutive tokens hold
  at least 7 different ones, none more than 10 times, and no token repeats more than 8 times.)
* it nests deeper than its training data ever does (``max_depth``, off unless the caller names
  the ids of its opening and closing brackets): a later BTTR model reads noise as ever deeper
  ``\sqrt { ( \sqrt { | } ...`` groups, 12 deep by 98 tokens, varied enough to pass the cycle
  test; no CROHME training expression nests more than 5 deep (``{ [ (`` against ``} ] )``). A
  right-to-left hypothesis meets the closers first, so the depth is the largest absolute running
  count either way.

A search that is stopped keeps what it has finished, else its best live hypothesis as it stands
(the caller decides; BTTR's joint search, :mod:`tellkit.models.bttr_search`, treats it like a
search that reached ``max_len``). The policy is a generation setting, like a stopping criterion:
a search applies the one it is given (``stop=`` of ``model.generate``), and a task whose
generation config has ``stop_runaways`` on builds it for its vocabulary (recognition:
:func:`latex_policy`, judged on the best live hypothesis), so evaluation, the commands, the server
and ``tellkit.pipeline`` stop the same searches and give the same answers. The rules are set far from
real handwriting (docs/server.md gives what they were measured on).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RunawayStop:
    floor: float = -2.5     # nats per generated token of the best live hypothesis
    after: int = 8          # tokens generated before the floor is checked
    max_repeat: int = 32    # the same token this many times at the end of every live hypothesis
    window: int = 32        # the last tokens in which ...
    max_distinct: int = 4   # ... this few different tokens, or
    max_share: float = 0.5  # ... one token this often (a fraction of the window), is a cycle
    best_only: bool = False  # repeats and cycles: of the best live hypothesis alone (not of every one)
    max_depth: int = 0      # brackets open at once beyond this is runaway (0: not checked)
    openers: tuple[int, ...] = ()  # token ids that open a group ...
    closers: tuple[int, ...] = ()  # ... and those that close one

    def __post_init__(self):
        if not (math.isfinite(self.floor) and self.floor < 0):
            raise ValueError(f"floor must be a finite negative number of nats per token, got {self.floor}")
        if int(self.after) < 1 or int(self.max_repeat) < 2 or int(self.window) < 2 or int(self.max_distinct) < 1:
            raise ValueError("after, window and max_distinct must be >= 1 (window >= 2) and max_repeat >= 2")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {self.max_share}")
        if int(self.max_depth) < 0 or (self.max_depth and not (self.openers and self.closers)):
            raise ValueError("max_depth must be >= 0, and a depth check needs openers and closers")

    def stopped(self, tokens: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``tokens`` [m, k, t]: the generated tokens of the k beams of m searches (no start
        token); ``scores`` [m, k]: their summed log-probabilities, -inf for dead beams.
        -> bool [m]: the searches whose every live hypothesis has run away."""
        m, k, t = tokens.shape
        live = scores > float("-inf")
        out = torch.zeros(m, dtype=torch.bool, device=scores.device)
        if t >= self.after:
            best = scores.masked_fill(~live, float("-inf")).max(1).values
            out |= live.any(1) & (best < self.floor * t)
        best_row = scores.masked_fill(~live, float("-inf")).argmax(1, keepdim=True)  # [m, 1]
        if t >= self.max_repeat:
            tail = tokens[:, :, -self.max_repeat:]
            same = (tail == tail[:, :, -1:]).all(-1)  # [m, k]
            out |= live.any(1) & self._all_or_best(same, live, best_row)
        if t >= self.window:
            tail = tokens[:, :, -self.window:].reshape(m * k, -1).long()
            counts = torch.zeros(m * k, int(tail.max()) + 1, device=tail.device).scatter_add_(
                1, tail, torch.ones_like(tail, dtype=torch.float))
            cycle = ((counts > 0).sum(1) <= self.max_distinct) | (counts.max(1).values >= self.max_share * self.window)
            out |= live.any(1) & self._all_or_best(cycle.view(m, k), live, best_row)
        if self.max_depth and t > self.max_depth:
            step = torch.isin(tokens, self._ids(self.openers, tokens)).to(torch.int32) \
                - torch.isin(tokens, self._ids(self.closers, tokens)).to(torch.int32)
            deep = step.cumsum(-1).abs().amax(-1) > self.max_depth  # [m, k]
            out |= live.any(1) & self._all_or_best(deep, live, best_row)
        return out

    @staticmethod
    def _ids(ids: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(ids, dtype=like.dtype, device=like.device)

    def _all_or_best(self, flag: torch.Tensor, live: torch.Tensor, best_row: torch.Tensor) -> torch.Tensor:
        """[m, k] -> [m]: every live hypothesis flagged, or (``best_only``) the best live one."""
        if self.best_only:
            return flag.gather(1, best_row)[:, 0]
        return (flag | ~live).all(1)


# LaTeX groups: no CROHME training expression nests more than 5 deep; noise read by a trained
# model can go on nesting until the length limit
LATEX_MAX_DEPTH = 8
LATEX_OPENERS = ("{", "[", "(")
LATEX_CLOSERS = ("}", "]", ")")


def latex_policy(stoi: dict[str, int], **options) -> RunawayStop:
    """A :class:`RunawayStop` that also checks the nesting of LaTeX groups, for a vocabulary
    ``stoi`` (token -> id; without both kinds of bracket the depth is not checked); ``options``:
    the other fields."""
    openers = tuple(stoi[t] for t in LATEX_OPENERS if t in stoi)
    closers = tuple(stoi[t] for t in LATEX_CLOSERS if t in stoi)
    if not (openers and closers):
        return RunawayStop(**options)
    return RunawayStop(max_depth=LATEX_MAX_DEPTH, openers=openers, closers=closers, **options)
