"""Batched greedy and beam search over any incremental decoder.

A decoder is a :class:`tellkit.decoding.state.IncrementalDecoder`: ``step(tokens)`` gives
float [N, V] log-probabilities of the next token for row histories ``tokens`` [N, t] (beginning
with BOS), ``reorder(index)`` replaces the rows of its state by ``state[index]`` (beam
reordering, or dropping finished rows so that later steps run on fewer rows).

Conventions: ``max_len`` counts generated tokens including EOS; returned token lists exclude
BOS and EOS. A finished beam hypothesis scores sum(log p) / length**length_penalty, with
length counting its EOS (as fairseq does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tellkit.decoding.state import IncrementalDecoder


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # length-normalised
    log_prob: float  # sum of token log-probabilities (including EOS when finished by EOS)


def _constrain(lp: torch.Tensor, step: int, *, eos_id: int, bos_id: int, pad_id: int, min_len: int,
               max_len: int) -> None:
    """In place: forbid BOS/PAD always, EOS before ``min_len`` tokens, anything but EOS at the last step."""
    lp[:, pad_id] = float("-inf")
    if bos_id != eos_id:
        lp[:, bos_id] = float("-inf")
    if step + 1 < min_len:
        lp[:, eos_id] = float("-inf")
    if step + 1 >= max_len:
        eos_col = lp[:, eos_id].clone()
        lp.fill_(float("-inf"))
        lp[:, eos_id] = eos_col


def _ban_repeated_ngrams(lp: torch.Tensor, tokens: torch.Tensor, n: int, start: int = 1) -> None:
    """In place: forbid any token that would repeat an n-gram already in the row's history."""
    if n <= 0 or tokens.size(1) - start < n - 1:
        return
    for row, hist in enumerate(tokens[:, start:].tolist()):
        if len(hist) < n - 1:
            continue
        prefix = tuple(hist[len(hist) - (n - 1):]) if n > 1 else ()
        banned = [hist[i + n - 1] for i in range(len(hist) - n + 1) if tuple(hist[i:i + n - 1]) == prefix]
        if banned:
            lp[row, banned] = float("-inf")


def _token_by_token(decoder: IncrementalDecoder, batch_size: int, choose, *, bos_id: int, eos_id: int, pad_id: int,
                    max_len: int, min_len: int, no_repeat_ngram_size: int,
                    device: torch.device | str) -> list[Hypothesis]:
    """One token per row and step, ``choose(log_probs) -> tokens`` picking it from the
    constrained log-probabilities; finished rows are dropped from the decoder. ``log_prob``
    sums the chosen tokens' log-probabilities (EOS included)."""
    tokens = torch.full((batch_size, 1), bos_id, dtype=torch.long, device=device)
    alive = torch.arange(batch_size, device=device)  # batch index of each decoder row
    out_tokens: list[list[int]] = [[] for _ in range(batch_size)]
    out_lp = [0.0] * batch_size
    for step in range(max_len):
        lp = decoder.step(tokens).float()
        _constrain(lp, step, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id, min_len=min_len, max_len=max_len)
        _ban_repeated_ngrams(lp, tokens, no_repeat_ngram_size)
        chosen = choose(lp)
        chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
        for b, tok, tok_lp in zip(alive.tolist(), chosen.tolist(), chosen_lp.tolist()):
            out_lp[b] += tok_lp
            if tok != eos_id:
                out_tokens[b].append(tok)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        done = chosen == eos_id
        if done.any():
            keep = (~done).nonzero(as_tuple=True)[0]
            if keep.numel() == 0:
                break
            decoder.reorder(keep)
            tokens, alive = tokens[keep], alive[keep]
    return [Hypothesis(t, lp / max(len(t) + 1, 1), lp) for t, lp in zip(out_tokens, out_lp)]


@torch.no_grad()
def greedy_search(decoder: IncrementalDecoder, batch_size: int, *, bos_id: int, eos_id: int, pad_id: int,
                  max_len: int, min_len: int = 1, no_repeat_ngram_size: int = 0,
                  device: torch.device | str = "cpu") -> list[Hypothesis]:
    """Pick the most likely token at every step. Finished rows are dropped from the decoder."""
    return _token_by_token(decoder, batch_size, lambda lp: lp.argmax(dim=-1), bos_id=bos_id, eos_id=eos_id,
                           pad_id=pad_id, max_len=max_len, min_len=min_len,
                           no_repeat_ngram_size=no_repeat_ngram_size, device=device)


@torch.no_grad()
def beam_search(decoder: IncrementalDecoder, batch_size: int, *, beam_size: int, bos_id: int, eos_id: int,
                pad_id: int, max_len: int, min_len: int = 1, length_penalty: float = 1.0,
                no_repeat_ngram_size: int = 0, n_best: int = 1,
                device: torch.device | str = "cpu") -> list[list[Hypothesis]]:
    """Beam search. The decoder must already hold ``batch_size * beam_size`` rows, the
    ``beam_size`` rows of input b being consecutive (``repeat_interleave``). A sample is done
    once it has ``beam_size`` finished hypotheses; its rows are then dropped."""
    K = beam_size
    finished: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    alive = torch.arange(batch_size, device=device)  # batch index of each live sample
    tokens = torch.full((batch_size * K, 1), bos_id, dtype=torch.long, device=device)
    scores = torch.full((batch_size, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    for step in range(max_len):
        A = alive.numel()
        lp = decoder.step(tokens).float()
        V = lp.size(-1)
        _constrain(lp, step, eos_id=eos_id, bos_id=bos_id, pad_id=pad_id, min_len=min_len, max_len=max_len)
        _ban_repeated_ngrams(lp, tokens, no_repeat_ngram_size)
        cand = (scores[:, :, None] + lp.view(A, K, V)).view(A, K * V)
        top_scores, top_idx = cand.topk(min(2 * K, K * V), dim=1)
        origin, tok = top_idx // V, top_idx % V  # [A, 2K]
        is_eos = tok == eos_id
        rank = torch.arange(top_idx.size(1), device=device)[None, :].expand_as(tok)
        # finalize EOS candidates among the top K
        fin = is_eos & (rank < K) & torch.isfinite(top_scores)
        if fin.any():
            length = step + 1  # generated tokens including EOS
            for a, j in fin.nonzero().tolist():
                b = int(alive[a])
                if len(finished[b]) >= K:
                    continue
                row = a * K + int(origin[a, j])
                s = float(top_scores[a, j])
                finished[b].append(Hypothesis(tokens[row, 1:].tolist(), s / (length**length_penalty), s))
        # continue with the best K non-EOS candidates
        order = (is_eos.long() * top_idx.size(1) + rank).argsort(dim=1)[:, :K]
        next_scores = top_scores.gather(1, order)
        next_origin = origin.gather(1, order) + torch.arange(A, device=device)[:, None] * K
        next_tok = tok.gather(1, order)
        done = torch.tensor([len(finished[int(b)]) >= K for b in alive], device=device)
        if step + 1 >= max_len or bool(done.all()):
            break
        keep = (~done).nonzero(as_tuple=True)[0]
        rows = next_origin[keep].reshape(-1)
        decoder.reorder(rows)
        tokens = torch.cat([tokens[rows], next_tok[keep].reshape(-1, 1)], dim=1)
        scores = next_scores[keep]
        alive = alive[keep]
    results = []
    for b in range(batch_size):
        hyps = sorted(finished[b], key=lambda h: h.score, reverse=True)
        results.append(hyps[:n_best])
    return results


def run_search(make_decoder, batch_size: int, *, beam_size: int = 1, length_penalty: float = 1.0,
               n_best: int = 1, **common) -> dict:
    """Greedy (``beam_size <= 1``) or beam search, packed the way every model's ``generate``
    returns it: ``tokens``, ``scores`` (and ``n_best`` when asked). ``make_decoder(rows)`` builds
    the decoder; ``rows`` is None for greedy (one row per input) or, for beam search, the input
    index of each of the ``batch_size * beam_size`` rows (``repeat_interleave``)."""
    if beam_size <= 1:
        nbest = [[h] for h in greedy_search(make_decoder(None), batch_size, **common)]
    else:
        rows = torch.arange(batch_size, device=common.get("device", "cpu")).repeat_interleave(beam_size)
        nbest = beam_search(make_decoder(rows), batch_size, beam_size=beam_size, length_penalty=length_penalty,
                            n_best=n_best, **common)
    out: dict = {"tokens": [h[0].tokens if h else [] for h in nbest],
                 "scores": [h[0].score if h else float("-inf") for h in nbest]}
    if n_best > 1:
        out["n_best"] = [[(h.tokens, h.score) for h in hs] for hs in nbest]
    return out


@torch.no_grad()
def sample_search(decoder: IncrementalDecoder, batch_size: int, *, bos_id: int, eos_id: int, pad_id: int,
                  max_len: int, min_len: int = 1, temperature: float = 1.0,
                  generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> list[Hypothesis]:
    """Draw one sequence per decoder row from the model's distribution (softmax of the
    log-probabilities / ``temperature``), token by token; the same constraints as the searches
    (no BOS/PAD, EOS not before ``min_len``, EOS at ``max_len``). ``log_prob`` is the sum of the
    drawn tokens' log-probabilities under the model (temperature 1), EOS included."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def draw(lp: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(torch.softmax(lp / temperature, dim=-1), 1, generator=generator).squeeze(1)

    return _token_by_token(decoder, batch_size, draw, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, max_len=max_len,
                           min_len=min_len, no_repeat_ngram_size=0, device=device)


def run_sample(make_decoder, batch_size: int, num_samples: int, *, device: torch.device | str = "cpu",
               **kw) -> dict[str, list]:
    """``num_samples`` sequences drawn per input (rows of input b consecutive) with
    :func:`sample_search`; ``make_decoder(rows)`` builds the decoder over the inputs ``rows``.
    Returns ``tokens`` (no BOS/EOS) and ``log_probs`` (their summed log-probabilities)."""
    rows = torch.arange(batch_size, device=device).repeat_interleave(num_samples)
    hyps = sample_search(make_decoder(rows), batch_size * num_samples, device=device, **kw)
    return {"tokens": [h.tokens for h in hyps], "log_probs": [h.log_prob for h in hyps]}
