"""A run in the reference's encoder mode keeps the image encoder's BatchNorm statistics, which
training moves, with every checkpoint (as the reference's ``best.th`` keeps its ResNet's), and
evaluation, export, averaging, --resume and ``train.init_from`` read them back."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import tellkit
from tellkit.checkpoint import IMAGE_ENCODER_FILE, load_model, read_checkpoint_config
from tellkit.cli import main
from tellkit.encoders.image import build_image_encoder
from tellkit.tasks.captioning import CaptioningTask

FIX = Path(__file__).parent / "fixtures" / "goodnews"
TINY = Path(tellkit.__file__).parent / "configs" / "tat" / "tiny.yaml"


def write_recipe(path: Path, **train) -> Path:
    recipe = {
        "base": str(TINY),
        "model": {"contexts": ["image"], "image_dim": 1280, "vocab_size": 50265},
        "encoders": {"image": "mobilenet_v2", "mode": "reference"},
        "data": {"format": "goodnews", "root": str(FIX), "context": "none"},
        "train": {"max_steps": 2, "max_epochs": 5, "batch_size": 2, "log_every": 1, "seed": 3, **train},
        "eval": {"metrics": ["bleu"], "ner": False, "max_len": 3, "beam_size": 1},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def bn_stats(tensors: dict) -> dict:
    return {k: v.detach().float().clone() for k, v in tensors.items() if k.endswith(("running_mean", "running_var"))}


def pretrained_bn() -> dict:
    return bn_stats(build_image_encoder("mobilenet_v2").backbone.state_dict())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refmode")
    out = tmp / "run"
    cfg = write_recipe(tmp / "r.yaml")
    assert main(["train", str(cfg), "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    return out


def moved(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_every_checkpoint_keeps_the_encoder_state_training_reached(run):
    last = (run / "checkpoints" / "last").resolve()
    meta = json.loads((last / "config.json").read_text())
    assert meta["encoders"]["image_weights"] == IMAGE_ENCODER_FILE  # a bare name: the folder can move
    saved = bn_stats(load_file(last / IMAGE_ENCODER_FILE))
    assert moved(saved, pretrained_bn()) > 1e-4  # batch statistics moved the running ones
    # reading the checkpoint points the encoder at the carried file; the task builds it from there
    resolved = read_checkpoint_config(last)
    assert Path(resolved["encoders"]["image_weights"]).parent == last
    model = load_model(last)
    task = CaptioningTask({**{k: v for k, v in resolved.items() if k != "config"}, "model": meta["config"]})
    built = bn_stats(task.bundle.image_encoder.backbone.state_dict())
    assert moved(built, saved) == 0.0 and model is not None


def test_export_and_average_carry_the_encoder_state(run, tmp_path):
    last = (run / "checkpoints" / "last").resolve()
    assert main(["export", str(last), "--out", str(tmp_path / "exp"), "--float32"]) == 0
    exported = tmp_path / "exp"
    meta = json.loads((exported / "config.json").read_text())
    assert meta["encoders"]["image_weights"] == IMAGE_ENCODER_FILE and str(tmp_path) not in json.dumps(meta)
    carried = bn_stats(load_file(exported / IMAGE_ENCODER_FILE))
    assert moved(carried, bn_stats(load_file(last / IMAGE_ENCODER_FILE))) == 0
    # the mean of two states: the encoder statistics are averaged like the model's
    states = sorted((run / "checkpoints").glob("step_*"))
    if len(states) < 2:  # one state saved: average it with its export (same statistics)
        states = [last, exported]
    assert main(["average", *map(str, states[-2:]), "--out", str(tmp_path / "avg")]) == 0
    a, b = (bn_stats(load_file(s / IMAGE_ENCODER_FILE)) for s in states[-2:])
    mean = bn_stats(load_file(tmp_path / "avg" / IMAGE_ENCODER_FILE))
    assert all(torch.allclose(mean[k], (a[k] + b[k]) / 2, atol=1e-5) for k in mean)


def test_resume_and_init_from_read_the_encoder_state_back(run, tmp_path, monkeypatch):
    last = (run / "checkpoints" / "last").resolve()
    saved = bn_stats(load_file(last / IMAGE_ENCODER_FILE))
    seen = {}
    original = CaptioningTask.restore_checkpoint_files

    def spy(self, directory):
        ok = original(self, directory)
        seen[str(directory)] = (ok, bn_stats(self.bundle.image_encoder.backbone.state_dict()))
        return ok

    monkeypatch.setattr(CaptioningTask, "restore_checkpoint_files", spy)
    cfg = write_recipe(tmp_path / "r2.yaml", init_from=str(last))
    assert main(["train", str(cfg), "--out", str(tmp_path / "ft"), "--device", "cpu", "--no-progress"]) == 0
    ok, stats = seen[str(last)]
    assert ok and moved(stats, saved) == 0.0  # fine-tuning starts from the run's encoder state
    # --resume of the first run (same recipe): starts from what it saved, not from ImageNet's
    seen.clear()
    assert main(["train", str(run.parent / "r.yaml"), "--out", str(run), "--resume", "--device", "cpu",
                 "--no-progress"]) == 0
    ok, stats = seen[str(last)]
    assert ok and moved(stats, saved) == 0.0 and moved(stats, pretrained_bn()) > 1e-4


def test_frozen_mode_saves_no_encoder_state(tmp_path):
    cfg = write_recipe(tmp_path / "r.yaml", max_steps=1)
    r = yaml.safe_load(cfg.read_text())
    r["encoders"]["mode"] = "frozen"
    cfg.write_text(yaml.safe_dump(r))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--device", "cpu", "--no-progress"]) == 0
    last = (tmp_path / "run" / "checkpoints" / "last").resolve()
    assert not (last / IMAGE_ENCODER_FILE).exists()
    assert "image_weights" not in json.loads((last / "config.json").read_text())["encoders"] or \
        json.loads((last / "config.json").read_text())["encoders"]["image_weights"] is None
