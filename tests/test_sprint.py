"""`tellkit sprint`: the profile of the training step, training until the time is up, resuming
with the profile's choice, and the flat export; on a CPU with a tiny BTTR and a few real InkML
expressions (the same code runs on a GPU)."""
from __future__ import annotations

import json
import shutil

import pytest

from tellkit.cli import main
from tellkit.config import load_yaml, resolve_config_path
from tellkit.workflows.sprint import scaled_recipe, training_recipe


def test_batch_caps_and_learning_rate_follow_the_batch_size():
    r = {"train": {"batch_size": 8, "lr": 1e-4, "max_tokens": 1000}, "data": {"max_batch_pixels": 320000}}
    big = scaled_recipe(r, 32)
    assert big["train"]["batch_size"] == 32 and big["data"]["max_batch_pixels"] == 1280000
    assert big["train"]["max_tokens"] == 4000 and r["data"]["max_batch_pixels"] == 320000  # a copy
    profile = {"chosen_batch_size": 32, "workers": 3,
               "rows": [{"batch_size": 32, "train_images_per_s": 100.0}]}
    rec = training_recipe(r, profile, epoch_minutes=2)
    assert rec["train"]["lr"] == pytest.approx(2e-4)  # sqrt(32 / 8)
    assert rec["train"]["amp"] == "bf16" and rec["train"]["num_workers"] == 3
    assert rec["train"]["samples_per_epoch"] == 12000  # 2 minutes at 100 images/s
    assert training_recipe(r, profile, 2, scale_lr=False)["train"]["lr"] == 1e-4


@pytest.fixture()
def mini_crohme(shared_data, tmp_path):
    """A data root with 24 training and 8 test expressions of the official InkML."""
    src = shared_data / "crohme_inkml"
    for sub, files in (("train/a", sorted((src / "train" / "KAIST").glob("*.inkml"))[:24]),
                       ("test/2014", sorted((src / "test" / "2014").glob("*.inkml"))[:8])):
        (tmp_path / "mini" / sub).mkdir(parents=True)
        for f in files:
            shutil.copy(f, tmp_path / "mini" / sub / f.name)
    return tmp_path / "mini"


@pytest.mark.data
@pytest.mark.slow
def test_sprint_profiles_trains_until_the_time_is_up_and_resumes(mini_crohme, tmp_path, capsys):
    args = ["sprint", "bttr/tiny", f"data.root={mini_crohme}", "train.max_steps=null", "train.max_epochs=1000",
            "--out", str(tmp_path / "run"), "--batch-sizes", "2,4", "--profile-seconds", "2", "--workers", "1",
            "--epoch-minutes", "0.05", "--export", str(tmp_path / "export"), "--no-progress", "--device", "cpu"]
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "sprint.log").write_text("a log the caller keeps here\n")
    assert main([*args, "--minutes", "0.8"]) == 0
    assert "profiling batch size" not in capsys.readouterr().out  # --no-progress
    first = json.loads((tmp_path / "run" / "sprint.json").read_text())
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert [r["batch_size"] for r in profile["rows"]] == [2, 4]
    for row in profile["rows"]:
        assert row["loader_images_per_s"] > 0 and row["step_images_per_s"] > 0 and row["train_images_per_s"] > 0
        assert 0 <= row["data_wait_share"] <= 1 and row["profile"]["top"]
    assert profile["chosen_batch_size"] == max(profile["rows"], key=lambda r: r["train_images_per_s"])["batch_size"]
    assert "| batch | loader img/s |" in (tmp_path / "run" / "profile.md").read_text()
    assert first["stopped"] == "time" and first["steps"] >= 1 and not first["resumed"]
    exported = {p.name for p in (tmp_path / "export").iterdir()}
    want = {"model.safetensors", "config.json", "profile.json", "profile.md", "train_log.csv", "sprint.json",
            "sprint.log"}
    assert want <= exported
    # the same command again: no second profile, the run goes on from its last state
    assert main([*args, "--minutes", "0.3"]) == 0
    second = json.loads((tmp_path / "run" / "sprint.json").read_text())
    assert second["resumed"] and second["steps"] > first["steps"]
    assert "the setting chosen before" not in capsys.readouterr().out  # --no-progress: quiet
    from tellkit.checkpoint import load_model

    assert load_model(tmp_path / "export").config.d_model == load_yaml(resolve_config_path("bttr/tiny"))["model"][
        "d_model"]
