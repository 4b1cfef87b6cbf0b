"""train.ema: a moving average of the weights kept as training goes, saved in every state,
restored on resume, validated beside the raw weights and exported with `tellkit export --ema`."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402  (registers the "toy" task and "toy_lm" model)

from tellkit.cli import main  # noqa: E402
from tellkit.errors import TellkitError  # noqa: E402
from tellkit.recipes import train_config  # noqa: E402
from tellkit.training.ema import WeightAverage  # noqa: E402
from tellkit.workflows import train_recipe as train  # noqa: E402


def test_average_follows_the_restated_formula_and_swaps_back():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = WeightAverage(model, 0.9)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expect = {k: v.float().clone() for k, v in start.items() if v.is_floating_point()}
    for i in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (i + 1))
            model[1].running_mean.add_(1.0)
            model[1].num_batches_tracked += 1
        ema.update(model)
        for k, v in model.state_dict().items():
            if k in expect:
                expect[k] = 0.9 * expect[k] + 0.1 * v.float()
    assert set(ema.state_dict()) == set(expect)  # the batch count is not averaged
    for k, v in expect.items():
        assert torch.allclose(ema.state_dict()[k], v, atol=1e-6), k
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.applied(model):
        assert torch.allclose(model[0].weight, expect["0.weight"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in raw.items())
    with pytest.raises(TellkitError, match="do not fit"):
        ema.load_state_dict({"0.weight": torch.zeros(2, 3)}, "x")
    for bad in (0, 1, 1.5, True):
        with pytest.raises(TellkitError, match="train.ema"):
            train_config({"train": {"ema": bad}})
    assert train_config({"train": {"ema": 0.999}}).ema == 0.999


def _ema(run_dir: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / which / "ema.safetensors"))


def test_tiny_run_keeps_validates_resumes_and_exports_the_average(tmp_path, capsys):
    r = toy_task.recipe(max_epochs=2, ema=0.8)  # 6 steps per epoch
    train(r, tmp_path / "full", progress=False, save_every_steps=4)
    avg, raw = _ema(tmp_path / "full"), load_file(str(tmp_path / "full" / "checkpoints" / "last" / "model.safetensors"))
    assert set(avg) == {k for k, v in raw.items() if v.is_floating_point()}
    assert any(not torch.allclose(avg[k], raw[k].float()) for k in avg)  # an average, not a copy
    rows = list(csv.DictReader(open(tmp_path / "full" / "eval_log.csv")))
    metrics = {x["metric"] for x in rows}
    assert {"loss", "ema_loss"} <= metrics  # both figures at every validation
    assert sum(x["metric"] == "ema_loss" for x in rows) == sum(x["metric"] == "loss" for x in rows) == 2
    assert "ema_loss" in capsys.readouterr().out

    # an interrupted run resumed from its step-8 state ends with the same average
    crashing = toy_task.ToyTask(r)
    crashing.crash_after_batches = 6 + 2 + 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(r, tmp_path / "broken", task=crashing, progress=False, save_every_steps=4)
    train(r, tmp_path / "broken", resume=True, progress=False, save_every_steps=4)
    again = _ema(tmp_path / "broken")
    assert all(torch.equal(avg[k], again[k]) for k in avg)

    # export: the averaged weights instead of the raw ones, and a state without them is refused
    assert main(["export", str(tmp_path / "full" / "checkpoints" / "last"), "--ema", "--float32",
                 "--out", str(tmp_path / "exp")]) == 0
    out = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert all(torch.equal(out[k].float(), avg[k]) for k in avg)
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["note"]["weights"].startswith("exponential")
    train(toy_task.recipe(max_steps=1), tmp_path / "plain", progress=False)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "plain"), "--ema", "--out", str(tmp_path / "exp2")]) == 2
    assert "no averaged weights" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "full"), "--ema", "--format", "reference", "--out",
                 str(tmp_path / "x.ckpt")]) == 2
