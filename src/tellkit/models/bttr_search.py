"""BTTR's approximate joint search, batched over images and beams, with key/value caching.

Zhao et al., ICDAR 2021, section 3.4: beam search left-to-right and right-to-left, score every
hypothesis with the opposite direction (teacher forced, the reversed hypothesis as target), add
both log-probabilities, divide by length**alpha, keep the best of the 2k.

The beam follows the reference's rule: at each step the top ``k - finished`` continuations
are kept; those ending in the end token are finished, the rest stay live (the beam shrinks),
until ``k`` are finished or ``max_len`` steps. Here every image of a batch and both directions
run together (rows = image x direction x beam); dead slots carry a score of -inf.
The final choice is the reference's: (own score + opposite direction's score) / len**alpha,
where len is the number of predicted symbols (at least 1) and both scores include the end
token. What differs from the reference: batching and the cache (``use_cache=False`` recomputes
every prefix like the reference).

The model supplies ``encode``, ``incremental`` (a :class:`tellkit.decoding.state.IncrementalDecoder`,
the same protocol as every other decoder's search) and ``sequence_logprob`` (see
:class:`tellkit.models.bttr.BTTR`).
"""
from __future__ import annotations

from typing import Any

import torch

from tellkit.data.latex import EOS_ID as EOS
from tellkit.data.latex import PAD_ID as PAD
from tellkit.data.latex import SOS_ID as SOS
from tellkit.decoding import runaway as _runaway

NEG = float("-inf")


@torch.no_grad()
def beam_search(model, memory: torch.Tensor, memory_mask: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                beam_size: int, max_len: int, use_cache: bool = True) -> list[list[tuple[list[int], float]]]:
    """Batched beam search for N independent searches (one row of ``memory`` each).

    ``start`` / ``end`` [N]: first token and end token per search (so both directions can share
    a batch). Padding and the start token are never generated. Returns, per search, up to
    ``beam_size`` (tokens without start/end, sum of log-probabilities including the end token)."""
    n, k = memory.shape[0], beam_size
    dev = memory.device
    decoder = model.incremental(memory, memory_mask, torch.arange(n).repeat_interleave(k), use_cache=use_cache)
    prefix = start.repeat_interleave(k)[:, None]  # [m*k, t] for the m searches still running
    scores = torch.full((n, k), NEG, device=dev)
    scores[:, 0] = 0.0  # one live hypothesis at the start
    end_k = end[:, None]
    alive = list(range(n))  # global ids of the running searches, in row order
    finished: list[list[tuple[list[int], float]]] = [[] for _ in range(n)]
    ar = torch.arange(k, device=dev)[None]
    stop = _runaway.active()  # a caller may stop runaway outputs early (decoding/runaway.py)
    for _ in range(max_len):
        m = len(alive)
        lp = decoder.step(prefix)  # [m*k, V]
        v = lp.shape[-1]
        lp[:, PAD] = NEG  # never generate padding or the direction's own start token
        lp.scatter_(1, prefix[:, :1], NEG)
        top, pos = (scores.reshape(-1, 1) + lp).view(m, k * v).topk(k, dim=1)  # best first
        beam, tok = pos // v, pos % v
        # the reference keeps only the best (k - finished) continuations
        nfin = torch.tensor([len(finished[g]) for g in alive], device=dev)
        top = top.masked_fill(ar >= (k - nfin)[:, None], NEG)
        is_end = (tok == end_k) & (top > NEG)
        for i, j in is_end.nonzero().tolist():
            finished[alive[i]].append((prefix[i * k + int(beam[i, j]), 1:].tolist(), float(top[i, j])))
        top = top.masked_fill(is_end, NEG)
        live = (top > NEG).any(1).tolist()  # (the best slot may just have finished)
        keep = [i for i, g in enumerate(alive) if len(finished[g]) < k and live[i]]
        if not keep:
            alive = []
            break
        rows = (torch.arange(m, device=dev)[:, None] * k + beam)  # parent row of each new slot
        if len(keep) < m:  # drop finished searches (their rows leave the decoder too)
            kt = torch.tensor(keep, device=dev)
            rows, tok, top, end_k = rows[kt], tok[kt], top[kt], end_k[kt]
            alive = [alive[i] for i in keep]
        rows = rows.reshape(-1)
        prefix = torch.cat([prefix.index_select(0, rows), tok.reshape(-1, 1)], 1)
        decoder.reorder(rows)
        scores = top
        if stop is not None:  # a runaway search ends like one at max_len: its best live hypothesis
            for i in stop.stopped(prefix[:, 1:].view(len(alive), k, -1), scores).nonzero()[:, 0].tolist():
                j = int(scores[i].argmax())
                if not finished[alive[i]]:
                    finished[alive[i]].append((prefix[i * k + j, 1:].tolist(), float(scores[i, j])))
                scores[i] = NEG
    # max_len reached: a search with nothing finished keeps its best live hypothesis
    for i, g in enumerate(alive):
        j = int(scores[i].argmax())
        if not finished[g] and bool(scores[i, j] > NEG):
            finished[g].append((prefix[i * k + j, 1:].tolist(), float(scores[i, j])))
    return finished


@torch.no_grad()
def joint_search(model, image: torch.Tensor, image_mask: torch.Tensor | None = None, *, beam_size: int = 10,
                 max_len: int = 200, alpha: float = 1.0, bidirectional: bool = True, rescore: bool = True,
                 use_cache: bool = True) -> dict[str, Any]:
    """-> {"tokens": per image the best hypothesis (left-to-right, no sos/eos), "scores": its score}.

    ``bidirectional=False, rescore=False`` is plain left-to-right beam search (its score is the
    sum of log-probabilities, not normalised); with ``beam_size=1`` that is greedy decoding."""
    memory, mmask = model.encode(image, image_mask)
    b = memory.shape[0]
    dirs = 2 if bidirectional else 1
    dev = memory.device
    # rows: image i left-to-right at i, right-to-left at b + i
    mem = memory.repeat(dirs, 1, 1)
    mm = torch.cat([mmask] * dirs)  # (a variant's mask may keep the feature grid's shape)
    start = torch.tensor([SOS] * b + [EOS] * b, device=dev)[: dirs * b]
    end = torch.tensor([EOS] * b + [SOS] * b, device=dev)[: dirs * b]
    hyps = beam_search(model, mem, mm, start, end, beam_size, max_len, use_cache)

    if not rescore:
        out_t, out_s = [], []
        for i in range(b):
            cands = [(t, s) for t, s in hyps[i]] + ([(t[::-1], s) for t, s in hyps[b + i]] if dirs == 2 else [])
            t, s = max(cands, key=lambda c: c[1]) if cands else ([], NEG)
            out_t.append(t)
            out_s.append(s)
        return {"tokens": out_t, "scores": out_s}

    # Rescoring: every hypothesis of row r (direction d) is scored by the other direction.
    items = []  # (image, own score, tokens in left-to-right order, opposite direction)
    for r, lst in enumerate(hyps):
        d, i = divmod(r, b)
        for toks, s in lst:
            l2r = toks if d == 0 else toks[::-1]
            items.append((i, s, l2r, 1 - d if dirs == 2 else 0))
    if not items:
        return {"tokens": [[] for _ in range(b)], "scores": [NEG] * b}
    n = len(items)
    t_max = max(len(it[2]) for it in items) + 1
    inp = torch.full((n, t_max), PAD, dtype=torch.long, device=dev)
    tgt = torch.full((n, t_max), PAD, dtype=torch.long, device=dev)
    for j, (_, _, l2r, od) in enumerate(items):
        seq = l2r if od == 0 else l2r[::-1]
        s0, s1 = (SOS, EOS) if od == 0 else (EOS, SOS)
        m = len(seq)
        inp[j, 0] = s0
        if m:
            inp[j, 1 : m + 1] = torch.tensor(seq, device=dev)
            tgt[j, :m] = torch.tensor(seq, device=dev)
        tgt[j, m] = s1
    idx = torch.tensor([it[0] for it in items], device=dev)
    if dirs == 2:
        opp = model.sequence_logprob(inp, tgt, memory.index_select(0, idx), mmask.index_select(0, idx))
    else:  # one direction: nothing to rescore with, only the length normalisation applies
        opp = torch.zeros(n)
    best: list[tuple[float, list[int]]] = [(NEG, []) for _ in range(b)]
    for j, (i, s, l2r, _) in enumerate(items):
        total = (s + float(opp[j])) / (max(len(l2r), 1) ** alpha)
        if total > best[i][0]:
            best[i] = (total, l2r)
    return {"tokens": [t for _, t in best], "scores": [s for s, _ in best]}
