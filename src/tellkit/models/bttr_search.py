"""BTTR's approximate joint search, batched over images and beams, with key/value caching.

Zhao et al., ICDAR 2021, section 3.4: beam search left-to-right and right-to-left, score every
hypothesis with the opposite direction (teacher forced, the reversed hypothesis as target), add
both log-probabilities, divide by length**alpha, keep the best of the 2k.

The beam follows the reference's rule: at each step the top ``k - finished`` continuations
are kept; those ending in the end token are finished, the rest stay live (the beam shrinks),
until ``k`` are finished or ``max_len`` steps. The final choice is the reference's: (own score +
opposite direction's score) / len**alpha, where len is the number of predicted symbols (at
least 1) and both scores include the end token.

What differs from the reference is only how the work is laid out (the results are the same):

* every image of a batch and both directions search together; the images are encoded once,
  each distinct size without padding (``encode_by_size``), and the decoder rows of both
  directions of an image read ONE copy of its projected memory (``SharedKV``);
* the decoder holds only live hypotheses: a slot that dies (the beam shrinks as hypotheses
  finish) and a finished search leave it at once; the search keeps a [search, k] table of which
  decoder row holds each slot, and dead slots score -inf;
* the self-attention keys/values are cached (``use_cache=False`` recomputes every prefix like
  the reference, with one copy of the memory per row);
* the rescoring pass runs all hypotheses of the batch at once against the shared memory.

Under ``torch.autocast`` (bfloat16 on CPUs that have it) the matrix products run in 16 bits;
log-probabilities, scores and the softmax of attention stay float32.

The model supplies ``encode`` / ``encode_by_size``, ``incremental`` (a
:class:`tellkit.decoding.state.IncrementalDecoder`, the same protocol as every other decoder's
search) and ``sequence_logprob`` (see :class:`tellkit.models.bttr.BTTR`).
"""
from __future__ import annotations

from typing import Any

import torch

from tellkit.data.latex import EOS_ID as EOS
from tellkit.data.latex import PAD_ID as PAD
from tellkit.data.latex import SOS_ID as SOS
from tellkit.decoding.runaway import RunawayStop

NEG = float("-inf")


@torch.no_grad()
def beam_search(model, memory: torch.Tensor, memory_mask: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                beam_size: int, max_len: int, use_cache: bool = True, owner: torch.Tensor | None = None,
                incomplete: set | None = None, stop: RunawayStop | None = None) -> list[list[tuple[list[int], float]]]:
    """Batched beam search for N independent searches.

    ``start`` / ``end`` [N]: first token and end token per search (so both directions can share
    a batch); ``owner`` [N]: the row of ``memory`` search i reads (default: row i). Searches of
    one memory row should be consecutive (their decoder rows then share it without gathering).
    Padding and the start token are never generated. Returns, per search, up to ``beam_size``
    (tokens without start/end, sum of log-probabilities including the end token). A search
    that ends without one (``max_len``, a runaway) keeps its best live hypothesis, whose score
    has no end token; ``incomplete``, when given, receives (search, tuple(tokens)) of those.
    ``stop``: a runaway policy (:mod:`tellkit.decoding.runaway`) that ends a search early; None:
    every search runs until it finishes or reaches ``max_len``."""
    n, k = start.shape[0], beam_size
    dev = memory.device
    owner = torch.arange(n, device=dev) if owner is None else owner.to(dev)
    # decoder rows hold live hypotheses only, in (search, slot) order; at first one per search
    decoder = model.incremental(memory, memory_mask, owner, use_cache=use_cache)
    prefix = start.to(dev)[:, None]  # [rows, t]
    scores = torch.full((n, k), NEG, device=dev)
    scores[:, 0] = 0.0
    slot_row = torch.full((n, k), -1, dtype=torch.long, device=dev)  # decoder row of each slot, -1: dead
    slot_row[:, 0] = torch.arange(n, device=dev)
    end_k = end.to(dev)[:, None]
    alive = list(range(n))  # global ids of the running searches, in order
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(n)]
    ar = torch.arange(k, device=dev)[None]
    for _ in range(max_len):
        m = len(alive)
        lp = decoder.step(prefix)  # [rows, V], float32
        v = lp.shape[-1]
        lp[:, PAD] = NEG  # never generate padding or the direction's own start token
        lp.scatter_(1, prefix[:, :1], NEG)
        live = slot_row.view(-1) >= 0
        cand = lp.new_full((m * k, v), NEG)  # [slots, V]; the rows are the live slots in order
        cand[live] = scores.view(-1)[live, None] + lp
        top, pos = cand.view(m, k * v).topk(k, dim=1)  # best first
        beam, tok = pos // v, pos % v
        # the reference keeps only the best (k - finished) continuations
        nfin = torch.tensor([len(finished[g]) for g in alive], device=dev)
        top = top.masked_fill(ar >= (k - nfin)[:, None], NEG)
        is_end = (tok == end_k) & (top > NEG)
        parent = slot_row.gather(1, beam)  # [m, k] decoder row each candidate continues
        if bool(is_end.any()):
            for i, j in is_end.nonzero().tolist():
                finished[alive[i]].append((prefix[int(parent[i, j]), 1:].tolist(), float(top[i, j])))
            top = top.masked_fill(is_end, NEG)
        going = (top > NEG).any(1).tolist()  # (the best slot may just have finished)
        keep = [i for i, g in enumerate(alive) if len(finished[g]) < k and going[i]]
        if not keep:
            alive = []
            break
        if len(keep) < m:  # finished searches leave the decoder
            kt = torch.tensor(keep, device=dev)
            parent, tok, top, end_k = parent[kt], tok[kt], top[kt], end_k[kt]
            alive = [alive[i] for i in keep]
        new_live = top > NEG  # [m', k]: the slots that go on; dead ones leave the decoder
        rows = parent[new_live]
        slot_row = torch.full_like(parent, -1)
        slot_row[new_live] = torch.arange(rows.numel(), device=dev)
        prefix = torch.cat([prefix.index_select(0, rows), tok[new_live][:, None]], 1)
        decoder.reorder(rows)
        scores = top
        if stop is not None:  # a runaway search ends like one at max_len: its best live hypothesis
            slots = prefix.new_zeros(len(alive) * k, prefix.shape[1] - 1)
            slots[new_live.view(-1)] = prefix[:, 1:]
            for i in stop.stopped(slots.view(len(alive), k, -1), scores).nonzero()[:, 0].tolist():
                j = int(scores[i].argmax())
                if not finished[alive[i]]:
                    _unfinished(finished, incomplete, alive[i], prefix[int(slot_row[i, j]), 1:], scores[i, j])
                scores[i] = NEG  # its rows leave at the next step
    # max_len reached: a search with nothing finished keeps its best live hypothesis
    for i, g in enumerate(alive):
        j = int(scores[i].argmax())
        if not finished[g] and bool(scores[i, j] > NEG):
            _unfinished(finished, incomplete, g, prefix[int(slot_row[i, j]), 1:], scores[i, j])
    return finished


def _unfinished(finished: list, incomplete: set | None, search: int, tokens: torch.Tensor, score) -> None:
    toks = tokens.tolist()
    finished[search].append((toks, float(score)))
    if incomplete is not None:
        incomplete.add((search, tuple(toks)))


@torch.no_grad()
def joint_search(model, image: torch.Tensor, image_mask: torch.Tensor | None = None, *, beam_size: int = 10,
                 max_len: int = 200, alpha: float = 1.0, bidirectional: bool = True, rescore: bool = True,
                 use_cache: bool = True, stop: RunawayStop | None = None) -> dict[str, Any]:
    """-> {"tokens": per image the best hypothesis (left-to-right, no sos/eos), "scores": its score}.

    ``bidirectional=False, rescore=False`` is plain left-to-right beam search (its score is the
    sum of log-probabilities, not normalised); with ``beam_size=1`` that is greedy decoding.
    ``stop``: the runaway policy that ends a search early (see :func:`beam_search`)."""
    encode = getattr(model, "encode_by_size", model.encode)
    memory, mmask = encode(image, image_mask)
    b = memory.shape[0]
    dirs = 2 if bidirectional else 1
    dev = memory.device
    # searches image by image: image i left-to-right at dirs * i, right-to-left at dirs * i + 1
    owner = torch.arange(b, device=dev).repeat_interleave(dirs)
    start = torch.tensor([SOS, EOS][:dirs] * b, device=dev)
    end = torch.tensor([EOS, SOS][:dirs] * b, device=dev)
    incomplete: set = set()
    hyps = beam_search(model, memory, mmask, start, end, beam_size, max_len, use_cache, owner=owner,
                       incomplete=incomplete, stop=stop)

    # per image: (own score, tokens in left-to-right order, the direction that found them)
    cands: list[list[tuple[float, list[int], int]]] = [[] for _ in range(b)]
    for r, lst in enumerate(hyps):
        i, d = divmod(r, dirs)
        cands[i] += [(s, toks if d == 0 else toks[::-1], d) for toks, s in lst]
    if not rescore:
        out = [max(c, key=lambda x: x[0]) if c else (NEG, [], 0) for c in cands]
        return {"tokens": [t for _, t, _ in out], "scores": [s for s, _, _ in out]}
    if not any(cands):
        return {"tokens": [[] for _ in range(b)], "scores": [NEG] * b}
    if dirs == 1:  # one direction: nothing to rescore with, only the length normalisation applies
        best = [max(((sc / (max(len(t), 1) ** alpha), t) for sc, t, _ in c), key=lambda x: x[0], default=(NEG, []))
                for c in cands]
    else:
        unfinished = {(r // 2, toks[:: 1 - 2 * (r % 2)], r % 2) for r, toks in incomplete}  # left-to-right
        best = choose_best(model, memory, mmask, cands, alpha, unfinished)
    return {"tokens": [t for _, t in best], "scores": [sc for sc, _ in best]}


def choose_best(model, memory: torch.Tensor, memory_mask: torch.Tensor,
                cands: list[list[tuple[float, list[int], int]]], alpha: float, incomplete: set = frozenset(),
                reuse: bool = True, prune: bool = True) -> list[tuple[float, list[int]]]:
    """Per image, the candidate (own score, tokens left-to-right, direction) with the best
    (own score + the other direction's teacher-forced score) / len**alpha, the first of equals;
    -> (that total, its tokens).

    Two shortcuts give the same choice and total (``reuse`` / ``prune`` turn them off):

    * a hypothesis both directions finished (``incomplete``: (image, tokens, direction) of those
      a search kept unfinished) already has its other score, summed step by step by that
      direction's own search: it is not scored again;
    * a log-probability is at most 0, so own score / len**alpha bounds a candidate's total:
      candidates whose bound is below a total already known cannot be chosen and are not
      scored. The most promising unknown candidate of each image is scored first."""
    tot: list[list[float | None]] = [[None] * len(c) for c in cands]
    bound = [[sc / (max(len(t), 1) ** alpha) for sc, t, _ in c] for c in cands]
    if reuse:
        for i, c in enumerate(cands):
            own = {(tuple(t), d): sc for sc, t, d in c if (i, tuple(t), d) not in incomplete}
            for j, (sc, t, d) in enumerate(c):
                other = own.get((tuple(t), 1 - d))
                if other is not None and (i, tuple(t), d) not in incomplete:
                    tot[i][j] = (sc + other) / (max(len(t), 1) ** alpha)

    def best_known(i: int) -> float:
        return max((x for x in tot[i] if x is not None), default=NEG)

    def score(todo: list[tuple[int, int]]) -> None:
        if not todo:
            return
        opp = rescore_opposite(model, memory, memory_mask, [(i, cands[i][j][1], cands[i][j][2]) for i, j in todo])
        for (i, j), o in zip(todo, opp):
            tot[i][j] = (cands[i][j][0] + o) / (max(len(cands[i][j][1]), 1) ** alpha)

    def open_(i: int) -> list[int]:
        floor = best_known(i) if prune else NEG
        return [j for j in range(len(cands[i])) if tot[i][j] is None and (not prune or bound[i][j] >= floor)]

    if prune:  # first the best bound of each image, then whatever can still beat what is known
        score([(i, max(js, key=lambda j: bound[i][j])) for i in range(len(cands)) if (js := open_(i))])
    score([(i, j) for i in range(len(cands)) for j in open_(i)])
    out = []
    for i, c in enumerate(cands):
        best = (NEG, [])
        for j, (_, t, _) in enumerate(c):
            if tot[i][j] is not None and tot[i][j] > best[0]:
                best = (tot[i][j], t)
        out.append(best)
    return out


def rescore_opposite(model, memory: torch.Tensor, memory_mask: torch.Tensor,
                     items: list[tuple[int, list[int], int]], positions_per_pass: int = 8192) -> list[float]:
    """log p(hypothesis) under the direction that did not find it, teacher forced with both end
    tokens, for ``items`` (image, tokens left-to-right, the direction that found them). They run
    sorted by length in passes of about ``positions_per_pass`` tokens (short hypotheses are not
    padded to the longest), against the memory shared by the rows of each image."""
    dev = memory.device
    out = [0.0] * len(items)
    # scored by direction 1 - d: left-to-right reads <sos> y <eos>, right-to-left <eos> reversed y <sos>
    todo = sorted(((j, i, [SOS, *t, EOS] if d == 1 else [EOS, *t[::-1], SOS]) for j, (i, t, d) in enumerate(items)),
                  key=lambda x: len(x[2]))
    a = 0
    while a < len(todo):
        z = a + 1  # the longest pass whose padded size stays within the budget (at least one row)
        while z < len(todo) and (z + 1 - a) * (len(todo[z][2]) - 1) <= positions_per_pass:
            z += 1
        part = todo[a:z]
        t_max = len(part[-1][2]) - 1
        rows = torch.full((len(part), t_max + 1), PAD, dtype=torch.long)
        for r, (_, _, q) in enumerate(part):
            rows[r, : len(q)] = torch.tensor(q)
        rows = rows.to(dev)
        # inputs <start> y, targets y <end>: the last token of each sequence is only a target
        lengths = torch.tensor([len(q) - 1 for _, _, q in part], device=dev)
        inp = rows[:, :-1].masked_fill(torch.arange(t_max, device=dev)[None] >= lengths[:, None], PAD)
        owner = torch.tensor([i for _, i, _ in part], device=dev)
        scores = model.sequence_logprob(inp, rows[:, 1:], memory, memory_mask, owner=owner).tolist()
        for (jj, _, _), sc in zip(part, scores):
            out[jj] = sc
        a = z
    return out
