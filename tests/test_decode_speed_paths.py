"""The decoding shortcuts that change how a product is taken, not what it computes: a context cast
once under autocast, a float32 decoding step's scores taken as keys x query, and the huge-page
switch the ``tellkit`` command sets before PyTorch starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tellkit
import tellkit.models.transform_and_tell as tat_module
from tellkit.bench.tat import fake_batch
from tellkit.layers import attention
from tellkit.layers.attention import MultiheadAttention
from tellkit.utils.precision import autocast_input

pytestmark = pytest.mark.precision


def test_autocast_input_casts_float32_only_inside_autocast():
    x = torch.randn(3, 4)
    assert autocast_input(x) is x  # no autocast: unchanged
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = autocast_input(x)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, x.to(torch.bfloat16), rtol=0, atol=0)
        ids = torch.arange(5)
        assert autocast_input(ids) is ids  # integers are never cast
        half = x.to(torch.bfloat16)
        assert autocast_input(half) is half
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert autocast_input(x) is x


def _kv_tensors(ctx):
    out = []
    for layer in ctx.layer_kvs:
        for kv in layer.values():
            out += [kv.k, kv.v]
    return out


@pytest.mark.parametrize("prepack", [False, True])
def test_contexts_cast_once_project_to_the_same_keys_values(monkeypatch, prepack):
    """Under bf16 autocast the contexts are cast once for every layer; the keys/values equal
    those of letting each layer's products cast them (bit for bit: the same rounding)."""
    from tellkit.layers import rows

    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny").eval()
    batch = fake_batch(m.config, 3, n_article=9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), rows.prepacked(prepack):
        once = _kv_tensors(m.project_contexts(m.encode_contexts(batch)))
        monkeypatch.setattr(tat_module, "autocast_input", lambda x: x)
        per_call = _kv_tensors(m.project_contexts(m.encode_contexts(batch)))
    assert len(once) == len(per_call) > 0
    for a, b in zip(once, per_call):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [1, 3])
def test_scores_keys_first_equal_query_first(monkeypatch, dtype, steps):
    """One query row in float32 is scored as keys x query; the attention output matches the
    query x keys order to rounding, for one and several query rows, with extra slots and masks."""
    torch.manual_seed(0)
    attn = MultiheadAttention(16, 4, kdim=12, vdim=12, add_bias_kv=True, add_zero_attn=True).eval().to(dtype)
    ctx = torch.randn(2, 7, 12, dtype=dtype)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    q = torch.randn(2, steps, 16, dtype=dtype)
    with torch.no_grad():
        kv = attn.project_kv(ctx, key_padding_mask=pad)
        out, w = attn.attend(q, kv, need_weights=True)
        monkeypatch.setattr(attention, "_scores", lambda q, k: torch.matmul(q, k.transpose(-1, -2)))
        ref, ref_w = attn.attend(q, kv, need_weights=True)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(w, ref_w, **tol)
    assert float(w[1, :, 5:].abs().max()) == 0.0  # padded keys get no weight either way


def _env_of_the_command(env_value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    code = ("import os, sys, tellkit.cli; "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_command_turns_huge_pages_on_before_torch_starts():
    # PyTorch reads the switch once as it starts: the command must set it before torch is imported
    assert _env_of_the_command(None) == ["1", "False"]


def test_the_command_keeps_a_huge_page_setting_from_the_environment():
    assert _env_of_the_command("0") == ["0", "False"]
