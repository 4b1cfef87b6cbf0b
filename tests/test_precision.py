"""Mixed precision on the CPU: what a device grants for a requested dtype, the cosine schedule
with warm restarts, and a bf16 training run on a toy task (weights and optimiser state float32)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402

from tellkit.errors import TellkitError  # noqa: E402
from tellkit.recipes import train_config  # noqa: E402
from tellkit.training import TrainConfig  # noqa: E402
from tellkit.training.loop import LRSchedule  # noqa: E402
from tellkit.utils import precision  # noqa: E402
from tellkit.workflows import train_recipe  # noqa: E402

pytestmark = pytest.mark.precision
HAS_BF16 = precision.cpu_has_bf16()


def test_resolve_on_the_cpu(monkeypatch):
    assert precision.resolve("cpu", None).dtype is None
    fp16 = precision.resolve("cpu", "float16")
    assert fp16.dtype is None and "GPU" in fp16.note
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.resolve("cpu", "bfloat16") == precision.Precision("cpu", "bfloat16")
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    lacking = precision.resolve("cpu", "bfloat16")
    assert lacking.dtype is None and "no native bfloat16" in lacking.note
    assert precision.dtype_name("BF16") == "bfloat16" and precision.dtype_name("fp32") == "float32"
    with pytest.raises(ValueError, match="unknown dtype"):
        precision.dtype_name("int4")


def test_the_one_bf16_check_tells_native_from_packed_and_names_the_cpu():
    s = precision.bf16_support()
    assert isinstance(s.native, bool) and isinstance(s.packed, bool) and s.isa
    assert s.reason == "" if s.native else "no native bfloat16" in s.reason
    assert not s.native or s.packed  # native bf16 implies oneDNN's packed product runs
    assert precision.cpu_has_bf16() is s.native
    assert precision.resolve("cpu", "bfloat16").dtype == ("bfloat16" if s.native else None)


@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"DNNL_MAX_CPU_ISA": "avx2"},
                                 {"ATEN_CPU_CAPABILITY": "avx2"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}])
def test_an_environment_cap_holds_the_check_to_its_instruction_set(env):
    """Run in a fresh process (the check is computed once per process): a cap below AVX512-BF16
    takes native bf16 away on any CPU, and a cap below AVX-512 the packed product too."""
    import os
    import subprocess

    code = ("import json; from tellkit.utils import precision as p; s = p.bf16_support(); "
            "print(json.dumps([s.native, s.packed, s.reason, p.resolve('cpu', 'bfloat16').note]))")
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout
    native, packed, reason, note = json.loads(out)
    assert native is False and "held to" in reason and reason.split("held to ")[1].startswith(next(iter(env)))
    assert note.endswith("running in float32") and "no native bfloat16" in note
    if "AVX2" in next(iter(env.values())).upper():
        assert packed is False


def test_autocast_computes_in_bf16_only_where_granted(monkeypatch):
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    with precision.resolve("cpu", "bfloat16").autocast():
        assert (x @ w).dtype == torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    with precision.resolve("cpu", "bfloat16").autocast():
        assert (x @ w).dtype == torch.float32


def test_cosine_with_warm_restarts():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    cfg = TrainConfig(lr=1.0, scheduler="cosine", warmup=0.1, cycle_epochs=2, min_lr_ratio=0.1)
    s = LRSchedule(cfg, opt, total_steps=100, mode="max", steps_per_epoch=10)  # cycles of 20 steps
    lrs = [s.apply(i, i // 10) for i in range(60)]
    assert lrs[:2] == pytest.approx([0.5, 1.0])  # 2 warm-up steps
    assert lrs[2] == pytest.approx(1.0)
    assert lrs[11] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 18)))
    assert lrs[19] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 17 / 18)))
    assert lrs[20:40] == pytest.approx(lrs[:20]) and lrs[40:60] == pytest.approx(lrs[:20])  # restarts
    assert all(a >= b for a, b in zip(lrs[2:20], lrs[3:20]))
    whole = LRSchedule(TrainConfig(lr=1.0, scheduler="cosine", warmup=0.0), opt, total_steps=10, mode="min")
    assert whole.factor(0, 0) == pytest.approx(1.0) and whole.factor(9, 0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 0.9)))
    for bad in ({"cycle_epochs": 0}, {"cycle_epochs": float("nan")}, {"min_lr_ratio": 1.5}):
        with pytest.raises(TellkitError, match="train\\."):
            train_config({"train": {"scheduler": "cosine", **bad}})


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no native bfloat16 (AVX512-BF16 or AMX)")
def test_bf16_run_on_the_cpu_keeps_float32_weights_and_learns(tmp_path, capsys):
    r = toy_task.recipe(max_epochs=4)
    r["train"]["amp"] = "bf16"
    summary = train_recipe(r, tmp_path / "bf16", progress=False)
    assert "mixed precision bfloat16" in capsys.readouterr().out
    fp32 = dict(r, train={**r["train"], "amp": False})
    base = train_recipe(fp32, tmp_path / "fp32", progress=False)
    assert summary["steps"] == base["steps"]
    meta = json.loads((tmp_path / "bf16" / "checkpoints" / "last" / "config.json").read_text())
    assert meta["train"]["amp"] == "bf16"
    from safetensors.torch import load_file

    w = load_file(str(tmp_path / "bf16" / "checkpoints" / "last" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in w.values())
    import csv

    def losses(run):
        rows = csv.DictReader(open(tmp_path / run / "eval_log.csv"))
        return [float(x["value"]) for x in rows if x["metric"] == "loss"]

    a, b = losses("bf16"), losses("fp32")
    assert a[-1] < a[0] and b[-1] < b[0]
    assert a[-1] == pytest.approx(b[-1], rel=0.05)  # the same learning, to bf16's precision


def test_a_gpu_recipe_trains_on_a_cpu_in_float32_and_says_so(tmp_path, capsys):
    r = toy_task.recipe(max_epochs=1)
    r["train"]["amp"] = "fp16"
    train_recipe(r, tmp_path / "run", progress=False)
    out = capsys.readouterr().out
    assert "float16 mixed precision is for GPUs" in out and "mixed precision off" in out


def test_a_deadline_saves_and_stops_then_the_run_resumes(tmp_path):
    import time

    r = toy_task.recipe(max_epochs=3)
    s = train_recipe(r, tmp_path / "run", progress=False, deadline=time.time() - 1)
    assert s["stopped"] == "time" and s["steps"] == 1  # the step in progress finishes, then it saves
    assert (tmp_path / "run" / "checkpoints" / "last").exists()
    s = train_recipe(r, tmp_path / "run", progress=False, resume=True)
    assert s["stopped"] == "max_epochs" and s["steps"] == 18


def test_model_info_names_what_bf16_gets_on_this_cpu(capsys):
    from tellkit.cli import main

    assert main(["model-info", "configs/bttr/crohme.yaml"]) == 0
    info = json.loads(capsys.readouterr().out)["cpu_bf16"]
    s = precision.bf16_support()
    assert info["native_bf16"] is s.native and info["packed_bf16_products"] is s.packed and info["isa"] == s.isa
    assert ("note" in info) is (not s.native)
