"""Unit tests of the shared blocks in tellkit.layers."""
import math

import pytest
import torch
from torch import nn

from tellkit.layers.adaptive import AdaptiveInput, AdaptiveSoftmax
from tellkit.layers.attention import MultiheadAttention, causal_mask
from tellkit.layers.dynamic_conv import DynamicConv1d, DynamicConvLayer
from tellkit.layers.layer_mix import LayerMix
from tellkit.layers.positional import SinusoidalPositions, sinusoidal_table


# -- dynamic convolution -------------------------------------------------------------------
def naive_dynamic_conv(conv: DynamicConv1d, x: torch.Tensor) -> torch.Tensor:
    """Direct loop over positions, heads and window slots (no band matrices)."""
    B, T, C = x.shape
    K, H = conv.kernel_size, conv.num_heads
    hd = C // H
    w = torch.softmax(conv.weight_linear(x).view(B, T, H, K), dim=-1)
    out = torch.zeros_like(x)
    for t in range(T):
        for h in range(H):
            for k in range(K):
                src = t - (K - 1) + k
                if src >= 0:
                    out[:, t, h * hd:(h + 1) * hd] += w[:, t, h, k, None] * x[:, src, h * hd:(h + 1) * hd]
    return out


@pytest.mark.parametrize("K", [1, 3, 4, 7])
def test_dynamic_conv_matches_naive_loop(K):
    torch.manual_seed(0)
    conv = DynamicConv1d(8, K, num_heads=2).eval()
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(conv(x), naive_dynamic_conv(conv, x), atol=1e-6, rtol=1e-5)


def test_dynamic_conv_is_causal():
    torch.manual_seed(0)
    layer = DynamicConvLayer(8, 5, num_heads=2, weight_dropout=0.0, input_dropout=0.0).eval()
    x = torch.randn(1, 7, 8)
    y = layer(x)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(1, 3, 8)  # change the future of position 3
    y2 = layer(x2)
    torch.testing.assert_close(y[:, :4], y2[:, :4])
    assert not torch.allclose(y[:, 4:], y2[:, 4:])


def test_dynamic_conv_incremental_keeps_only_k_minus_1_inputs():
    torch.manual_seed(0)
    K = 4
    conv = DynamicConv1d(6, K, num_heads=3).eval()
    x = torch.randn(2, 9, 6)
    full = conv(x)
    state: dict = {}
    steps = []
    for t in range(9):
        steps.append(conv(x[:, t:t + 1], state))
        assert state["history"].shape == (2, 3, K - 1, 2)  # per head: [B, H, K-1, C/H]
        if t >= K - 2:  # the last K-1 inputs, regrouped by head
            kept = state["history"].transpose(1, 2).reshape(2, K - 1, 6)
            torch.testing.assert_close(kept, x[:, t - K + 2:t + 1])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("K", [1, 2, 5])
def test_dynamic_conv_prefix_then_steps_equals_full(K):
    """A multi-position call with state (a prompt), then single steps: the same as one pass."""
    torch.manual_seed(1)
    conv = DynamicConv1d(8, K, num_heads=2).eval()
    x = torch.randn(3, 7, 8)
    state: dict = {}
    parts = [conv(x[:, :4], state)] + [conv(x[:, t:t + 1], state) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(parts, 1), conv(x), atol=1e-6, rtol=1e-5)


def test_dynamic_conv_kernels_softmax_normalised_and_weight_dropout():
    torch.manual_seed(0)
    conv = DynamicConv1d(8, 5, num_heads=2, weight_dropout=0.5)
    x = torch.randn(2, 3, 8)
    conv.eval()
    w = conv.kernels(x)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 2))
    conv.train()
    w = conv.kernels(x)
    assert (w == 0).any()  # DropConnect on the normalised kernel weights


# -- attention ----------------------------------------------------------------------------
def _torch_reference(mine: MultiheadAttention) -> nn.MultiheadAttention:
    ref = nn.MultiheadAttention(mine.embed_dim, mine.num_heads, bias=True, add_bias_kv=mine.bias_k is not None,
                                add_zero_attn=mine.add_zero_attn, kdim=mine.kdim, vdim=mine.vdim, batch_first=True)
    with torch.no_grad():
        ref.q_proj_weight.copy_(mine.q_proj.weight)
        ref.k_proj_weight.copy_(mine.k_proj.weight)
        ref.v_proj_weight.copy_(mine.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([mine.q_proj.bias, mine.k_proj.bias, mine.v_proj.bias]))
        ref.out_proj.weight.copy_(mine.out_proj.weight)
        ref.out_proj.bias.copy_(mine.out_proj.bias)
        if mine.bias_k is not None:
            ref.bias_k.copy_(mine.bias_k)
            ref.bias_v.copy_(mine.bias_v)
    return ref.eval()


@pytest.mark.parametrize("bias_kv,zero_attn", [(False, False), (True, False), (False, True), (True, True)])
def test_attention_matches_torch_with_separate_kv_sizes(bias_kv, zero_attn):
    torch.manual_seed(0)
    mine = MultiheadAttention(16, 4, kdim=24, vdim=8, add_bias_kv=bias_kv, add_zero_attn=zero_attn).eval()
    ref = _torch_reference(mine)
    q, k, v = torch.randn(2, 5, 16), torch.randn(2, 7, 24), torch.randn(2, 7, 8)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    out, _ = mine(q, k, v, key_padding_mask=pad)
    ref_pad = pad
    expected, _ = ref(q, k, v, key_padding_mask=ref_pad)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_attention_empty_context_is_legal_with_bias_or_zero_slot():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, kdim=8, vdim=8, add_bias_kv=True, add_zero_attn=True).eval()
    q = torch.randn(2, 3, 16)
    empty = torch.zeros(2, 0, 8)
    out, w = mha(q, empty, empty, key_padding_mask=torch.zeros(2, 0, dtype=torch.bool), need_weights=True)
    assert torch.isfinite(out).all() and w.shape == (2, 3, 0)
    # all-padding context == empty context (the padded keys are ignored)
    masked = torch.randn(2, 4, 8)
    out2, _ = mha(q, masked, masked, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    torch.testing.assert_close(out, out2)


def test_attention_without_slots_attends_to_nothing_when_all_masked():
    mha = MultiheadAttention(8, 2, bias=False).eval()
    q, k = torch.randn(1, 2, 8), torch.randn(1, 3, 8)
    out, _ = mha(q, k, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


def test_attention_projected_kv_reused_and_weights_over_real_keys():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, kdim=8, vdim=8, add_bias_kv=True, add_zero_attn=True).eval()
    k = torch.randn(2, 6, 8)
    kv = mha.project_kv(k)
    q = torch.randn(2, 3, 16)
    a, w = mha.attend(q, kv, need_weights=True)
    b, _ = mha(q, k, k)
    torch.testing.assert_close(a, b)
    assert w.shape == (2, 3, 6) and (w.sum(-1) < 1).all()  # some mass went to the bias/zero slots


def test_incremental_self_attention_cache_equals_full():
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    full, _ = mha(x, attn_mask=causal_mask(6))
    cache: dict = {}
    steps = [mha(x[:, t:t + 1], cache=cache)[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-6, rtol=1e-5)


# -- adaptive input / softmax ---------------------------------------------------------------
@pytest.fixture
def adaptive_pair():
    torch.manual_seed(0)
    inp = AdaptiveInput(50, 16, [10, 30], factor=2.0, padding_idx=1)
    out = AdaptiveSoftmax(50, 16, [10, 30], factor=2.0, tied_to=inp)
    return inp, out


def test_adaptive_input_bands_and_padding(adaptive_pair):
    inp, _ = adaptive_pair
    assert [e.embedding_dim for e in inp.embeddings] == [16, 8, 4]
    assert [e.num_embeddings for e in inp.embeddings] == [10, 20, 20]
    y = inp(torch.tensor([[1, 5, 15, 45]]))
    assert y.shape == (1, 4, 16)
    assert torch.equal(y[0, 0], torch.zeros(16))  # padding embeds to zero
    manual = inp.projections[2](inp.embeddings[2](torch.tensor(45 - 30)))
    torch.testing.assert_close(y[0, 3], manual)


def test_adaptive_softmax_is_a_distribution_and_targets_agree(adaptive_pair):
    _, sm = adaptive_pair
    sm.eval()
    x = torch.randn(7, 16)
    lp = sm.log_probs(x)
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(7), atol=1e-5, rtol=0)
    target = torch.tensor([0, 9, 10, 29, 30, 49, 3])
    torch.testing.assert_close(sm.target_log_probs(x, target), lp.gather(1, target[:, None]).squeeze(1))


def test_adaptive_softmax_weights_are_tied(adaptive_pair):
    inp, sm = adaptive_pair
    own = {id(p) for p in sm.parameters()}
    assert not own & {id(p) for p in inp.parameters()}  # tied weights are not registered twice
    x = torch.randn(3, 16)
    sm.target_log_probs(x, torch.tensor([2, 12, 40])).sum().backward()
    for emb in inp.embeddings:  # gradients reach every band's embedding through the softmax
        assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0


def test_adaptive_cutoffs_validated():
    with pytest.raises(ValueError):
        AdaptiveInput(50, 16, [30, 10])


# -- positions and layer mix -------------------------------------------------------------------
def test_sinusoidal_table_formula_and_growth():
    t = sinusoidal_table(10, 8)
    half = 4
    for pos in (0, 3, 9):
        for i in range(half):
            f = math.exp(-math.log(10000.0) * i / (half - 1))
            assert t[pos, i].item() == pytest.approx(math.sin(pos * f), abs=1e-6)
            assert t[pos, half + i].item() == pytest.approx(math.cos(pos * f), abs=1e-6)
    pe = SinusoidalPositions(8, init_size=4)
    torch.testing.assert_close(pe(3, start=8), sinusoidal_table(11, 8)[8:])


def test_layer_mix_softmax_weighted_sum():
    mix = LayerMix(3, init="zeros")
    h = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(mix(h), h.mean(1))  # zero init = uniform mix
    with torch.no_grad():
        mix.weights.copy_(torch.tensor([0.0, 1.0, 2.0]))
    a = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    torch.testing.assert_close(mix(h), (h * a.view(1, 3, 1, 1)).sum(1))
    with pytest.raises(ValueError):
        mix(torch.randn(2, 4, 5, 4))


def test_gehring_linear_keeps_the_16_bit_copy_of_its_fold_under_autocast():
    from tellkit.layers.linear import GehringLinear

    torch.manual_seed(0)
    lin = GehringLinear(40, 30).eval()
    x = torch.randn(5, 40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expect = torch.nn.functional.linear(x, lin.effective_weight().clone(), lin.bias)
        y = lin(x)
        low = lin.__dict__["_folded_low"][torch.bfloat16]
        assert low.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
        torch.testing.assert_close(y, expect, rtol=0, atol=0)  # what autocast's own cast gives
        assert lin.__dict__["_folded_low"][torch.bfloat16] is low  # made once per fold
        lin(x)
        assert lin.__dict__["_folded_low"][torch.bfloat16] is low
        lin.weight_g.mul_(2)  # a new fold: the old 16-bit copy is not used again
        y2 = lin(x)
    torch.testing.assert_close(y2.float() - lin.bias, (y.float() - lin.bias) * 2, rtol=2e-2, atol=2e-2)
    assert lin.__dict__["_folded_low"][torch.bfloat16] is not low


def test_layer_mix_matches_the_weighted_sum_at_any_layer_dim_and_keeps_the_dtype():
    torch.manual_seed(0)
    mix = LayerMix(4)
    h = torch.randn(3, 5, 4, 6)
    a = torch.softmax(mix.weights.detach(), 0)
    for dim in (2, -2):
        torch.testing.assert_close(mix(h, layer_dim=dim), (h * a.view(1, 1, 4, 1)).sum(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mix(h.to(torch.bfloat16), layer_dim=2).dtype == torch.bfloat16
        assert mix(h, layer_dim=2).dtype == torch.float32  # no copy into 16 bits of a float input


def test_layer_mix_default_init_is_uniform_0_1_like_the_reference():
    torch.manual_seed(0)
    w = LayerMix(10_000).weights.detach()
    assert 0.0 <= w.min() and w.max() <= 1.0
    assert abs(w.mean().item() - 0.5) < 0.02 and abs(w.var().item() - 1 / 12) < 0.005
    with pytest.raises(ValueError):
        LayerMix(3, init="normal")


# -- GehringLinear (weight-normalised) ---------------------------------------------------------
def test_gehring_linear_weight_norm_and_init():
    from tellkit.layers.linear import GehringLinear

    torch.manual_seed(0)
    lin = GehringLinear(400, 300)
    names = dict(lin.named_parameters())
    assert set(names) == {"weight_g", "weight_v", "bias"}
    assert names["weight_g"].shape == (300, 1) and names["weight_v"].shape == (300, 400)
    assert sum(p.numel() for p in lin.parameters()) == 400 * 300 + 300 + 300  # one g per output
    # at init W = v, drawn from N(0, 1/fan_in); bias 0
    torch.testing.assert_close(lin.effective_weight(), lin.weight_v.detach())
    assert abs(lin.weight_v.std().item() - (1 / 400) ** 0.5) < 0.002 and lin.bias.abs().sum() == 0
    # W = g * v / ||v|| row-wise: scaling v leaves the layer unchanged, g sets each row's norm
    x = torch.randn(5, 400)
    y = lin(x)
    with torch.no_grad():
        lin.weight_v.mul_(3.0)
    torch.testing.assert_close(lin(x), y, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lin.weight_g.fill_(2.0)
    torch.testing.assert_close(lin.effective_weight().norm(dim=1), torch.full((300,), 2.0))
    # same formula as PyTorch's weight_norm reparametrisation (dim=0)
    ref = torch.nn.Linear(400, 300)
    ref = torch.nn.utils.parametrizations.weight_norm(ref, dim=0)
    with torch.no_grad():
        ref.parametrizations.weight.original0.copy_(lin.weight_g)
        ref.parametrizations.weight.original1.copy_(lin.weight_v)
        ref.bias.copy_(lin.bias)
    torch.testing.assert_close(ref(x), lin(x))
    plain = GehringLinear(4, 3, weight_norm=False, bias=False)
    assert set(dict(plain.named_parameters())) == {"weight"}


def test_gehring_linear_folds_once_for_inference_and_never_goes_stale():
    from tellkit.layers.linear import GehringLinear

    torch.manual_seed(0)
    lin = GehringLinear(40, 30)
    with torch.no_grad():
        lin.weight_g.mul_(torch.rand(30, 1) + 0.5)  # g != ||v||: folding has something to do
    x = torch.randn(5, 40)
    y_train = lin(x)
    lin.eval()
    with torch.no_grad():
        y0 = lin(x)
        w0 = lin.effective_weight()
        assert lin.effective_weight() is w0  # folded once, then reused
        assert torch.equal(lin(x), y0)       # identical to the first (folding) call
    torch.testing.assert_close(y0, y_train.detach(), rtol=0, atol=0)  # same formula as training

    # an optimiser step in eval mode (in place, bumps the version counter) changes the output
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    loss = lin(x).pow(2).sum()  # grad enabled + trainable: computed fresh, gradients flow
    loss.backward()
    assert lin.weight_v.grad.abs().sum() > 0 and lin.weight_g.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        y1 = lin(x)
        expect = torch.nn.functional.linear(
            x, lin.weight_v * lin.weight_g / lin.weight_v.norm(dim=1, keepdim=True), lin.bias)
    assert not torch.equal(y1, y0)
    torch.testing.assert_close(y1, expect)

    # load_state_dict, copy_ under no_grad, and replacing a parameter tensor are all seen
    other = GehringLinear(40, 30)
    lin.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(lin(x), other(x))
        lin.weight_g.copy_(lin.weight_g * 2)
        torch.testing.assert_close(lin(x), other(x) * 2 - other.bias)  # bias is 0 at init anyway
    lin.weight_v = nn.Parameter(torch.randn(30, 40))
    with torch.no_grad():
        w = lin.effective_weight()
        torch.testing.assert_close(w, lin.weight_v * lin.weight_g / lin.weight_v.norm(dim=1, keepdim=True))
    # writes through .data bypass the version counter: clear_folded() is the documented way out
    with torch.no_grad():
        lin(x)
        lin.weight_g.data.mul_(3)
        lin.clear_folded()
        torch.testing.assert_close(lin.effective_weight().norm(dim=1, keepdim=True), lin.weight_g)

    # training mode never uses a folded copy, and gradients flow through g and v
    lin.train()
    assert lin._folded is None
    lin.zero_grad()
    lin(x).sum().backward()
    assert lin.weight_v.grad is not None and lin.weight_g.grad is not None
    # nothing of the fold is saved
    assert set(lin.state_dict()) == {"weight_g", "weight_v", "bias"}


def test_adaptive_input_band_padding_rows_are_zero_and_frozen():
    emb = AdaptiveInput(50, 8, [10, 30], 1.0, padding_idx=1, band_padding_idx=0)
    for band in emb.embeddings:
        assert band.weight[0].abs().sum() == 0
    out = emb(torch.tensor([[0, 10, 30, 1]]))
    assert out[0, :3].abs().sum() == 0 and out[0, 3].abs().sum() > 0
    out.sum().backward()
    for band in emb.embeddings:
        assert band.weight.grad[0].abs().sum() == 0


def test_band_padding_rows_are_trained_through_the_tied_softmax():
    # the reference ties the head's word weights to band 0 and each tail's output weights to its
    # band, so rows 0 / cutoff_1 / cutoff_2 are logits of the softmax: only the input lookup skips them
    emb = AdaptiveInput(50, 8, [10, 30], 1.0, padding_idx=1, band_padding_idx=0)
    sm = AdaptiveSoftmax(50, 8, [10, 30], 1.0, tied_to=emb)
    x = torch.randn(6, 8)
    sm.target_log_probs(x, torch.tensor([3, 12, 35, 0, 10, 30])).sum().backward()
    for band in emb.embeddings:
        assert band.weight.grad[0].abs().sum() > 0


def test_adaptive_softmax_reference_loss_drops_in_cluster_term_of_relative_pad():
    torch.manual_seed(0)
    emb = AdaptiveInput(50, 8, [10, 30], 1.0)
    sm = AdaptiveSoftmax(50, 8, [10, 30], 1.0, tied_to=emb)
    x = torch.randn(4, 8)
    target = torch.tensor([3, 11, 31, 12])  # 11 = 10 + 1 and 31 = 30 + 1: relative id 1 in their tails
    exact = sm.target_log_probs(x, target)
    full = sm.log_probs(x)
    torch.testing.assert_close(exact, full[torch.arange(4), target])
    ref = sm.target_log_probs(x, target, ignore_in_cluster=1)
    torch.testing.assert_close(ref[[0, 3]], exact[[0, 3]])
    head = sm._head_logprobs(x)
    torch.testing.assert_close(ref[1], head[1, 10])  # only log p(cluster 1)
    torch.testing.assert_close(ref[2], head[2, 11])  # only log p(cluster 2)


def test_logits_loss_is_mean_cross_entropy_over_real_targets():
    import torch.nn.functional as F

    from tellkit.layers.loss import logits_loss, token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 5))
    targets[0, 3:] = -100
    out = logits_loss(logits, targets, ignore_index=-100)
    want = F.cross_entropy(logits.reshape(-1, 7).float(), targets.reshape(-1), ignore_index=-100)
    assert int(out["ntokens"]) == 8
    assert torch.allclose(out["loss"], want, atol=1e-6)
    assert torch.allclose(out["nll_bits"], want / math.log(2), atol=1e-6) and not out["nll_bits"].requires_grad
    # the same through token_loss, plus a summed regulariser that does not enter nll_bits
    lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0][targets != -100]
    reg = token_loss(lp, 8, extra=torch.tensor(4.0))
    assert torch.allclose(reg["loss"], want + 0.5, atol=1e-6) and torch.allclose(reg["nll_bits"], out["nll_bits"])
    empty = logits_loss(logits, torch.full((2, 5), -100), ignore_index=-100)
    assert int(empty["ntokens"]) == 0 and float(empty["loss"]) == 0.0


def test_fast_dropout_has_the_distribution_of_dropout():
    from tellkit.layers.dropout import FastDropout, fast_dropout

    torch.manual_seed(0)
    x = torch.ones(64, 24, 32, 40)
    for fmt in (torch.contiguous_format, torch.channels_last):
        y = fast_dropout(x.contiguous(memory_format=fmt), 0.2)
        assert y.is_contiguous(memory_format=fmt) and y.shape == x.shape
        kept = y != 0
        # p rounded to a multiple of 1/32768; 2M draws: standard error of the rate ~3e-4
        assert abs(kept.float().mean().item() - (1 - 6554 / 32768)) < 2e-3
        assert torch.allclose(y[kept], torch.full_like(y[kept], 32768 / (32768 - 6554)))
        assert abs(y.mean().item() - 1.0) < 3e-3  # expectation preserved
        # no structure: rows and channels drop independently (compare halves of the tensor)
        assert abs(kept[:, :12].float().mean().item() - kept[:, 12:].float().mean().item()) < 4e-3
    # reproducible from the default generator, different on the next draw
    torch.manual_seed(5)
    a = fast_dropout(x, 0.3)
    torch.manual_seed(5)
    assert torch.equal(a, fast_dropout(x, 0.3)) and not torch.equal(a, fast_dropout(x, 0.3))
    # the gradient is the mask times the scale
    w = torch.randn(3, 5, 7, requires_grad=True)
    out = fast_dropout(w, 0.5)
    out.sum().backward()
    assert torch.equal(w.grad, (out != 0).float() * 2.0)
    # eval, p = 0, p = 1 and a strided view behave like nn.Dropout
    m = FastDropout(0.4).eval()
    assert m(x) is x and fast_dropout(x, 0.0) is x
    assert not fast_dropout(x, 1.0).any()
    view = x[:, :, ::2]
    assert abs((fast_dropout(view, 0.5) != 0).float().mean().item() - 0.5) < 5e-3
    with pytest.raises(ValueError):
        FastDropout(1.5)


def test_fast_dropout_traces_under_torch_compile():
    """Inside a compiled graph it is F.dropout (whole graph, no break at the int16 view)."""
    from tellkit.layers.dropout import fast_dropout

    f = torch.compile(lambda t: fast_dropout(t, 0.5), backend="eager", fullgraph=True)
    y = f(torch.ones(4, 6, 8, 10))
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0 < (y == 0).sum() < y.numel()
