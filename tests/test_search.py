"""Greedy and beam search (tellkit.decoding.search) on small decoders with known answers."""
import itertools

import pytest
import torch

from tellkit.decoding.search import beam_search, greedy_search

BOS, PAD, EOS = 0, 1, 2


class MarkovDecoder:
    """Next-token log-probs depend on the last token (and optionally the row's input id).
    It keeps its own copy of every row's history and checks that the search's reorders keep
    it in sync with the tokens it is given."""

    def __init__(self, table: torch.Tensor, rows: int):
        self.table = table.log_softmax(-1)
        self.hist = None
        self.rows = rows

    def step(self, tokens):
        if self.hist is not None:
            assert torch.equal(self.hist, tokens[:, :-1]), "decoder state out of sync with the search"
        assert tokens.size(0) == self.rows
        self.hist = tokens.clone()
        return self.table[tokens[:, -1]].clone()

    def reorder(self, index):
        self.hist = self.hist[index]
        self.rows = index.numel()


def brute_force(table, max_len, alpha, min_len=1):
    lp = table.log_softmax(-1)
    V = table.size(0)
    content = [t for t in range(V) if t not in (BOS, PAD, EOS)]
    best = None
    for n in range(0, max_len):
        for seq in itertools.product(content, repeat=n):
            if n + 1 < min_len:
                continue
            toks = [BOS, *seq, EOS]
            s = sum(lp[a, b].item() for a, b in zip(toks, toks[1:]))
            cand = (s / (n + 1) ** alpha, list(seq))
            if best is None or cand[0] > best[0]:
                best = cand
    return best


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_finds_the_exact_optimum(alpha, seed):
    torch.manual_seed(seed)
    table = torch.randn(5, 5) * 2
    score, seq = brute_force(table, max_len=4, alpha=alpha)
    hyps = beam_search(MarkovDecoder(table, 16), 1, beam_size=16, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                       max_len=4, length_penalty=alpha)
    assert hyps[0][0].tokens == seq
    assert hyps[0][0].score == pytest.approx(score, abs=1e-5)


def test_min_len_respected():
    table = torch.zeros(5, 5)
    table[:, EOS] = 10.0  # EOS is by far the most likely token
    out = greedy_search(MarkovDecoder(table, 2), 2, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=10, min_len=4)
    assert all(len(h.tokens) == 3 for h in out)
    hyps = beam_search(MarkovDecoder(table, 6), 2, beam_size=3, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                       max_len=10, min_len=4)
    assert all(len(h[0].tokens) == 3 for h in hyps)


def test_max_len_forces_eos():
    table = torch.zeros(6, 6)
    table[:, 3] = 10.0
    table[:, EOS] = -10.0
    out = greedy_search(MarkovDecoder(table, 1), 1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=5)
    assert out[0].tokens == [3, 3, 3, 3]
    hyps = beam_search(MarkovDecoder(table, 2), 1, beam_size=2, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=5)
    assert len(hyps[0][0].tokens) == 4


def test_no_repeat_ngram():
    table = torch.zeros(7, 7)
    table[:, 3] = 5.0  # always wants token 3
    table[:, 4] = 4.0
    table[:, EOS] = -20.0
    out = greedy_search(MarkovDecoder(table, 1), 1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=8,
                        no_repeat_ngram_size=2)
    toks = out[0].tokens
    bigrams = list(zip(toks, toks[1:]))
    assert len(bigrams) == len(set(bigrams)), toks
    hyps = beam_search(MarkovDecoder(table, 3), 1, beam_size=3, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=8,
                       no_repeat_ngram_size=2)
    toks = hyps[0][0].tokens
    assert len(list(zip(toks, toks[1:]))) == len(set(zip(toks, toks[1:])))


def test_beam_one_equals_greedy_and_batches_are_independent():
    torch.manual_seed(3)
    table = torch.randn(9, 9) * 3
    g = greedy_search(MarkovDecoder(table, 1), 1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=12)
    b = beam_search(MarkovDecoder(table, 1), 1, beam_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=12)
    assert g[0].tokens == b[0][0].tokens
    # a batch of 3 identical inputs gives 3 identical answers (rows dropped as they finish)
    hyps = beam_search(MarkovDecoder(table, 12), 3, beam_size=4, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=12)
    assert hyps[0][0].tokens == hyps[1][0].tokens == hyps[2][0].tokens


def test_n_best_sorted():
    torch.manual_seed(4)
    table = torch.randn(6, 6)
    hyps = beam_search(MarkovDecoder(table, 4), 1, beam_size=4, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=6, n_best=4)
    scores = [h.score for h in hyps[0]]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)
    assert len({tuple(h.tokens) for h in hyps[0]}) == 4


# --- the shared incremental-state convention (tellkit.decoding.state) ---------------------------
def test_reorder_state_reindexes_every_nesting_and_leaves_the_original():
    from tellkit.decoding.state import reorder_state
    from tellkit.layers.attention import ProjectedKV

    rows = torch.arange(4.0)
    kv = ProjectedKV(torch.arange(4.0).view(4, 1, 1, 1), torch.zeros(4, 1, 1, 1),
                     torch.zeros(4, 1, dtype=torch.bool), 1)
    state = [{"k": rows.clone(), "inner": [rows.clone(), (rows.clone(), 7)], "kv": kv, "n": 3, "none": None}]
    idx = torch.tensor([2, 2, 0])
    out = reorder_state(state, idx)
    assert out[0]["k"].tolist() == [2.0, 2.0, 0.0]
    assert out[0]["inner"][0].tolist() == [2.0, 2.0, 0.0] and out[0]["inner"][1][0].tolist() == [2.0, 2.0, 0.0]
    assert out[0]["inner"][1][1] == 7 and out[0]["n"] == 3 and out[0]["none"] is None
    assert out[0]["kv"].k.flatten().tolist() == [2.0, 2.0, 0.0]
    assert state[0]["k"].tolist() == [0.0, 1.0, 2.0, 3.0]  # the caller's copy is untouched


def test_row_context_copies_only_when_rows_change_input():
    from tellkit.decoding.state import RowContext

    value = torch.arange(6.0)  # rows 0-2 belong to input 0, rows 3-5 to input 1
    ctx = RowContext(value, torch.tensor([0, 0, 0, 1, 1, 1]))
    ctx.reorder(torch.tensor([2, 0, 0, 4, 3, 3]))  # beams re-ranked inside each input
    assert ctx.value is value  # the same contents row by row: nothing copied
    ctx.reorder(torch.tensor([3, 4, 5]))  # input 0 finished: its rows leave
    assert ctx.owner.tolist() == [1, 1, 1] and ctx.value.tolist() == [3.0, 4.0, 5.0]
