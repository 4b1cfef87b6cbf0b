"""BTTR's search laid out for speed: shared memory per image, live hypotheses only, a growing
key/value cache, images encoded by size, the rescoring reusing scores both directions found,
and bfloat16 autocast. Each layout gives what the plain one gives."""
import pytest
import torch

from tellkit.layers.attention import KVCache, MultiheadAttention, RowGroups, SharedKV
from tellkit.models.bttr import Decoder
from tellkit.models.bttr_search import joint_search
from tellkit.utils.precision import cpu_has_bf16
from test_bttr import LABELS, TINY, _greedy, batch_of, images, tiny_model  # noqa: I001  (tests/ is on the path)


@pytest.fixture(scope="module")
def fitted():
    """test_bttr's fitted tiny model: searches end at different lengths, directions disagree."""
    import torch.nn.functional as F

    from tellkit.models.bttr import BTTR, PAD, BTTRConfig, bidirectional_targets

    torch.manual_seed(0)
    m = BTTR(BTTRConfig(**TINY)).eval()
    b = batch_of(images(), LABELS)
    with torch.no_grad():
        mem, mask = m.encode(b["image"], b["image_mask"])
    inp, tgt = bidirectional_targets(b["labels"], b["label_lengths"])
    opt = torch.optim.Adam(m.decoder.parameters(), 1e-2)
    m.decoder.train()
    for _ in range(40):
        logits = m.decoder(inp, mem.repeat(2, 1, 1), mask.repeat(2, 1))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def _images(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    sizes = [(32, 64), (48, 32), (16, 96), (32, 64), (64, 48), (16, 32)]
    return [torch.rand(1, *sizes[i % len(sizes)], generator=g) for i in range(n)]


@pytest.mark.parametrize("owner", [[0, 0, 1, 1, 1, 2], [2, 0, 1, 0, 2, 2], [0, 0, 1, 1, 2, 2]])
def test_shared_keys_values_equal_one_copy_per_row(owner):
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4).eval()
    mem = torch.randn(3, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    kv = mha.project_kv(mem, key_padding_mask=pad)
    owner = torch.tensor(owner)
    q = torch.randn(len(owner), 2, 16)
    shared, w_shared = mha.attend(q, SharedKV.of(kv, owner), need_weights=True)
    fused, _ = mha.attend(q, SharedKV.of(kv, owner))
    per_row, w_row = mha.attend(q, kv.index_select(owner), need_weights=True)
    torch.testing.assert_close(shared, per_row, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused, per_row, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_shared, w_row, atol=1e-6, rtol=1e-5)


def test_row_groups_layout_round_trips():
    owner = torch.tensor([1, 1, 0, 2, 1])
    g = RowGroups(owner, 3)
    assert g.width == 3 and not g.regular
    x = torch.arange(5.0)[:, None]
    assert torch.equal(g.to_rows(g.to_inputs(x)), x)
    assert RowGroups(torch.tensor([0, 0, 1, 1]), 2).regular


def test_reindexing_shared_rows_drops_inputs_nobody_reads():
    torch.manual_seed(0)
    mha = MultiheadAttention(8, 2).eval()
    kv = mha.project_kv(torch.randn(3, 4, 8))
    shared = SharedKV.share([kv, kv], torch.tensor([0, 0, 1, 2, 2]))
    out = SharedKV.reindex(shared, torch.tensor([4, 3, 3, 0]))  # input 1 has no row left
    assert out[0].groups is out[1].groups
    assert out[0].kv.k.shape[0] == 2 and out[0].groups.owner.tolist() == [1, 1, 1, 0]
    assert torch.equal(out[0].kv.k[1], kv.k[2]) and torch.equal(out[0].kv.k[0], kv.k[0])


def test_growing_cache_appends_in_place_and_reorders_into_the_spare_buffers():
    a = torch.randn(3, 2, 1, 4)
    cache = KVCache.empty(a, capacity=2)
    steps = [torch.randn(3, 2, 1, 4) for _ in range(5)]  # past the capacity: it grows
    for s in steps:
        k, v = cache.append(s, -s)
    full = torch.cat(steps, 2)
    assert torch.equal(k, full) and torch.equal(v, -full)
    moved = cache.index_select(torch.tensor([2, 0, 0, 1]))  # more rows than before
    assert torch.equal(moved.k, full[[2, 0, 0, 1]]) and torch.equal(moved.v, -full[[2, 0, 0, 1]])
    with pytest.raises(RuntimeError):
        cache.append(steps[0], steps[0])  # retired: its buffers belong to the new cache
    again = moved.index_select(torch.tensor([3, 0]))  # fewer rows: into the first cache's buffers
    assert torch.equal(again.k, full[[1, 2]])
    k, _ = again.append(steps[0][:2], steps[0][:2])
    assert again.length == 6 and torch.equal(k[:, :, :5], full[[1, 2]]) and torch.equal(k[:, :, 5:], steps[0][:2])
    third = again.index_select(torch.tensor([1]))  # and back into the second cache's
    assert torch.equal(third.k[:, :, :5], full[[2]])


def test_encoding_by_size_equals_the_padded_batch_where_real():
    m = tiny_model()
    b = batch_of(_images(6))
    with torch.no_grad():
        mem, mask = m.encode(b["image"], b["image_mask"])
        mem2, mask2 = m.encode_by_size(b["image"], b["image_mask"])
    assert torch.equal(mask, mask2)
    torch.testing.assert_close(mem2[mask2], mem[mask], atol=1e-5, rtol=1e-5)
    assert float(mem2[~mask2].abs().max()) == 0.0


def test_shared_memory_search_equals_one_copy_per_row(fitted, monkeypatch):
    """The layout CoMER gets (its layers override the cross-attention) gives the same search."""
    b = batch_of(images())
    fast = fitted.generate(b["image"], b["image_mask"])
    monkeypatch.setattr(Decoder, "shares_memory", property(lambda self: False))
    slow = fitted.generate(b["image"], b["image_mask"])
    assert fast["tokens"] == slow["tokens"]
    assert all(abs(x - y) < 1e-4 for x, y in zip(fast["scores"], slow["scores"]))


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_reused_and_pruned_rescoring_choose_what_scoring_everything_chooses(fitted, alpha):
    """Scores a hypothesis got in the other direction's own beam replace its teacher-forced
    rescoring, and candidates that cannot win are not scored: same choices, same totals."""
    from tellkit.models.bttr_search import beam_search, choose_best, rescore_opposite

    b = batch_of(_images(6) + images())
    n = b["image"].shape[0]
    with torch.no_grad():
        mem, mask = fitted.encode(b["image"], b["image_mask"])
        start, end = torch.tensor([1, 2] * n), torch.tensor([2, 1] * n)
        hyps = beam_search(fitted, mem, mask, start, end, 4, 12, owner=torch.arange(n).repeat_interleave(2))
    cands = [[(sc, t if d == 0 else t[::-1], d) for d in (0, 1) for t, sc in hyps[2 * i + d]] for i in range(n)]
    calls = []

    def counting(*a, **k):
        calls.append(len(a[3]))
        return rescore_opposite(*a, **k)

    import tellkit.models.bttr_search as bs

    orig, bs.rescore_opposite = bs.rescore_opposite, counting
    try:
        with torch.no_grad():
            fast = choose_best(fitted, mem, mask, cands, alpha)
            n_fast = sum(calls)
            calls.clear()
            plain = choose_best(fitted, mem, mask, cands, alpha, reuse=False, prune=False)
    finally:
        bs.rescore_opposite = orig
    assert sum(calls) == sum(len(c) for c in cands) and n_fast < sum(calls)
    assert [t for _, t in fast] == [t for _, t in plain]
    assert all(abs(x - y) < 1e-4 for (x, _), (y, _) in zip(fast, plain))
    # and by hand: (own + other direction teacher forced) / len**alpha, the best of all
    for i, c in enumerate(cands):
        opp = rescore_opposite(fitted, mem, mask, [(i, t, d) for _, t, d in c])
        want = max((sc + o) / max(len(t), 1) ** alpha for (sc, t, _), o in zip(c, opp))
        assert abs(plain[i][0] - want) < 1e-5


def test_rescoring_in_short_passes_equals_one_pass(fitted):
    from tellkit.models.bttr_search import rescore_opposite

    b = batch_of(images())
    mem, mask = fitted.encode(b["image"], b["image_mask"])
    items = [(0, [5, 6, 7], 0), (0, [9], 1), (1, [], 0), (1, [11, 12, 13, 14, 15], 1), (2, [8, 8], 1)]
    with torch.no_grad():
        one = rescore_opposite(fitted, mem, mask, items, positions_per_pass=10_000)
        many = rescore_opposite(fitted, mem, mask, items, positions_per_pass=1)
        alone = [rescore_opposite(fitted, mem, mask, [it])[0] for it in items]
    assert all(abs(x - y) < 1e-5 and abs(x - z) < 1e-5 for x, y, z in zip(one, many, alone))



@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bfloat16")
def test_bf16_search_runs_and_mostly_agrees_with_fp32(fitted):
    b = batch_of(_images(6) + images())
    full = fitted.generate(b["image"], b["image_mask"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = fitted.generate(b["image"], b["image_mask"])
    assert all(isinstance(s, float) and s == s for s in half["scores"])  # float scores, no NaN
    same = sum(x == y for x, y in zip(full["tokens"], half["tokens"]))
    assert same >= 0.7 * len(full["tokens"]), (full["tokens"], half["tokens"])


def test_one_direction_greedy_search_is_greedy_decoding(fitted):
    """beam 1, one direction, no rescoring: the live-rows-only search is plain greedy decoding."""
    for x in images():
        out = joint_search(fitted, x[None], None, beam_size=1, max_len=12, bidirectional=False, rescore=False)
        toks, score = _greedy(fitted, x[None], 12)
        assert out["tokens"][0] == toks and abs(out["scores"][0] - score) < 1e-4


def test_folded_encoder_equals_the_layer_by_layer_one():
    """In eval mode with no padding and no gradient the DenseNet runs with batch norms folded
    into its convolutions, 1x1 convolutions as products and no concatenation: same features;
    the folded weights follow in-place changes of the parameters and statistics."""
    m = tiny_model()
    with torch.no_grad():  # some statistics away from the identity
        for mod in m.encoder.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.2, 0.2)
                mod.running_var.uniform_(0.5, 1.5)
    x = torch.rand(2, 1, 48, 64)
    want, want_mask = m.encoder.densenet(x, None)  # gradients on: the layer-by-layer path
    with torch.no_grad():
        got, got_mask = m.encoder.densenet(x, None)
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
        assert torch.equal(got_mask, want_mask)
        m.encoder.densenet.blocks[0][0].bn1.running_mean.add_(0.5)
        moved = m.encoder.densenet(x, None)[0]
    torch.testing.assert_close(moved, m.encoder.densenet(x, None)[0].detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(moved, got)


def test_bucketed_rows_give_the_plain_product():
    from tellkit.layers import rows

    assert [rows.bucket(n) for n in (1, 16, 17, 33, 100, 1000)] == [16, 16, 18, 36, 104, 1024]
    assert all(n <= rows.bucket(n) <= max(16, 1.125 * n) for n in range(1, 5000))
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5)
    x = torch.randn(3, 7, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rows.linear(lin, x)
        want = lin(x)
    assert got.shape == (3, 7, 5) and torch.equal(got, want)


def test_evaluation_loss_without_gradients_equals_the_training_computation():
    from tellkit.models.bttr import BTTR, BTTRConfig

    torch.manual_seed(0)
    m = BTTR(BTTRConfig(**TINY)).eval()
    b = batch_of(_images(4), [[5, 6, 7], [9], [11, 12, 13, 14], [8, 8]])
    want = m(b)  # gradients on: the training path
    with torch.no_grad():
        got = m(b)
    torch.testing.assert_close(got["loss"], want["loss"].detach(), atol=1e-5, rtol=1e-5)
    assert int(got["ntokens"]) == int(want["ntokens"])


def test_the_last_batch_is_encoded_once_until_something_changes(monkeypatch):
    m = tiny_model()
    b = batch_of(_images(4))
    calls = []
    real = m.encode
    monkeypatch.setattr(m, "encode", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        first = m.encode_by_size(b["image"], b["image_mask"])
        n = len(calls)
        again = m.encode_by_size(b["image"], b["image_mask"])  # the loss, then the search
        assert len(calls) == n and again[0] is first[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # another precision: encoded again
            m.encode_by_size(b["image"], b["image_mask"])
        assert len(calls) == 2 * n
        b["image"].mul_(0.5)  # the same tensor changed in place
        changed = m.encode_by_size(b["image"], b["image_mask"])
        assert len(calls) == 3 * n and not torch.equal(changed[0], first[0])
        m.encoder.proj.bias.add_(1.0)  # a parameter changed in place
        m.encode_by_size(b["image"], b["image_mask"])
        assert len(calls) == 4 * n
    m.encode_by_size(b["image"], b["image_mask"])  # with gradients: never kept
    m.encode_by_size(b["image"], b["image_mask"])
    assert len(calls) == 6 * n
