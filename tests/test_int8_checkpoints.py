"""Checkpoints with int8 weight matrices (`tellkit export --int8`, `tellkit average --int8`): the
row-scaled rounding, loading back to float32, the size, the CLI, and damaged files."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tellkit.checkpoint import INT8_SCALE, dequantize_int8, load_model
from tellkit.errors import TellkitError
from tellkit.export.safetensors import export_safetensors, quantize_int8
from tellkit.registry import create_model


def small_model(seed=0):
    """A captioner with matrices large enough to be stored as int8 (and small ones that are not)."""
    torch.manual_seed(seed)
    return create_model("show_attend_tell", vocab_size=300, image_dim=64, embed_dim=32, hidden_dim=64,
                        attention_dim=32, adaptive_cutoffs=[], dropout=0.0)


def caption_batch(B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(3, 300, (B, 7), generator=g)
    cap[:, 0], cap[:, -1] = 0, 2
    return {"caption": cap, "image": torch.randn(B, 6, 64, generator=g),
            "image_mask": torch.ones(B, 6, dtype=torch.bool)}


def test_rows_are_rounded_within_half_a_step_of_their_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * torch.linspace(0.01, 3.0, 64)[:, None]  # rows of very different size
    small, steps = torch.randn(10, generator=g), torch.arange(5)
    q = quantize_int8({"w": w, "b": small, "n": steps})
    assert q["w"].dtype == torch.int8 and q["w"].shape == w.shape
    assert q["w" + INT8_SCALE].shape == (64,) and q["b"].dtype == torch.float16 and torch.equal(q["n"], steps)
    assert int(q["w"].abs().amax(1).min()) == 127  # every row uses the whole range
    back = dequantize_int8(q, "here")
    assert set(back) == {"w", "b", "n"} and back["w"].dtype == torch.float32
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool(((back["w"] - w).abs() <= step / 2 + 1e-7).all())


def test_an_int8_checkpoint_loads_close_to_the_float_model(tmp_path):
    m = small_model().eval()
    d16 = m.save_pretrained(tmp_path / "f16", dtype=torch.float16)
    d8 = export_safetensors(m.save_pretrained(tmp_path / "f32"), tmp_path / "i8", weights="int8")
    assert json.loads((d8 / "config.json").read_text())["weights_dtype"] == "int8"
    assert (d8 / "model.safetensors").stat().st_size < 0.75 * (d16 / "model.safetensors").stat().st_size
    back = load_model(d8).eval()
    for (k, a), b in zip(m.state_dict().items(), back.state_dict().values()):
        assert b.dtype == a.dtype, k
        if a.is_floating_point() and a.numel():
            assert float((a - b).abs().max()) <= float(a.abs().max()) / 127 + 1e-3, k
    x = caption_batch()
    torch.testing.assert_close(back(x)["loss"], m(x)["loss"], atol=0.02, rtol=0.01)
    assert back.generate(x, beam_size=2)["tokens"] is not None


def test_damaged_int8_files_are_one_line_errors(tmp_path):
    d = export_safetensors(small_model().save_pretrained(tmp_path / "f32"), tmp_path / "i8", weights="int8")
    state = load_file(str(d / "model.safetensors"))
    name = next(k[: -len(INT8_SCALE)] for k in state if k.endswith(INT8_SCALE))
    bad = dict(state)
    bad[name + INT8_SCALE] = bad[name + INT8_SCALE][:-1].clone()  # one row scale short
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(TellkitError, match="row scales"):
        load_model(d)
    bad = {k: v for k, v in state.items() if k != name + INT8_SCALE}  # int8 without its scale
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(TellkitError, match="int8"):
        load_model(d)


def test_export_and_average_write_int8_through_the_cli(tmp_path):
    srcs = []
    for seed in (0, 1):
        srcs.append(small_model(seed).save_pretrained(tmp_path / f"s{seed}"))

    def tellkit(*args):
        return subprocess.run([sys.executable, "-m", "tellkit", *map(str, args)], capture_output=True, text=True,
                              timeout=180)

    r = tellkit("export", srcs[0], "--out", tmp_path / "e8", "--int8")
    assert r.returncode == 0 and "int8 weights" in r.stdout, r.stderr
    r = tellkit("average", *srcs, "--out", tmp_path / "a8", "--int8")
    assert r.returncode == 0 and "int8 weights" in r.stdout, r.stderr
    want = {k: (srcs_a + srcs_b) / 2 for (k, srcs_a), srcs_b in
            zip(load_model(srcs[0]).state_dict().items(), load_model(srcs[1]).state_dict().values())
            if srcs_a.is_floating_point()}
    got = load_model(tmp_path / "a8").state_dict()
    for k, v in want.items():
        assert float((got[k] - v).abs().max()) <= float(v.abs().max()) / 127 + 1e-3, k
    r = tellkit("export", srcs[0], "--out", tmp_path / "x", "--int8", "--float32")
    assert r.returncode != 0 and "not allowed with" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()
