"""`tellkit train` in a child process (the toy task) against damaged states and bad start-ups:
a state whose tensors do not fit the run, or whose data position is past its epoch, is skipped
for the newest intact one with the one-line warning; a bad recipe or run folder is one line,
before any data is read."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import toy_task  # noqa: E402
from cli_checks import one_line_error  # noqa: E402

CLI = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import toy_task; from tellkit.cli import main; "
       "sys.exit(main(sys.argv[1:]))")


def tellkit(*args, preexec_fn=None, timeout=180):
    return subprocess.run([sys.executable, "-c", CLI, str(FIXTURES), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn, env={**os.environ, "HF_HUB_OFFLINE": "1"})




@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "toy.yaml"
    p.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=1)))
    return p


@pytest.fixture(scope="module")
def finished_run(cfg, tmp_path_factory):
    """Saves at steps 3 and 6, and step 6 again after validation (the newest, ``last``)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    res = tellkit("train", cfg, "--out", out, "--save-every-steps", 3, "--keep-checkpoints", 2, "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def newest(run: Path) -> Path:
    return (run / "checkpoints" / "last").resolve()


def damage_weights(state: Path):
    t = load_file(str(state / "model.safetensors"))
    key = next(k for k, v in t.items() if v.dim() == 2)
    t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
    save_file(t, str(state / "model.safetensors"))
    return "model.safetensors: tensor"


def damage_optimizer(state: Path):
    t = load_file(str(state / "optimizer.safetensors"))
    key = next(k for k, v in t.items() if v.dim() == 2)
    t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 3)
    save_file(t, str(state / "optimizer.safetensors"))
    return "optimizer.safetensors:"


def damage_position(state: Path):
    f = state / "trainer_state.json"
    st = json.loads(f.read_text())
    st["pos"] = 10_000
    f.write_text(json.dumps(st))
    return "data position 10000 is past the"


def _edit_json(state: Path, name: str, edit) -> None:
    f = state / name
    obj = json.loads(f.read_text())
    edit(obj)
    f.write_text(json.dumps(obj))  # NaN as JSON's NaN extension, as a damaged writer would leave it


def damage_step(state: Path):
    _edit_json(state, "trainer_state.json", lambda st: st.update(step=2**70))
    return "'step' is 1180591620717411303424, not a count"


def damage_epoch(state: Path):
    _edit_json(state, "trainer_state.json", lambda st: st.update(epoch=10**9))
    return "'epoch' is 1000000000, not a count"


def damage_epoch_past_steps(state: Path):
    _edit_json(state, "trainer_state.json", lambda st: st.update(epoch=st["step"] + 1))
    return "after only"


def damage_window_loss(state: Path):
    _edit_json(state, "trainer_state.json", lambda st: st.update(window_loss=float("nan")))
    return "'window_loss' is nan, not a finite number"


def damage_world(state: Path):
    _edit_json(state, "trainer_state.json", lambda st: st.update(world=0))
    return "'world' is 0, not a number of processes"


def damage_lr(state: Path):
    _edit_json(state, "optimizer.json", lambda o: o["param_groups"][0].update(lr=float("nan")))
    return "optimizer.json: 'param_groups[0].lr' is nan"


def damage_negative_lr(state: Path):
    _edit_json(state, "optimizer.json", lambda o: o["param_groups"][0].update(lr=-1.0))
    return "optimizer.json: parameter group 0 has learning rate -1.0"


@pytest.mark.parametrize("damage", [damage_weights, damage_optimizer, damage_position, damage_step, damage_epoch,
                                    damage_epoch_past_steps, damage_window_loss, damage_world, damage_lr,
                                    damage_negative_lr])
def test_resume_falls_back_past_a_state_that_does_not_fit(finished_run, cfg, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    bad = newest(run)
    needle = damage(bad)
    res = tellkit("train", cfg, "--out", run, "--resume", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    warning = [ln for ln in res.stdout.splitlines() if "warning:" in ln]
    assert len(warning) == 1 and needle in warning[0] and f"{bad.name}:" in warning[0], res.stdout
    assert "resuming from step_" in warning[0] and f"resuming from {bad.name}" not in warning[0], warning
    assert "Traceback" not in res.stderr


def test_a_checkpoints_path_that_is_a_file_is_refused_at_start_up(cfg, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("not a folder")
    one_line_error(tellkit("train", cfg, "--out", tmp_path / "run", "--no-progress"), "checkpoints",
                   "exists and is not a folder")
    assert not (tmp_path / "run" / "config.yaml").exists()


def _tiny_file_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


def test_a_full_disk_at_start_up_is_one_line(cfg, tmp_path):
    res = tellkit("train", cfg, "--out", tmp_path / "run", "--no-progress", preexec_fn=_tiny_file_limit)
    one_line_error(res, "cannot write the run folder", "File too large")


@pytest.mark.parametrize("overrides, needle", [(["model.dim=-32"], "the model does not build"),
                                               (["train.lr=.nan"], "train.lr: expected a finite number"),
                                               (["train.lr=.inf"], "train.lr: expected a finite number"),
                                               (["train.lr=-1"], "train.lr must be a positive finite number"),
                                               (["train.eps=.nan"], "train.eps: expected a finite number"),
                                               (["train.seed=.nan"], "train.seed: expected a whole number"),
                                               (["train.seed=x"], "train.seed: expected a whole number")])
def test_bad_model_or_train_settings_are_one_line(cfg, tmp_path, overrides, needle):
    one_line_error(tellkit("train", cfg, *overrides, "--out", tmp_path / "run", "--no-progress"), needle)


def test_out_under_proc_is_one_line(cfg):
    one_line_error(tellkit("train", cfg, "--out", "/proc/tellkit-run/x", "--no-progress"), "/proc/tellkit-run")


def _anchors(_saved: str) -> str:
    return "a: &x [1, *x]\n"


def _many_values(_saved: str) -> str:
    return "train:\n  steps: [" + ", ".join(["0"] * 150_000) + "]\n"


def _too_large(saved: str) -> str:
    return saved + "# " + "x" * (1 << 20) + "\n"


def _deep(_saved: str) -> str:
    return "a: " + "[" * 200 + "]" * 200 + "\n"


@pytest.mark.parametrize("make, needle", [(_anchors, "anchors and aliases"), (_many_values, "more than 100,000 values"),
                                          (_too_large, "larger than the 1,048,576 bytes"),
                                          (_deep, "nested more than 64 levels")])
def test_resume_reads_the_runs_config_yaml_within_a_recipes_bounds(finished_run, cfg, tmp_path, make, needle):
    """A run folder's config.yaml is read as a recipe is: size, values, depth, no aliases."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    saved = (run / "config.yaml").read_text()
    assert "&" not in saved and "*" not in saved  # written without aliases, so it reads back
    (run / "config.yaml").write_text(make(saved))
    one_line_error(tellkit("train", cfg, "--out", run, "--resume", "--no-progress"), "--resume:", needle)
