"""DDP on CPU (gloo, 2 processes via torchrun): one step equals the single-process step on the
same global batch, and evaluation gathers every prediction exactly once."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIX = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIX))
import toy_task  # noqa: E402

from tellkit.training import distributed  # noqa: E402
from tellkit.training.evaluation import run_eval  # noqa: E402
from tellkit.workflows import train_recipe as train  # noqa: E402


@pytest.mark.slow
def test_two_process_step_equals_single_process_step(tmp_path):
    # gloo over the loopback interface only: its peers then never resolve this host's name to
    # another interface (a source of rare aborts in gloo's TCP transport on sandboxed hosts)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(FIX / "ddp_worker.py"), str(tmp_path / "ddp"), "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    # the same global batch (4 samples: the first two batches of 2 of the same shuffled order)
    recipe = toy_task.recipe(batch_size=4, max_steps=1)
    recipe["model"]["dropout"] = 0.0
    train(recipe, tmp_path / "single", progress=False)
    a = load_file(str(tmp_path / "ddp" / "run" / "checkpoints" / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "single" / "checkpoints" / "last" / "model.safetensors"))
    init = toy_task.ToyLM(toy_task.ToyConfig(dropout=0.0)).state_dict()
    assert any(not torch.equal(b[k], init[k]) for k in b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # the gradient itself (Adam's first step hides its scale, so compare the logged norm too)
    ga = next(csv.DictReader(open(tmp_path / "ddp" / "run" / "train_log.csv")))["grad_norm"]
    gb = next(csv.DictReader(open(tmp_path / "single" / "train_log.csv")))["grad_norm"]
    assert float(ga) == pytest.approx(float(gb), rel=1e-5)

    # evaluation: 7 val samples in batches of 2 -> ranks hold 4 and 3; all 7 gathered, once each
    task = toy_task.ToyTask(recipe)
    from tellkit import load_model

    model = load_model(tmp_path / "ddp" / "run" / "checkpoints" / "last")
    metrics, preds = run_eval(task, model, task.build_dataset("val"), "val", distributed.DistInfo(), batch_size=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / "ddp" / f"eval_rank{rank}.json").read_text())
        assert got["world"] == 2
        assert got["ids"] == [p["id"] for p in preds] and len(got["ids"]) == 7
        assert got["metrics"]["accuracy"] == pytest.approx(metrics["accuracy"])
        assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-6)


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(FIX / "ddp_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_two_process_resume_falls_back_from_a_damaged_last_state(tmp_path):
    """Under DDP, rank 0 picks the state to resume from and every rank loads it (with its own
    RNG state): a truncated ``last`` makes both processes resume from ``best`` (epoch 1), and
    the run ends with the weights of the unbroken two-process run."""
    import shutil

    _torchrun(str(tmp_path / "full"), "2", "run")
    ck = tmp_path / "full" / "run" / "checkpoints"
    assert (ck / "best").resolve() != (ck / "last").resolve()
    assert (ck / "best").resolve().name.startswith("step_00000006")  # 24 samples / (2 x 2) = 6 steps per epoch
    shutil.copytree(tmp_path / "full", tmp_path / "broken", symlinks=True)
    last = (tmp_path / "broken" / "run" / "checkpoints" / "last").resolve()
    (last / "model.safetensors").write_bytes((last / "model.safetensors").read_bytes()[:100])
    proc = _torchrun(str(tmp_path / "broken"), "2", "run", "--resume")
    warnings = [line for line in proc.stdout.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "model.safetensors unreadable" in warnings[0], proc.stdout[-2000:]
    assert json.loads((tmp_path / "broken" / "summary.json").read_text())["steps"] == 12
    a = load_file(str(ck / "last" / "model.safetensors"))
    b = load_file(str(tmp_path / "broken" / "run" / "checkpoints" / "last" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
