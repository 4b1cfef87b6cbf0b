"""Faults during training lose nothing: a kill -9 at any phase of a save, damaged newest states,
a full disk, and the loss-logging window across a resume (toy task, CPU, seconds per run)."""
from __future__ import annotations

import csv
import errno
import json
import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402

from tellkit.errors import TellkitError  # noqa: E402
from tellkit.training import run_states  # noqa: E402
from tellkit.workflows import train_recipe as train  # noqa: E402

# 24 samples / batch 4 = 6 steps; saves: #1 step 3, #2 step 6 (periodic), #3 step 6 again (after
# validation, best) -- the re-save of a step that already has a folder
RECIPE = {"max_epochs": 1}
SAVE = {"save_every_steps": 3}
PHASES = ["begin", "tmp_created", "write:rng_rank0.safetensors", "rng", "write:model.safetensors",
          "write:config.json", "model", "write:optimizer.safetensors", "optimizer",
          "write:trainer_state.json", "state", "renamed", "last"]


def weights(run_dir: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "checkpoints" / which / "model.safetensors"))


def run(out, **kw):
    return train(toy_task.recipe(**RECIPE), out, progress=False, **{**SAVE, **kw})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run(out)
    return out


@pytest.fixture(scope="module")
def ctx():
    # children are forked from a server that has imported torch and tellkit but run nothing
    # (forking this test process after it trained could deadlock on its thread pools)
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "toy_task", "tellkit.training.loop", "torch.utils.tensorboard",
                              "safetensors.torch", "tqdm.auto"])
    return c


def killed_run(ctx, out: Path, fault: str) -> None:
    p = ctx.Process(target=toy_task.train_in_child, args=(str(out), fault, SAVE, RECIPE))
    p.start()
    p.join(120)
    assert p.exitcode == -9, f"the run was not killed at {fault} (exit {p.exitcode})"


def assert_same(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f"3:{p}" for p in [*PHASES, "best", "pruned"]]
                         + [f"2:{p}" for p in ("write:model.safetensors", "renamed", "last")])
def test_kill_at_any_phase_of_a_save_then_resume_bit_exact(ctx, reference, tmp_path, fault):
    """kill -9 in the middle of a save (save 3 re-saves step 6, which save 2 already wrote and
    ``last`` points at): a complete state survives and --resume ends exactly like an unbroken run."""
    out = tmp_path / "run"
    killed_run(ctx, out, fault)
    assert (out / "checkpoints" / "last").exists()
    summary = run(out, resume=True)
    assert summary["steps"] == 6
    assert_same(reference, out)
    ck = out / "checkpoints"
    assert not list(ck.glob("*.tmp"))
    names = {p.name for p in ck.iterdir() if p.name.startswith("step_")}
    # a kill after `last` moved but before pruning leaves the replaced state until the next save
    assert (ck / "last").resolve().name in names and len(names) <= 2, names


@pytest.mark.slow
def test_kill_during_the_first_save_leaves_a_fresh_start_possible(ctx, reference, tmp_path):
    out = tmp_path / "run"
    killed_run(ctx, out, "1:state")
    with pytest.raises(TellkitError, match="no intact checkpoint"):
        run(out, resume=True)
    run(out)  # nothing complete was saved: starting again into the same folder is allowed
    assert_same(reference, out)
    steps = [int(x["step"]) for x in csv.DictReader(open(out / "train_log.csv"))]
    assert steps == list(range(1, 7))  # the killed attempt's rows are gone


def test_resave_of_a_step_never_removes_the_state_last_points_at(reference, tmp_path, monkeypatch):
    """The reported data loss, without a kill: the end-of-epoch save of step 6 (already saved
    periodically; older states pruned) fails while writing the model."""
    real = run_states.save_model
    calls = {"n": 0}

    def dies_on_third(model, directory, extra=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        return real(model, directory, extra)

    monkeypatch.setattr(run_states, "save_model", dies_on_third)
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path / "run")
    monkeypatch.setattr(run_states, "save_model", real)
    last = tmp_path / "run" / "checkpoints" / "last"
    assert json.loads((last / "trainer_state.json").read_text())["step"] == 6
    run(tmp_path / "run", resume=True)
    assert_same(reference, tmp_path / "run")


# --- damaged newest state: fall back with one warning line, or stop with one line ------------
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped after step 8 of 12 with ``last`` = step 8 and ``best`` = step 6, and the
    unbroken run to compare with."""
    base = tmp_path_factory.mktemp("stopped")
    r = toy_task.recipe(max_epochs=2)
    crashing = toy_task.ToyTask(r)
    crashing.crash_after_batches = 6 + 2 + 2  # epoch 0 (6 train + 2 val batches), steps 7, 8
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(r, base / "run", task=crashing, save_every_steps=4, progress=False)
    ck = base / "run" / "checkpoints"
    assert (ck / "last").resolve().name == "step_00000008" and (ck / "best").resolve().name.startswith("step_00000006")
    train(r, base / "full", save_every_steps=4, progress=False)
    return base


def two_states(stopped_run, tmp_path) -> Path:
    import shutil

    shutil.copytree(stopped_run / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run" / "checkpoints"


def _truncate(d: Path):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _nan(d: Path):
    w = load_file(str(d / "model.safetensors"))
    w["hid.weight"][0, 0] = float("nan")
    save_file(w, str(d / "model.safetensors"))


def _write(name: str, data: str):
    return lambda d: (d / name).write_text(data)


DAMAGE = {
    "truncated tensors": (_truncate, "model.safetensors unreadable"),
    "empty optimizer tensors": (_write("optimizer.safetensors", ""), "optimizer.safetensors unreadable"),
    "bad JSON state": (_write("trainer_state.json", '{"step": 8, "epo'), "trainer_state.json: unreadable"),
    "state not a mapping": (_write("trainer_state.json", "[1, 2]"), "trainer_state.json: not a mapping"),
    "missing optimizer": (lambda d: (d / "optimizer.json").unlink(), "optimizer.json: missing"),
    "missing RNG": (lambda d: (d / "rng_rank0.safetensors").unlink(), "rng_rank0.safetensors missing"),
    "dangling last": (lambda d: __import__("shutil").rmtree(d),
                      "checkpoints/last points at step_00000008, which does not exist"),
    "NaN weights": (_nan, "hid.weight holds NaN"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_state_falls_back_to_the_newest_intact_one(stopped_run, tmp_path, capsys, kind):
    damage, reason = DAMAGE[kind]
    ck = two_states(stopped_run, tmp_path)
    damage(ck / "step_00000008")
    capsys.readouterr()
    summary = train(toy_task.recipe(max_epochs=2), tmp_path / "run", resume=True, save_every_steps=4, progress=False)
    out = capsys.readouterr().out
    warning = [line for line in out.splitlines() if "warning:" in line]
    assert len(warning) == 1 and reason in warning[0] and "resuming from step_00000006" in warning[0], out
    assert summary["steps"] == 12
    assert_same(stopped_run / "full", tmp_path / "run")


def test_no_intact_state_stops_with_one_line(stopped_run, tmp_path):
    ck = two_states(stopped_run, tmp_path)
    for d in ck.glob("step_*"):
        (d / "trainer_state.json").write_text("")
    with pytest.raises(TellkitError) as err:
        train(toy_task.recipe(max_epochs=2), tmp_path / "run", resume=True, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--resume: no intact checkpoint") and "step_00000008" in msg


# --- disk full ---------------------------------------------------------------------------------
def test_disk_full_during_a_save_is_one_line_and_keeps_the_last_state(tmp_path, monkeypatch, capsys):
    import yaml

    from tellkit import checkpoint
    from tellkit.cli import main

    real = checkpoint.atomic_write_bytes
    state = {"armed": False}

    def full_disk(path, data):
        if state["armed"] and Path(path).name == "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=1)))
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "atomic_write_bytes", full_disk)
    real_save = run_states.save_rng

    def arm_after_first(directory, rank):  # the first save succeeds, the second finds the disk full
        real_save(directory, rank)
        state["armed"] = "step_00000003" not in str(directory)

    monkeypatch.setattr(run_states, "save_rng", arm_after_first)
    code = main(["train", str(cfg), "--out", str(out), "--save-every-steps", "3", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "No space left on device" in err[0] and "the last good state step_00000003 is intact" in err[0]
    ck = out / "checkpoints"
    assert (ck / "last").resolve().name == "step_00000003" and not list(ck.glob("*.tmp"))
    state["armed"] = False
    monkeypatch.setattr(run_states, "save_rng", real_save)
    assert main(["train", str(cfg), "--out", str(out), "--resume", "--save-every-steps", "3", "--no-progress"]) == 0


# --- the loss-logging window ---------------------------------------------------------------------
def test_first_logged_loss_after_resume_equals_the_unbroken_run(tmp_path):
    """log_every 4, crash after the step-6 save: the row at step 8 averages steps 5..8 both ways."""
    r = toy_task.recipe(max_epochs=2, log_every=4)
    train(r, tmp_path / "full", progress=False, save_every_steps=3)
    crashing = toy_task.ToyTask(r)
    crashing.crash_after_batches = 6 + 2 + 1  # epoch 0 with validation, then step 7's batch
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(r, tmp_path / "run", task=crashing, progress=False, save_every_steps=3)
    train(r, tmp_path / "run", resume=True, progress=False, save_every_steps=3)
    rows = {d: list(csv.DictReader(open(tmp_path / d / "train_log.csv"))) for d in ("full", "run")}
    assert [x["step"] for x in rows["run"]] == [x["step"] for x in rows["full"]] == ["4", "8", "12"]
    for a, b in zip(rows["full"], rows["run"]):
        assert (a["loss"], a["tokens"]) == (b["loss"], b["tokens"]), a["step"]
