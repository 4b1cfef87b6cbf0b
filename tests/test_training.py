"""The generic training loop on a toy task: schedule, accumulation, logs, checkpoints, resume."""
from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402  (registers the "toy" task and "toy_lm" model)

from tellkit.errors import TellkitError  # noqa: E402
from tellkit.recipes import train_config  # noqa: E402
from tellkit.training import TrainConfig, run_states  # noqa: E402
from tellkit.training.loop import LRSchedule, epoch_batches  # noqa: E402
from tellkit.workflows import train_recipe as train  # noqa: E402


def weights(run_dir: Path, which: str = "last") -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "checkpoints" / which / "model.safetensors"))


def run(recipe, out, **kw):
    kw.setdefault("progress", False)
    return train(recipe, out, **kw)


def test_defaults_are_the_reference_recipe():
    c = TrainConfig()
    assert (c.optimizer, c.lr, c.betas, c.eps, c.weight_decay) == ("adamw", 1e-4, (0.9, 0.98), 1e-6, 1e-5)
    assert (c.scheduler, c.warmup, c.clip_norm) == ("linear_warmup", 0.05, 0.1)
    with pytest.raises(TellkitError, match="unknown key"):
        train_config({"train": {"learning_rate": 1}})
    with pytest.raises(TellkitError, match="optimizer"):
        train_config({"train": {"optimizer": "sgd"}})
    assert train_config({"train": {"lr": "3e-4", "betas": [0.9, 0.999]}}).betas == (0.9, 0.999)


def test_linear_warmup_then_linear_decay():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    s = LRSchedule(TrainConfig(lr=1.0, warmup=0.05), opt, total_steps=100, mode="min")
    lrs = [s.apply(i, 0) for i in range(100)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert lrs[5] == pytest.approx(1.0) and lrs[62] == pytest.approx(0.4)
    assert lrs[99] == pytest.approx(1 / 95)
    step = LRSchedule(TrainConfig(lr=1.0, scheduler="step", step_every_epochs=2, step_gamma=0.5), opt, 10, "min")
    assert [step.factor(0, e) for e in range(5)] == [1, 1, 0.5, 0.5, 0.25]
    plat = LRSchedule(TrainConfig(lr=1.0, scheduler="plateau", plateau_patience=1, plateau_factor=0.1), opt, 10, "max")
    for v in (1.0, 0.5, 0.5):
        plat.on_eval(v)
    assert plat.factor(0, 0) == pytest.approx(0.1)


def test_trains_logs_and_saves(tmp_path):
    r = toy_task.recipe(max_epochs=6)
    summary = run(r, tmp_path / "run")
    rows = list(csv.DictReader(open(tmp_path / "run" / "train_log.csv")))
    assert len(rows) == summary["steps"] == 6 * 6  # 24 samples / batch 4
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])
    evals = [r for r in csv.DictReader(open(tmp_path / "run" / "eval_log.csv")) if r["metric"] == "loss"]
    assert len(evals) == 6
    saved = yaml_load(tmp_path / "run" / "config.yaml")
    assert saved["train"]["betas"] == [0.9, 0.98] and saved["train"]["lr"] == 0.05  # defaults resolved
    meta = json.loads((tmp_path / "run" / "checkpoints" / "best" / "config.json").read_text())
    assert meta["task"] == "toy" and meta["family"] == "toy_lm" and meta["train"]["max_epochs"] == 6
    assert (tmp_path / "run" / "tensorboard").is_dir()
    with pytest.raises(TellkitError, match="already holds a run"):
        run(r, tmp_path / "run")


def yaml_load(p):
    import yaml

    return yaml.safe_load(Path(p).read_text())


def test_accumulation_equals_one_big_batch(tmp_path):
    """batch 8 x 1 micro-batch == batch 4 x 2 micro-batches (token-weighted), same samples."""
    big = toy_task.recipe(batch_size=8, max_steps=1, clip_norm=0.0)
    small = toy_task.recipe(batch_size=4, accumulate=2, max_steps=1, clip_norm=0.0)
    for r in (big, small):
        r["model"]["dropout"] = 0.0
    run(big, tmp_path / "big")
    run(small, tmp_path / "small")
    a, b = weights(tmp_path / "big"), weights(tmp_path / "small")
    init = toy_task.ToyLM(toy_task.ToyConfig(dropout=0.0))
    assert any(not torch.equal(a[k], v) for k, v in init.state_dict().items())  # it did move
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    ga, gb = (next(csv.DictReader(open(tmp_path / d / "train_log.csv")))["grad_norm"] for d in ("big", "small"))
    assert float(ga) == pytest.approx(float(gb), rel=1e-6)


def test_samples_per_epoch_streams_over_passes():
    task = toy_task.ToyTask(toy_task.recipe())
    ds = task.build_dataset("train")  # 24 samples
    cfg = TrainConfig(batch_size=4, samples_per_epoch=16)
    e0, e1, e2 = (epoch_batches(task, ds, cfg, e, 1) for e in range(3))
    assert len(e0) == len(e1) == len(e2) == 4
    flat = [i for b in e0 + e1 + e2 for i in b]
    assert sorted(flat[:24]) == list(range(24))  # the first pass is used up before the second


def test_resume_after_crash_gives_identical_weights(tmp_path):
    """A crash at step 9 of 12, resumed from the step-8 checkpoint, ends like an unbroken run
    (dropout on: the RNG state is part of the checkpoint; an epoch boundary with validation lies
    between the checkpoint and the end)."""
    r = toy_task.recipe(max_epochs=2)  # 6 steps per epoch
    run(r, tmp_path / "full", save_every_steps=4)

    crashing = toy_task.ToyTask(r)
    crashing.crash_after_batches = 6 + 2 + 2  # epoch 0 (6 train + 2 val batches), then steps 7, 8
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "broken", task=crashing, save_every_steps=4)
    state = json.loads((tmp_path / "broken" / "checkpoints" / "last" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["pos"]) == (8, 1, 2)
    summary = run(r, tmp_path / "broken", resume=True, save_every_steps=4)
    assert summary["steps"] == 12
    a, b = weights(tmp_path / "full"), weights(tmp_path / "broken")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the CSV log was cut back to the resumed step, so no step appears twice
    rows = list(csv.DictReader(open(tmp_path / "broken" / "train_log.csv")))
    assert [int(x["step"]) for x in rows] == list(range(1, 13))
    # the clock goes on from the saved state: elapsed never falls back, and the summary counts both processes
    elapsed = [float(x["elapsed_s"]) for x in rows]
    assert elapsed == sorted(elapsed) and elapsed[8] >= state["seconds"] > 0
    assert summary["elapsed_s"] >= elapsed[-1]


def test_logged_train_seconds_adds_up_processes_that_restarted_the_clock(tmp_path):
    from tellkit.training.loop import logged_train_seconds

    log = tmp_path / "train_log.csv"
    log.write_text("step,epoch,loss,elapsed_s\n100,0,1.0,50\n200,0,1.0,100\n300,1,0.9,20\n400,1,0.8,70\n"
                   "500,1,0.8,110\n", encoding="utf-8")  # a resume from a state saved without a clock
    assert logged_train_seconds(log) == 100 + 110
    log.write_text("step,epoch,loss,elapsed_s\n100,0,1.0,50\n200,0,1.0,100\n300,1,0.9,130\n", encoding="utf-8")
    assert logged_train_seconds(log) == 130
    assert logged_train_seconds(tmp_path / "missing.csv") == 0.0


def test_resume_with_other_batches_says_so(tmp_path, capsys):
    """Code that batches differently (a new sampler, other data) cannot continue an epoch exactly:
    the resume goes on, and the log says what happened to the interrupted epoch."""
    r = toy_task.recipe(max_epochs=2)
    crashing = toy_task.ToyTask(r)
    crashing.crash_after_batches = 6 + 2 + 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(r, tmp_path / "run", task=crashing, save_every_steps=4)

    class Reordered(toy_task.ToyTask):
        def batch_sampler(self, dataset, split, *, shuffle, seed, epoch):
            order = list(range(len(dataset)))[::-1]
            return [order[i : i + 4] for i in range(0, len(order), 4)]

    shutil.copytree(tmp_path / "run", tmp_path / "same", symlinks=True)
    capsys.readouterr()
    run(r, tmp_path / "same", resume=True)
    assert "differ from those" not in capsys.readouterr().out
    summary = run(r, tmp_path / "run", resume=True, task=Reordered(r))
    out = capsys.readouterr().out
    assert "warning: the batches of epoch 1 differ from those this run was saved with" in out
    assert "from batch 2 of the new order" in out and summary["steps"] == 12


def test_crash_while_saving_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    """A write that fails half-way (disk full) stops with one line; the half-written state never
    gets a final name, the previous one stays, and --resume finishes the run."""
    r = toy_task.recipe(max_epochs=1)
    real = run_states.save_optimizer
    calls = {"n": 0}

    def flaky(opt, directory):
        calls["n"] += 1
        if calls["n"] == 2:
            (directory / "optimizer.safetensors").write_bytes(b"half a fi")
            raise OSError("disk full")
        real(opt, directory)

    monkeypatch.setattr(run_states, "save_optimizer", flaky)
    with pytest.raises(TellkitError,
                       match=r"step 4 not saved \(OSError: disk full\); the last good state step_00000002"):
        run(r, tmp_path / "run", save_every_steps=2)
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "last").resolve().name == "step_00000002"
    assert not list(ck.glob("*.tmp"))  # the half-written state was removed
    monkeypatch.setattr(run_states, "save_optimizer", real)
    summary = run(r, tmp_path / "run", resume=True, save_every_steps=2)
    assert summary["steps"] == 6
    assert not list(ck.glob("*.tmp"))
    # step 6 was saved twice (periodic, then after validation): the second save got a new name
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000006-1"]
    assert (ck / "last").resolve() == (ck / "best").resolve() == ck / "step_00000006-1"


def test_early_stopping_on_a_max_metric(tmp_path):
    r = toy_task.recipe(max_epochs=20, patience=2)

    class Worse(toy_task.ToyTask):
        monitor, monitor_mode = "accuracy", "max"
        calls = 0

        def score(self, predictions):
            Worse.calls += 1
            assert len(predictions) == 7  # the whole val split, once
            return {"accuracy": 1.0 / Worse.calls}

    s = run(r, tmp_path / "run", task=Worse(r))
    assert s["stopped"] == "early_stopping" and s["epochs"] == 3 and s["best_step"] == 6
    assert (tmp_path / "run" / "checkpoints" / "best").resolve().name == "step_00000006"


def test_ties_on_the_monitor_go_to_the_tiebreakers(tmp_path):
    """ExpRate stays 0 for the first epochs of a BTTR run: <=1 errors then decides the best."""
    r = toy_task.recipe(max_epochs=4, patience=None, scheduler="plateau", plateau_patience=0,
                        plateau_factor=0.5)
    scores = [(0.0, 1.0), (0.0, 3.0), (0.0, 2.0), (0.0, 2.0)]

    class Tied(toy_task.ToyTask):
        monitor, monitor_mode = "accuracy", "max"
        monitor_tiebreak = (("near", "max"), ("loss", "min"))
        calls = 0

        def score(self, predictions):
            Tied.calls += 1
            acc, near = scores[Tied.calls - 1]
            return {"accuracy": acc, "near": near}

    s = run(r, tmp_path / "run", task=Tied(r))
    assert s["best_step"] == 12 and s["best"] == 0.0  # epoch 2: the most near misses
    state = json.loads((tmp_path / "run" / "checkpoints" / "last" / "trainer_state.json").read_text())
    assert state["best_key"][:2] == [0.0, 3.0] and state["bad_evals"] == 2
    # plateau halves the lr after each of the two evaluations that did not beat epoch 2
    assert state["schedule"]["plateau_scale"] == pytest.approx(0.25)
    with pytest.raises(TellkitError, match="monitors 'near'"):
        Tied(r).monitor_key({"accuracy": 1.0, "loss": 0.0})


def test_plateau_state_saved_before_tiebreakers_still_loads():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    plat = LRSchedule(TrainConfig(lr=1.0, scheduler="plateau", plateau_patience=0), opt, 10, "min")
    plat.load_state_dict({"plateau_scale": 1.0, "plateau_best": 2.0, "plateau_bad": 0})  # a bare loss
    plat.on_eval((-2.0, 5.0))  # same loss, a tie-breaker on top: better than the bare value
    assert plat.plateau_scale == 1.0 and plat.plateau_best == [-2.0, 5.0]
    plat.on_eval(2.5)  # a worse bare loss
    assert plat.plateau_scale == 0.5


def test_optimizer_state_round_trip_without_pickle(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    run_states.save_optimizer(opt, tmp_path)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    run_states.load_optimizer(opt2, tmp_path)
    a, b = opt.state_dict(), opt2.state_dict()
    for k in a["state"][0]:
        assert torch.equal(a["state"][0][k], b["state"][0][k])
    assert a["param_groups"][0]["betas"] == tuple(b["param_groups"][0]["betas"])


def test_cli_train_then_evaluate(tmp_path, capsys):
    import yaml

    from tellkit.cli import main

    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=1)))
    out = tmp_path / "run"
    assert main(["train", str(cfg), "train.max_epochs=2", "data.val=5", "--out", str(out), "--no-progress"]) == 0
    assert yaml_load(out / "config.yaml")["train"]["max_epochs"] == 2
    assert main(["evaluate", str(out), "data.test=3", "--split", "test", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    res = json.loads(printed[printed.rfind('{\n  "split"'):])
    assert res["n"] == 3 and 0.0 <= res["metrics"]["accuracy"] <= 1.0 and res["metrics"]["loss"] > 0
    lines = (out / "eval" / "predictions_test.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["id"].startswith("s2-")
    assert json.loads((out / "eval" / "metrics_test.json").read_text())["metrics"] == res["metrics"]
    # bad input: one line, exit 2
    assert main(["evaluate", str(tmp_path / "nope"), "--split", "test"]) == 2
    assert main(["train", str(cfg), "train.optimizer=sgd", "--out", str(tmp_path / "r2")]) == 2
    assert "train.optimizer must be one of" in capsys.readouterr().err
    # evaluate refuses an unknown model key as train does, and a model setting it would ignore
    assert main(["train", str(cfg), "model.zzz=1", "--out", str(tmp_path / "r3")]) == 2
    train_err = capsys.readouterr().err.strip()
    assert "unknown key(s) zzz" in train_err
    assert main(["evaluate", str(out), "model.zzz=1", "--split", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.split(": error: ", 1)[1] == train_err.split(": error: ", 1)[1] and len(err.splitlines()) == 1
    assert main(["evaluate", str(out), "model.dim=16", "--split", "test"]) == 2
    assert "model.dim: the model is rebuilt from the checkpoint" in capsys.readouterr().err


def test_sigterm_saves_and_stops_then_resumes(tmp_path):
    """SIGTERM (preemption) mid-epoch: the step finishes, a checkpoint is written, training
    stops; --resume then ends with the same weights as an unbroken run."""
    import os
    import signal

    r = toy_task.recipe(max_epochs=2)
    run(r, tmp_path / "full")

    class Preempted(toy_task.ToyTask):
        def collate(self, samples):
            if self.collated == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().collate(samples)

    s = run(r, tmp_path / "run", task=Preempted(r))
    assert s["stopped"] == "signal" and s["steps"] == 4
    s = run(r, tmp_path / "run", resume=True)
    assert s["steps"] == 12
    a, b = weights(tmp_path / "full"), weights(tmp_path / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_export_half_precision_inference_checkpoint(tmp_path):
    from tellkit import load_model
    from tellkit.export.safetensors import export_safetensors

    run(toy_task.recipe(max_epochs=1, num_workers=1), tmp_path / "run")
    src = tmp_path / "run" / "checkpoints" / "best"
    assert json.loads((src / "config.json").read_text())["train"]["num_workers"] == 1
    out = export_safetensors(src, tmp_path / "export", note={"trained_on": "toy"})
    meta = json.loads((out / "config.json").read_text())
    assert meta["task"] == "toy" and meta["train"]["max_epochs"] == 1 and meta["note"] == {"trained_on": "toy"}
    assert meta["train"]["num_workers"] == 0  # a setting of the training machine, not of the model
    assert meta["weights_dtype"] == "float16" and not (out / "optimizer.safetensors").exists()
    a, b = load_model(src), load_model(out)
    assert next(b.parameters()).dtype == torch.float32
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
    assert all(t.dtype == torch.float16 for t in load_file(str(out / "model.safetensors")).values())


def test_cli_export_writes_replaces_and_refuses(tmp_path, capsys):
    from tellkit import load_model
    from tellkit.cli import main

    run(toy_task.recipe(max_epochs=1), tmp_path / "run")
    out = tmp_path / "packaged"
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--note", "trained_on=toy"]) == 0
    assert "float16 weights" in capsys.readouterr().out
    meta = json.loads((out / "config.json").read_text())
    assert meta["note"] == {"trained_on": "toy"} and meta["weights_dtype"] == "float16"
    before = (out / "model.safetensors").read_bytes()
    # bad input: one line, exit 2, the existing folder untouched
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2
    assert "not empty (use --replace" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "o"), "--note", "x"]) == 2
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "other"), "--replace"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine" and not (tmp_path / "o").exists()
    assert (out / "model.safetensors").read_bytes() == before
    # --replace swaps in a whole new checkpoint (here float32), keeps the folder's other files
    # (a packaged model's README) and leaves no staging folders
    (out / "README.md").write_text("about the model")
    assert main(["export", str(tmp_path / "run"), "--out", str(out), "--replace", "--float32"]) == 0
    assert "kept from the replaced folder: README.md" in capsys.readouterr().out
    assert (out / "README.md").read_text() == "about the model"
    assert json.loads((out / "config.json").read_text())["weights_dtype"] == "float32"
    assert "note" not in json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "packaged", "run"]
    assert next(load_model(out).parameters()).dtype == torch.float32


def test_init_from_starts_a_new_run_from_trained_weights(tmp_path):
    """train.init_from (staged training / fine-tuning): the weights come from the checkpoint,
    the optimizer and schedule start fresh; another model shape is refused with a clear error."""
    first = run(toy_task.recipe(max_epochs=3), tmp_path / "a")
    trained = weights(tmp_path / "a", "best")
    fresh = run(toy_task.recipe(max_steps=1, lr=1e-12), tmp_path / "fresh")
    assert fresh["steps"] == 1
    second = run(toy_task.recipe(max_steps=1, lr=1e-12, init_from=str(tmp_path / "a")), tmp_path / "b")
    assert second["steps"] == 1 and first["steps"] == 18
    got = weights(tmp_path / "b")
    assert all(torch.allclose(got[k], trained[k], atol=1e-6) for k in trained)  # one step at lr 1e-12 moves nothing
    assert not all(torch.allclose(weights(tmp_path / "fresh")[k], trained[k], atol=1e-3) for k in trained)
    # first logged training loss: from the trained weights it starts where run "a" ended
    loss = lambda d: float(list(csv.DictReader(open(d / "train_log.csv")))[0]["loss"])  # noqa: E731
    assert loss(tmp_path / "b") < loss(tmp_path / "fresh")

    bad = toy_task.recipe(max_steps=1, init_from=str(tmp_path / "a"))
    bad["model"]["dim"] = 6
    with pytest.raises(TellkitError, match="do not fit this model"):
        run(bad, tmp_path / "c")
    with pytest.raises(TellkitError, match="checkpoint not found"):
        run(toy_task.recipe(max_steps=1, init_from=str(tmp_path / "nope")), tmp_path / "d")


def test_keep_checkpoints_and_average_them(tmp_path, capsys):
    """--keep-checkpoints N keeps the states of the N newest steps besides last/best; tellkit
    average writes the element-wise mean of their weights as an inference checkpoint and
    refuses bad input with one line, writing nothing."""
    from tellkit import load_model
    from tellkit.cli import main
    from tellkit.export.safetensors import average_checkpoints

    def step(p):
        return int(p.name.split("_")[1].split("-")[0])

    r = toy_task.recipe(max_epochs=3)
    s = run(r, tmp_path / "run", save_every_steps=2, keep_checkpoints=3)  # 18 steps, 6 per epoch
    ckpts = run_states.CheckpointManager(tmp_path / "run")
    assert sorted({step(p) for p in ckpts.states()}) == [14, 16, 18]
    assert ckpts.resolve("last") == ckpts.states()[0].resolve() and step(ckpts.states()[0]) == s["steps"] == 18
    newest = ckpts.newest_steps(3)
    assert [step(p) for p in newest] == [18, 16, 14]  # step 18 saved twice (periodic, evaluation): once
    run(r, tmp_path / "plain", save_every_steps=2)  # default: only last and best stay
    assert {step(p) for p in run_states.CheckpointManager(tmp_path / "plain").states()} == {18}

    out = tmp_path / "avg"
    assert main(["average", str(tmp_path / "run"), "--last", "3", "--out", str(out), "--float32",
                 "--note", "how=last3"]) == 0
    assert "the mean of 3 checkpoints" in capsys.readouterr().out
    parts = [load_model(p).state_dict() for p in reversed(newest)]
    assert not torch.equal(parts[0]["emb.weight"], parts[2]["emb.weight"])
    got = load_model(out).state_dict()
    for k, v in got.items():
        torch.testing.assert_close(v, sum(p[k] for p in parts) / 3)
    meta = json.loads((out / "config.json").read_text())
    assert meta["averaged_from"] == [f"run/{p.name}" for p in reversed(newest)]
    assert meta["note"] == {"how": "last3"} and meta["task"] == "toy" and meta["weights_dtype"] == "float32"

    # explicit folders (a run folder stands for its best); float16 by default
    assert main(["average", str(newest[1]), str(newest[2]), str(tmp_path / "plain"),
                 "--out", str(tmp_path / "a2")]) == 0
    assert json.loads((tmp_path / "a2" / "config.json").read_text())["weights_dtype"] == "float16"

    # bad input: one line, exit 2, nothing written or changed
    before = (out / "model.safetensors").read_bytes()
    assert main(["average", str(tmp_path / "run"), "--last", "3", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["average", str(tmp_path / "run"), "--last", "9", "--out", str(tmp_path / "x")]) == 2
    assert "holds states of 3 step(s) only" in capsys.readouterr().err
    assert main(["average", str(tmp_path / "run"), "--last", "1", "--out", str(tmp_path / "x")]) == 2
    assert "at least 2 states" in capsys.readouterr().err
    assert main(["average", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert "two or more" in capsys.readouterr().err
    assert main(["average", str(newest[0]), str(newest[0]), "--out", str(tmp_path / "x")]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["average", str(tmp_path / "run"), str(tmp_path / "plain"), "--last", "2",
                 "--out", str(tmp_path / "x")]) == 2
    assert "one run folder" in capsys.readouterr().err
    assert main(["average", str(newest[0]), str(newest[1]), "--out", str(newest[0] / "inside")]) == 2
    assert "inside the checkpoint" in capsys.readouterr().err
    other = toy_task.recipe(max_epochs=1)
    other["model"]["dropout"] = 0.2
    run(other, tmp_path / "other")
    assert main(["average", str(newest[0]), str(tmp_path / "other"), "--out", str(tmp_path / "x")]) == 2
    assert "different model configuration" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(TellkitError, match="at least two"):
        average_checkpoints([newest[0]], tmp_path / "x")
    with pytest.raises(TellkitError, match="keep-checkpoints"):
        run(r, tmp_path / "bad", keep_checkpoints=-1)
