"""Show, Attend and Tell and its self-critical training against the authors' computations,
re-stated here: the deep output, dropout, first input and attention penalty of arctic-captions'
``capgen.py`` (Xu et al. 2015), and the sampling pass, reward and mixed loss of
self-critical.pytorch (Rennie et al. 2017)."""
from __future__ import annotations

import pytest
import torch

import tellkit
from tellkit.errors import TellkitError
from tellkit.metrics.cider_d import EOS_WORD, CiderD
from tellkit.recipes import SelfCriticalConfig
from tellkit.training.self_critical import SelfCritical, reward_text

BOS, PAD, EOS = 0, 1, 2
V = 99


def sat(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, image_dim=16, embed_dim=16, hidden_dim=14, attention_dim=10, dropout=0.0,
               adaptive_cutoffs=[20, 50], adaptive_factor=2.0, adaptive_input=True)
    return tellkit.create_model("show_attend_tell", **{**cfg, **kw})


def images(B=2, n=5, seed=0, T=6):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(3, V, (B, T), generator=g)
    cap[:, 0], cap[:, -1] = BOS, EOS
    return {"caption": cap, "image": torch.randn(B, n, 16, generator=g),
            "image_mask": torch.ones(B, n, dtype=torch.bool)}


def words(tokens):
    return " ".join(f"w{t}" for t in tokens)


def encode(text):
    return [int(w[1:]) for w in text.split()]


def critic(refs, **cfg):
    corpus = [[reward_text(r) for r in rs] for rs in refs]
    return SelfCritical(SelfCriticalConfig(**{"samples": 3, "max_len": 6, **cfg}), CiderD(corpus), words,
                        bos_id=BOS, eos_id=EOS, pad_id=PAD, encode=encode, generator=torch.Generator().manual_seed(0))


# --- the model: capgen.py's equations ------------------------------------------------------------
def capgen_logits(m, batch, inp):
    """The code's readout written out (``build_model``): tanh(ff_logit_lstm(h) + emb + ff_logit_ctx(z)),
    the first input a zero vector (``emb_shifted``), no dropout (eval)."""
    s = m.encode(batch)
    emb = m.embed(inp)
    emb[:, 0] = 0.0
    out = []
    for t in range(inp.size(1)):
        e = m.att_score(torch.tanh(s["wa"] + m.att_hidden(s["h"])[:, None])).squeeze(-1)
        alpha = torch.softmax(e, -1)
        z = torch.sigmoid(m.beta(s["h"])) * (alpha[:, :, None] * s["a"]).sum(1)
        h, c = m.cell(torch.cat([emb[:, t], z], -1), (s["h"], s["c"]))
        s = {**s, "h": h, "c": c}
        out.append(torch.tanh(m.out_hidden(h) + emb[:, t] + m.out_context(z)))
    return torch.stack(out, 1)


def test_deep_output_tanh_and_zero_first_input_are_the_codes_readout():
    m = sat(deep_output_tanh=True, first_input="zeros").eval()
    b = images()
    inp = b["caption"][:, :-1]
    deep, _, _ = m.teacher_forced(b, inp)
    torch.testing.assert_close(deep, capgen_logits(m, b, inp), atol=1e-5, rtol=1e-5)
    assert float(deep.detach().abs().max()) <= 1.0
    # the BOS embedding is never read: changing it changes nothing
    with torch.no_grad():
        before = m(b)["loss"]
        m.embed.embeddings[0].weight[BOS] += 5.0
        torch.testing.assert_close(m(b)["loss"], before)
    # the paper's readout (the default): no tanh, the BOS embedding read
    paper = sat().eval()
    with torch.no_grad():
        before = paper(b)["loss"]
        paper.embed.embeddings[0].weight[BOS] += 5.0
        assert float((paper(b)["loss"] - before).abs()) > 1e-4
    with pytest.raises(TellkitError, match="first_input"):
        sat(first_input="start")


def test_dropout_acts_on_the_output_path_not_the_recurrence():
    """capgen.py drops ``proj_h`` (after the scan, so not the recurrent state) and the deep
    output; the LSTM's input is not dropped."""
    m = sat(dropout=0.5).train()
    b = images()
    s0 = m.encode(b)
    y = b["caption"][:, 0]
    torch.manual_seed(1)
    d1, _, s1 = m.step(y, s0)
    torch.manual_seed(2)
    d2, _, s2 = m.step(y, s0)
    torch.testing.assert_close(s1["h"], s2["h"])  # the recurrence saw no dropout
    torch.testing.assert_close(s1["c"], s2["c"])
    assert float((d1 - d2).detach().abs().max()) > 1e-3  # the output path did
    # the deep output is dropped after L_h reads a dropped h: zeros where either mask is zero
    torch.manual_seed(3)
    d3, _, _ = m.step(y, s0)
    assert float((d3.detach() == 0).float().mean()) == pytest.approx(0.5, abs=0.25)


def test_batch_normalised_penalty_is_the_codes_alpha_reg():
    """alpha_c * ((1 - alphas.sum(0)) ** 2).sum(0).mean() beside the batch-mean summed NLL: times
    the batch size, it is what our summed NLL gets (same-length captions, as the code's batches)."""
    b = images(B=3, n=6, T=7)
    code = sat(doubly_stochastic=0.7, doubly_stochastic_norm="batch").eval()
    plain = sat(doubly_stochastic=0.0).eval()
    with torch.no_grad():
        _, alpha, _ = code.teacher_forced(b, b["caption"][:, :-1])
        alphas = alpha.transpose(0, 1)  # the code's [T, B, N]
        alpha_reg = 0.7 * ((1.0 - alphas.sum(0)) ** 2).sum(0).mean()
        nll_mean = plain(b)["loss"] * plain(b)["ntokens"] / 3  # cost.mean(): summed NLL, mean over captions
        code_cost = nll_mean + alpha_reg
        ours = code(b)
        # the same objective up to the factor B / ntokens the training loop's token mean puts on it
        torch.testing.assert_close(ours["loss"] * ours["ntokens"] / 3, code_cost, atol=1e-5, rtol=1e-5)
        # the paper's per-caption form weighs the same sum N / B times as much
        paper = sat(doubly_stochastic=0.7).eval()
        reg_paper = paper(b)["attention_reg"]
        torch.testing.assert_close(reg_paper, ours["attention_reg"] * 6 / 3, atol=1e-6, rtol=1e-5)


# --- self-critical: the sampling pass's own log-probabilities ---------------------------------------
def test_drawn_log_probs_are_the_sampling_passes():
    """self-critical.pytorch's RewardCriterion over ``sample_logprobs`` (the log-softmax rows of the
    pass that drew the captions) equals our loss, value and gradient, with dropout on; a second
    teacher-forced pass (fresh dropout masks) would not."""
    m = sat(dropout=0.5).train()
    b = images()
    K, T = 3, 6
    rows_lp = []  # the log-softmax rows of the sampling pass (the reference's logprobs), graph kept
    step = m._draw_step

    def recording(last, s):
        deep, s = step(last, s)
        rows_lp.append(m.out.log_probs(deep))
        return deep, s

    m._draw_step = recording
    torch.manual_seed(5)
    drawn = m.draw(b, num_samples=K, max_len=T, generator=torch.Generator().manual_seed(3))
    del m._draw_step
    N = 2 * K
    # re-state: seq [N, T] and seqLogprobs [N, T, V] with finished rows padded, as the reference holds them
    seq = torch.full((N, T), PAD)
    logprobs = [[None] * T for _ in range(N)]
    alive = list(range(N))
    for t, lp in enumerate(rows_lp):
        banned = lp.clone().detach().fill_(0.0)
        banned[:, [BOS, PAD]] = float("-inf")
        renorm = torch.log_softmax(lp + banned, -1)
        still = []
        for j, r in enumerate(alive):
            toks = drawn["tokens"][r]
            tok = toks[t] if t < len(toks) else EOS
            seq[r, t] = tok
            logprobs[r][t] = renorm[j]
            if tok != EOS:
                still.append(r)
        alive = still
    mask = torch.zeros(N, T)
    picked = [[torch.zeros(()) for _ in range(T)] for _ in range(N)]
    for r in range(N):
        for t in range(T):
            # the reference's mask: the first position and every one after a real token (EOS included)
            if t == 0 or int(seq[r, t - 1]) not in (EOS, PAD):
                mask[r, t] = 1.0
                picked[r][t] = logprobs[r][t][seq[r, t]]
    input_ = torch.stack([torch.stack(row) for row in picked])
    torch.testing.assert_close(drawn["mask"].float(), mask)
    torch.testing.assert_close(drawn["log_probs"], input_ * mask, atol=1e-6, rtol=1e-6)
    reward = torch.randn(N)
    ours = -(reward[:, None] * drawn["log_probs"] * drawn["mask"]).sum() / drawn["mask"].sum()
    reference = -(input_ * reward[:, None] * mask).sum() / mask.sum()
    params = [p for p in m.parameters() if p.requires_grad]
    g1 = torch.autograd.grad(ours, params, retain_graph=True, allow_unused=True)
    g2 = torch.autograd.grad(reference, params, allow_unused=True)
    for p, a, c in zip(params, g1, g2):  # a tail no drawn word falls in gets no gradient (zero)
        zero = torch.zeros_like(p)
        torch.testing.assert_close(zero if a is None else a, zero if c is None else c, atol=1e-6, rtol=1e-5)
    # a second, teacher-forced pass under fresh dropout masks gives other values
    cap = torch.full((N, T + 1), PAD)
    for r, toks in enumerate(drawn["tokens"]):
        row = [BOS, *toks] + ([EOS] if drawn["finished"][r] else [])
        cap[r, : len(row)] = torch.tensor(row)
    rep = {k: v.repeat_interleave(K, 0) for k, v in b.items() if k != "caption"}
    lp2, m2 = m.caption_log_probs({**rep, "caption": cap})
    assert float((lp2 * m2).sum() - (drawn["log_probs"] * drawn["mask"]).sum()) != pytest.approx(0.0, abs=1e-3)


def test_a_caption_without_eos_is_cut_at_max_len():
    m = sat().eval()
    b = images()
    with torch.no_grad():  # EOS banned throughout (min_len beyond max_len): every caption is cut
        drawn = m.draw(b, num_samples=2, max_len=4, min_len=10 ** 3, generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 4 for t in drawn["tokens"]) and not any(drawn["finished"])
    assert bool(drawn["mask"].all())  # four drawn tokens, no EOS appended
    greedy = m.draw(b, num_samples=1, max_len=5, greedy=True)
    full = m.generate(b, max_len=30, beam_size=1)["tokens"]
    for g, f, done in zip(greedy["tokens"], full, greedy["finished"]):
        assert g == f[: len(g)] and (done or len(g) == 5)


# --- self-critical: the reward reads EOS -----------------------------------------------------------
def test_reward_with_and_without_eos_is_the_references():
    """self-critical.pytorch scores id strings up to and including the end id 0 (``array_to_str``)
    against references with it, document frequencies from references with it
    (``prepro_ngrams``); pycocoevalcap's CIDEr-D with the scored set's frequencies re-states it."""
    from pycocoevalcap.cider.cider import Cider

    refs = [["w5 w6 w7 w8", "w5 w6 w9", "w10 w6 w7"], ["w11 w12 w13", "w11 w14", "w12 w13 w15 w16"]]
    cands = [[5, 6, 7], [11, 12, 13]]
    ids = lambda text: " ".join(w[1:] for w in text.split())  # noqa: E731
    gts = {i: [ids(r) + " 0" for r in rs] for i, rs in enumerate(refs)}
    with_eos = Cider().compute_score(gts, {i: [" ".join(map(str, c)) + " 0"] for i, c in enumerate(cands)})[1]
    cut = Cider().compute_score(gts, {i: [" ".join(map(str, c))] for i, c in enumerate(cands)})[1]
    c = critic(refs)
    assert c.score(cands, refs, [True, True]) == pytest.approx(list(with_eos), abs=1e-12)
    assert c.score(cands, refs, [False, False]) == pytest.approx(list(cut), abs=1e-12)
    assert c.score(cands, refs) == c.score(cands, refs, [True, True])  # default: ended by EOS
    # a complete caption that matches a reference's ending gains against the same words cut
    assert with_eos[1] > cut[1]
    assert reward_text("A dog, running!") == f"a dog running {EOS_WORD}"


# --- self-critical: the mixed loss over all five captions, no attention penalty ---------------------
def test_mixed_loss_is_the_references_over_all_captions():
    """(1 - structure_loss_weight) * LanguageModelCriterion(all seq_per_img captions) +
    structure_loss_weight * the policy term, re-stated with teacher forcing (no dropout: the
    teacher-forced pass equals the sampling pass then)."""
    refs = [["w5 w6 w7", "w5 w8", "w9 w6 w7 w10", "w5 w6", "w11 w7"],
            ["w12 w13", "w12 w14 w15", "w16 w13", "w12 w13 w17", "w18 w19 w13"]]
    m = sat(doubly_stochastic=1.0).train()
    b = {**images(), "references": refs}
    c = critic(refs, xe_weight=0.3)
    batch = c.batch(m, b)
    assert batch["self_critical"] == c.loss
    gen = c.generator.get_state()
    out = m(batch)
    # re-state: the same captions drawn again (same generator state), their advantages
    c.generator.set_state(gen)
    with torch.no_grad():
        drawn = m.draw(b, num_samples=3, max_len=6, generator=c.generator)
    rewards = torch.tensor(c.score(drawn["tokens"], [r for r in refs for _ in range(3)], drawn["finished"])).view(2, 3)
    adv = (rewards - (rewards.sum(1, keepdim=True) - rewards) / 2).view(-1)
    pg_sum, pg_n = 0.0, 0
    for r, toks in enumerate(drawn["tokens"]):
        img = r // 3
        seq = [BOS, *toks] + ([EOS] if drawn["finished"][r] else [])
        one = {"image": b["image"][img:img + 1], "image_mask": b["image_mask"][img:img + 1]}
        deep, _, _ = m.teacher_forced(one, torch.tensor([seq[:-1]]))
        full = m.out.log_probs(deep)[0]  # [steps, V]: the distribution of each drawn token
        full[:, [BOS, PAD]] = float("-inf")  # drawn without BOS and PAD, renormalised
        full = torch.log_softmax(full, -1)
        pg_sum += -float(adv[r]) * float(full.gather(1, torch.tensor(seq[1:])[:, None]).sum())
        pg_n += len(seq) - 1
    xe_sum, xe_n = 0.0, 0
    for img, rs in enumerate(refs):
        assert len(rs) == 5
        for text in rs:
            seq = torch.tensor([[BOS, *encode(text), EOS]])
            one = {"caption": seq, "image": b["image"][img:img + 1], "image_mask": b["image_mask"][img:img + 1]}
            nll = -m.caption_log_probs(one)[0].sum()  # no attention penalty
            xe_sum += float(nll)
            xe_n += seq.size(1) - 1
    expect = 0.3 * xe_sum / xe_n + 0.7 * pg_sum / pg_n
    assert float(out["loss"]) == pytest.approx(expect, rel=1e-5, abs=1e-6)
    assert int(out["ntokens"]) == pg_n + xe_n
    out["loss"].backward()
    # with every advantage zero and no cross-entropy, the loss is zero: no attention penalty remains
    flat = critic([["w5"], ["w5"]], samples=2)
    flat.advantages = lambda model, batch, drawn: torch.zeros(len(drawn["tokens"]))
    zero = m({**b, "references": [["w5"], ["w5"]], "self_critical": flat.loss})
    assert float(zero["loss"]) == 0.0


def test_the_rescored_path_mixes_the_same_way():
    """Models without draw() (Transform and Tell) get one weighted token mean that equals the same
    w * XE + (1 - w) * PG."""
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", vocab_size=V, adaptive_cutoffs=[20, 50], contexts=["image"], dropout=0.0,
                             attention_dropout=0.0, input_dropout=0.0, weight_dropout=0.0).eval()
    refs = [["w5 w6 w7", "w5 w8", "w9 w6"], ["w12 w13", "w12 w14 w15", "w16"]]
    b = {**images(), "references": refs, "ids": ["a", "b"]}
    c = critic(refs, xe_weight=0.4)
    mixed = c.batch(m, b)
    assert mixed["caption"].size(0) == 6 + 6 and mixed["ids"][6:] == ["a"] * 3 + ["b"] * 3
    with torch.no_grad():
        total = m(mixed)
        lp = m.log_probs(mixed)  # [rows, T, V]
        tgt = mixed["caption"][:, 1:]
        real = tgt != PAD
        per_row = (lp.gather(2, tgt[..., None]).squeeze(-1) * real).sum(1)
    drawn_tokens = [row[1:row.index(EOS)] for row in mixed["caption"][:6].tolist()]
    rewards = torch.tensor(c.score(drawn_tokens, [r for r in refs for _ in range(3)])).view(2, 3)
    adv = (rewards - (rewards.sum(1, keepdim=True) - rewards) / 2).view(-1)
    n_pg, n_xe = int(real[:6].sum()), int(real[6:].sum())
    assert n_xe == sum(len(encode(t)) + 1 for rs in refs for t in rs)  # every reference, EOS included
    pg = -float((adv * per_row[:6]).sum()) / n_pg
    xe = -float(per_row[6:].sum()) / n_xe
    assert float(total["loss"]) == pytest.approx(0.4 * xe + 0.6 * pg, rel=1e-5, abs=1e-6)
