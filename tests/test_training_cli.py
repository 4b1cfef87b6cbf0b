"""`tellkit train` / `evaluate` / `model-info` on bad input: one line on stderr, exit 2."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402

from tellkit.cli import main  # noqa: E402


@pytest.fixture()
def cfg(tmp_path):
    p = tmp_path / "toy.yaml"
    p.write_text(yaml.safe_dump(toy_task.recipe(max_steps=2)))
    return p


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def test_out_that_is_a_file(cfg, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["train", str(cfg), "--out", str(f), "--no-progress"]) == 2
    one_line_error(capsys, "exists and is not a folder")


@pytest.mark.parametrize("content", ["", "[1, 2]\n", "key: [unclosed\n"])
def test_empty_list_or_broken_config_yaml_on_resume(cfg, tmp_path, capsys, content):
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    (out / "config.yaml").write_text(content)
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(out), "--resume", "--no-progress"]) == 2
    one_line_error(capsys, "config.yaml")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu(cfg, tmp_path, capsys):
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--device", "cuda", "--no-progress"]) == 2
    one_line_error(capsys, "no CUDA GPU")


def test_device_bogus_is_not_reported_as_corrupt_weights(cfg, tmp_path, capsys):
    from tellkit import load_model
    from tellkit.errors import TellkitError

    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--device", "bogus", "--no-progress"]) == 2
    one_line_error(capsys, "unknown device 'bogus'")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "r"), "--device", "bogus", "--no-progress"]) == 2
    assert "corrupt" not in one_line_error(capsys, "unknown device 'bogus'")
    with pytest.raises(TellkitError, match="unknown device 'bogus'"):
        load_model(tmp_path / "r" / "checkpoints" / "last", map_location="bogus")


def test_unknown_top_level_section_is_refused(tmp_path, capsys):
    p = tmp_path / "typo.yaml"
    p.write_text(yaml.safe_dump({**toy_task.recipe(max_steps=1), "trian": {"lr": 1.0}}))
    assert main(["train", str(p), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    one_line_error(capsys, "unknown top-level section(s) trian")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag", [["--save-every-steps", "-1"], ["--save-every-steps", "0"],
                                  ["--save-every-minutes", "-5"]])
def test_negative_save_intervals_are_refused(cfg, tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(cfg), "--out", str(tmp_path / "r"), *flag])
    assert exit_.value.code == 2
    one_line_error(capsys, flag[0])
    assert not (tmp_path / "r").exists()
    from tellkit.errors import TellkitError
    from tellkit.workflows import train_recipe as train

    with pytest.raises(TellkitError, match="save-every"):
        kw = {"save_every_steps": -1} if "steps" in flag[0] else {"save_every_minutes": -5.0}
        train(toy_task.recipe(max_steps=1), tmp_path / "r2", progress=False, **kw)


def test_fresh_start_into_a_run_folder_is_refused_with_one_line(cfg, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    one_line_error(capsys, "already holds a run", "--resume")
