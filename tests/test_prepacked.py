"""Float32 products on oneDNN-packed weights (tellkit.layers.rows.prepacked): the values of
F.linear, a fresh pack after an in-place update, the plain call wherever it does not apply, and
Transform and Tell's greedy captions unchanged."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import tellkit
from tellkit.bench.tat import fake_batch
from tellkit.layers import rows
from tellkit.layers.linear import GehringLinear
from tellkit.utils import precision

pytestmark = [pytest.mark.precision,
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                 reason="this PyTorch build has no oneDNN (mkldnn): nothing is packed")]
PACKED_BF16 = precision.bf16_support()


def _entry(w, dtype=torch.float32):
    return rows._packs.get((id(w), dtype))


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("three_d", [False, True])
def test_dense_equals_f_linear(n, with_bias, three_d):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g) if with_bias else None
    x = torch.randn(3, n, 40, generator=g) if three_d else torch.randn(n, 40, generator=g)
    with torch.no_grad(), rows.prepacked():
        y = rows.dense(x, w, b)
    assert (_entry(w) is not None) == (x.numel() > 40)  # packed, except a one-row product
    assert y.shape == (*x.shape[:-1], 24)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_module_goes_through_the_packed_weight_and_matches():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), rows.prepacked():
        y = rows.linear(lin, x)
    assert _entry(lin.weight) is not None
    torch.testing.assert_close(y, lin(x).detach(), rtol=1e-5, atol=1e-5)


def test_in_place_update_packs_again():
    w = torch.randn(12, 20)
    x = torch.randn(5, 20)
    with torch.no_grad(), rows.prepacked():
        rows.dense(x, w)
        first = _entry(w)[-1]
        w.add_(1)
        y = rows.dense(x, w)
    assert _entry(w)[-1] is not first
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_grad_enabled_falls_back_and_backward_works():
    w = torch.randn(6, 10, requires_grad=True)
    x = torch.randn(4, 10, requires_grad=True)
    with rows.prepacked():
        y = rows.dense(x, w)
    assert _entry(w) is None and y.requires_grad
    y.sum().backward()
    assert w.grad is not None and x.grad is not None
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=0)


@pytest.mark.skipif(not PACKED_BF16.packed, reason="oneDNN's packed bfloat16 product needs AVX-512 (BW, VL, DQ) "
                    f"or AVX-NE-CONVERT; this CPU: {PACKED_BF16.isa}")
def test_bf16_autocast_packs_a_bfloat16_copy_and_other_dtypes_fall_back():
    w, b, x = torch.randn(6, 10), torch.randn(6), torch.randn(4, 10)
    with torch.no_grad(), rows.prepacked():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = rows.dense(x, w, b)
            ref = F.linear(x, w, b)
        z = rows.dense(x.double(), w.double())
    assert y.dtype == ref.dtype == torch.bfloat16 and z.dtype == torch.float64
    assert _entry(w, torch.bfloat16) is not None and _entry(w) is None  # float32 products not packed
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad(), rows.prepacked():
        assert rows.dense(x, w).dtype == torch.float16  # another autocast dtype: the plain call


def test_bf16_autocast_without_the_packed_product_is_the_plain_autocast_call(monkeypatch):
    """Where the CPU cannot run oneDNN's packed bfloat16 product (AVX2 only), a product under
    bf16 autocast inside prepacked() is autocast's own F.linear: no packed copy, its exact values."""
    monkeypatch.setattr(rows, "bf16_support", lambda: precision.Bf16Support(False, False, "held", "AVX2"))
    w, b, x = torch.randn(6, 10), torch.randn(6), torch.randn(40, 10)
    with torch.no_grad(), rows.prepacked(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = rows.dense(x, w, b)
        ref = F.linear(x, w, b)
        lin = torch.nn.Linear(10, 6)
        by_module = rows.linear(lin, x)
    assert y.dtype == torch.bfloat16 and _entry(w, torch.bfloat16) is None
    assert _entry(lin.weight, torch.bfloat16) is None
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert by_module.dtype == torch.bfloat16
    with torch.no_grad(), rows.prepacked():  # float32 products are still packed
        rows.dense(x, w, b)
    assert _entry(w) is not None


def test_off_unless_asked_for_and_switchable_inside():
    w, x = torch.randn(6, 10), torch.randn(4, 10)
    with torch.no_grad():
        assert not rows.prepacking()
        assert torch.equal(rows.dense(x, w), F.linear(x, w))
        with rows.prepacked(), rows.prepacked(enabled=False):
            assert not rows.prepacking()
            assert torch.equal(rows.dense(x, w), F.linear(x, w))
    assert _entry(w) is None


def test_the_cache_does_not_keep_a_dead_weight_alive():
    w = torch.randn(8, 8)
    with torch.no_grad(), rows.prepacked():
        rows.dense(torch.randn(3, 8), w)
    key, ref = (id(w), torch.float32), weakref.ref(w)
    assert key in rows._packs
    del w
    gc.collect()
    assert ref() is None and key not in rows._packs


def test_transform_and_tell_greedy_captions_equal_with_and_without_prepacking():
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50], gehring_linear=True).eval()
    b = fake_batch(m.config, 3, n_image=4, n_article=6, n_faces=2)
    on = m.generate(b, max_len=8)
    off = m.generate(b, max_len=8, prepack=False)
    assert on["tokens"] == off["tokens"]
    assert on["scores"] == pytest.approx(off["scores"], abs=1e-4)
    # the packed copies were made, for the folded weight-normalised linears too
    with torch.no_grad():
        folded = [lin.effective_weight() for lin in m.modules() if isinstance(lin, GehringLinear)]
    assert folded and all(_entry(w) is not None for w in folded)


def test_bench_counts_flops_and_measures_the_fp32_peak():
    from tellkit.bench.tat import _bound, fp32_peak_gflops, generation, generation_flops

    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50]).eval()
    flops = generation_flops(m, 2, 4, "cpu")
    assert flops["whole_run_gflop"] > flops["context_encoding_gflop"] > 0 and flops["decoding_gflop"] > 0
    peak = fp32_peak_gflops(size=64, repeat=1)
    assert peak["peak"] == max(peak["torch_mm"], peak.get("onednn_prepacked", 0.0)) > 0
    row = generation(m, 2, 4, "cpu", recompute=False)
    plain = generation(m, 2, 4, "cpu", recompute=False, prepack=False)
    assert row["prepacked_weights"] and not plain["prepacked_weights"]
    assert row["outputs"] == plain["outputs"]
    _bound(row, flops, peak["peak"])
    assert row["fraction_of_fp32_flop_bound"] > 0 and row["decoding_fraction_of_fp32_flop_bound"] > 0
