"""`tellkit bench` plumbing (not timings: speed targets live in the benchmark JSON only)."""
import subprocess
import sys

import pytest
import torch

import tellkit
from tellkit.bench.tat import _Recompute, fake_batch
from tellkit.decoding.search import greedy_search
from tellkit.models.transform_and_tell import _Incremental


def test_recompute_decoder_matches_incremental_decoder():
    """The benchmark's two modes must produce the same captions, or the ratio is meaningless."""
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50]).eval()
    b = fake_batch(m.config, 3, n_image=4, n_article=6, n_faces=2)
    kw = dict(bos_id=0, eos_id=2, pad_id=1, max_len=7)
    with torch.no_grad():
        inc = greedy_search(_Incremental(m, m.project_contexts(m.encode_contexts(b))), 3, **kw)
        full = greedy_search(_Recompute(m, b), 3, **kw)
    assert [h.tokens for h in inc] == [h.tokens for h in full]


@pytest.mark.precision
def test_tat_generation_bench_runs_under_bf16_and_says_so():
    """The bf16 row is the same incremental generation under autocast, and names its dtype."""
    from tellkit.bench.tat import generation
    from tellkit.utils.precision import Precision

    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50]).eval()
    fp32 = generation(m, 2, 5, "cpu", recompute=False)
    low = generation(m, 2, 5, "cpu", recompute=False, precision=Precision("cpu", "bfloat16"))
    assert (fp32["dtype"], low["dtype"]) == ("float32", "bfloat16")
    # min_len = max_len: every output has the same length; the count includes each EOS
    assert len(low["outputs"]) == 2 and len({len(o) for o in low["outputs"] + fp32["outputs"]}) == 1
    assert low["generated_tokens"] == fp32["generated_tokens"] == sum(len(o) + 1 for o in low["outputs"])


@pytest.mark.parametrize("with_bf16", [False, True])
def test_tat_bench_alternates_its_rows_and_keeps_each_ones_fastest(monkeypatch, with_bf16):
    """packed, plain and (given a precision) bf16 runs take turns, round after round; each row is
    the fastest of its own runs."""
    import tellkit.bench.tat as tat_bench
    from tellkit.utils.precision import Precision

    calls, secs = [], iter([5.0, 6.0, 7.0, 4.0, 8.0, 3.0])

    def fake_generation(model, bs, tokens, device, recompute, precision=None, prepack=True):
        calls.append("low" if precision is not None else ("packed" if prepack else "plain"))
        return {"seconds": next(secs), "who": calls[-1], "round": len(calls)}

    monkeypatch.setattr(tat_bench, "generation", fake_generation)
    low = Precision("cpu", "bfloat16") if with_bf16 else None
    best = tat_bench._alternated(None, 2, 3, "cpu", 2, low)
    names = ["packed", "plain", "low"] if with_bf16 else ["packed", "plain"]
    assert calls == names * 2  # alternated: other work slows every row alike
    assert sorted(best) == sorted(names)
    for name, row in best.items():
        assert row["who"] == name
    if with_bf16:  # seconds 5, 6, 7 then 4, 8, 3: packed and low from round 2, plain from round 1
        assert [best[n]["round"] for n in names] == [4, 2, 6]


@pytest.mark.precision
def test_tat_bench_bf16_row_names_the_reason_where_the_cpu_has_no_native_bf16(monkeypatch):
    """On a CPU without native bf16 the bf16 rows are not run: each says why in the JSON, and the
    result names the CPU's bf16 capability."""
    import tellkit.bench.tat as tat_bench
    from tellkit.utils import precision

    monkeypatch.setattr(precision, "bf16_support",
                        lambda: precision.Bf16Support(False, False, "this CPU has no native bfloat16 (test)", "AVX2"))
    monkeypatch.setattr(tat_bench, "bf16_support", precision.bf16_support)
    tiny = tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50])
    monkeypatch.setattr(tat_bench.tellkit, "create_model", lambda name, **kw: tiny)
    monkeypatch.setattr(tat_bench, "fp32_peak_gflops", lambda repeat: {"peak": 1.0})
    monkeypatch.setattr(tat_bench, "training", lambda *a, **k: {})
    monkeypatch.setattr(tat_bench, "fake_batch", lambda cfg, bs, **kw: fake_batch(cfg, bs, n_image=4, n_article=6,
                                                                                  n_faces=2))
    res = tat_bench.run(quick=True)
    assert res["cpu_bf16"]["native_bf16"] is False and res["cpu_bf16"]["isa"] == "AVX2"
    for row in res["generation_greedy"].values():
        assert row["bf16"] == {"skipped": "this CPU has no native bfloat16 (test): running in float32"}


def test_bench_cli_rejects_unknown_suite(tmp_path):
    res = subprocess.run([sys.executable, "-m", "tellkit", "bench", "no_such_suite", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "unknown benchmark suite" in res.stderr and "Traceback" not in res.stderr


def test_bttr_bench_images_come_from_tellkit_shared_data(tmp_path, monkeypatch):
    from tellkit.bench.bttr import SAMPLE_PATH, _default_images
    from tellkit.errors import TellkitError

    monkeypatch.delenv("TELLKIT_SHARED_DATA", raising=False)
    assert _default_images(3) == [SAMPLE_PATH] * 3
    d = tmp_path / "crohme" / "test" / "2014"
    d.mkdir(parents=True)
    for name in ("b.png", "a.png", "c.png", "notes.txt"):
        (d / name).write_bytes(b"")
    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(tmp_path))
    assert [p.name for p in _default_images(2)] == ["a.png", "b.png"]
    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(tmp_path / "elsewhere"))
    with pytest.raises(TellkitError, match="no PNG images"):
        _default_images(2)


def test_bttr_bench_names_its_model_and_images_without_machine_paths(monkeypatch):
    from tellkit.bench.bttr import bench_bttr

    monkeypatch.delenv("TELLKIT_SHARED_DATA", raising=False)
    r = bench_bttr(n_images=2, batch_size=2, beam_size=2, max_len=12, threads=1)
    assert r["checkpoint"] == "packaged default (bttr_default)"
    assert r["images_from"] == "the packaged sample, repeated" and r["images"] == 2 and r["same_outputs"]


def test_caption_fit_bench_needs_the_flickr8k_data(monkeypatch, tmp_path):
    from tellkit.bench import caption_fit
    from tellkit.errors import TellkitError

    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(tmp_path))
    with pytest.raises(TellkitError, match="Flickr8k"):
        caption_fit.run(quick=True)


@pytest.mark.data
@pytest.mark.slow
def test_caption_fit_bench_scores_each_fit_on_stretched_dev_photos(monkeypatch, shared_data):
    from tellkit.bench import caption_fit

    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(shared_data))
    dev = caption_fit._dev
    monkeypatch.setattr(caption_fit, "_dev", lambda n: dev(3))
    res = caption_fit.run(quick=True)
    assert res["images"] == 3 and len(res["rows"]) == 5
    fits = [r["fit"] for name, r in res["rows"].items() if name != "square, as trained"]
    assert fits == ["squash", "crop", "squash", "crop"]
    assert all(0 <= r["cider"] for r in res["rows"].values())
