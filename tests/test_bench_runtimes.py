"""`tellkit bench runtimes` plumbing on a tiny slice of the real data (timings are not asserted)."""
import pytest
import torch
from torch import nn

from tellkit.bench import runtimes


def test_int8_dynamic_quantises_linear_layers_but_not_those_of_adaptive_modules():
    class AdaptiveThing(nn.Module):  # reads its projection's weight itself, as AdaptiveInput does
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), AdaptiveThing())
    q = runtimes.int8_dynamic(model)
    kinds = [type(q[i]).__module__ for i in (0, 2)]
    assert all("quantized" in k for k in kinds), kinds
    assert type(q[3].proj) is nn.Linear
    x = torch.randn(3, 4)
    assert torch.allclose(q[2](q[1](q[0](x))), model[2](model[1](model[0](x))), atol=0.1)


def test_quick_bench_runs_every_row_on_the_real_data(shared_data, monkeypatch):
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv("TELLKIT_SHARED_DATA", str(shared_data))
    monkeypatch.setattr(runtimes, "QUICK", (2, 2))
    r = runtimes.run(quick=True)
    rec, cap = r["recognize"], r["captioning"]
    assert rec["expressions"] == 2 and cap["photos"] == 2
    assert list(rec["rows"]) == list(cap["rows"]) == list(runtimes.ROWS)
    for part, speed in ((rec, "images_per_s"), (cap, "photos_per_s")):
        base = part["rows"]["pytorch_fp32"]
        assert "outputs_differing_from_fp32" not in base
        for name, row in part["rows"].items():
            assert row[speed] > 0 and len(row["load_average"]["before"]) == 3
            if name != "pytorch_fp32":
                assert row["outputs_differing_from_fp32"] == len(row["differences"]) <= 2
                assert all(d["fp32"] == base["captions"][d["id"]] for d in row["differences"]) if part is cap else True
    assert rec["rows"]["int8_dynamic"]["dtype"].startswith("int8")
    assert rec["rows"]["onnxruntime"]["dtype"] == "float32"
    assert 0 <= rec["rows"]["pytorch_fp32"]["exprate"] <= 100
