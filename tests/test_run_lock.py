"""One training process per run folder: a second `tellkit train --out SAME` (fresh or
``--resume``) is refused in one line naming the holder, the first run's logs stay in order; and
readers of a run's states never see one pruned under them."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import toy_task  # noqa: E402
from cli_checks import one_line_error  # noqa: E402

from tellkit.errors import TellkitError  # noqa: E402
from tellkit.utils.runlock import RunInUse, check_not_running, hold_run, pruning, reading_states  # noqa: E402

CLI = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import toy_task; from tellkit.cli import main; "
       "sys.exit(main(sys.argv[1:]))")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def command(*args):
    return [sys.executable, "-c", CLI, str(FIXTURES), *map(str, args)]


def tellkit(*args, timeout=120):
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=timeout, env=ENV)


def steps_logged(log: Path) -> list[int]:
    if not log.is_file():
        return []
    with open(log, newline="", encoding="utf-8") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def wait_until(cond, timeout: float, proc=None):
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_second_train_on_a_running_folder_is_refused(tmp_path):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=100_000)))
    out = tmp_path / "run"
    first = subprocess.Popen(command("train", cfg, "--out", out, "--save-every-steps", 5, "--keep-checkpoints", 2,
                                     "--no-progress"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ENV)
    try:
        wait_until(lambda: len(steps_logged(out / "train_log.csv")) >= 3 and (out / "checkpoints" / "last").exists(),
                   120, first)
        fresh = tellkit("train", cfg, "--out", out, "--no-progress")
        err = one_line_error(fresh, str(out), "in use by another tellkit train", f"pid {first.pid}", "started")
        resumed = tellkit("train", cfg, "--out", out, "--resume", "--no-progress")
        assert one_line_error(resumed) == err
        with pytest.raises(RunInUse, match=f"pid {first.pid}"):
            check_not_running(out)
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 130
    steps = steps_logged(out / "train_log.csv")
    assert steps == list(range(1, len(steps) + 1)), steps  # one writer: every step once, in order
    check_not_running(out)  # released when the run ended
    hold_run(out).release()


@pytest.mark.slow
def test_two_fresh_runs_started_at_once_one_wins(tmp_path):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=3)))
    out = tmp_path / "run"
    procs = [subprocess.Popen(command("train", cfg, "--out", out, "--no-progress"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    results = [(p, *p.communicate(timeout=120)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in results)
    # either the loser met the lock, or it started after the winner had saved a state
    assert codes == [0, 2], [(p.returncode, e[-800:]) for p, _, e in results]
    loser = next(e for p, _, e in results if p.returncode == 2).strip()
    assert len(loser.splitlines()) == 1 and ("in use by another tellkit train" in loser
                                             or "already holds a run" in loser), loser
    steps = steps_logged(out / "train_log.csv")
    assert steps == list(range(1, len(steps) + 1)) and steps, steps


def test_the_lock_names_its_holder_in_process(tmp_path):
    lock = hold_run(tmp_path)
    try:
        with pytest.raises(RunInUse) as info:
            check_not_running(tmp_path)
        msg = str(info.value)
        assert f"pid {os.getpid()}" in msg and "started" in msg and "\n" not in msg
    finally:
        lock.release()
    check_not_running(tmp_path)


def test_pruning_waits_for_readers(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    with reading_states(tmp_path) as held:
        assert held
        with pruning(ck) as free:
            assert not free  # a reader holds the states: the trainer keeps them for now
    with pruning(ck) as free:
        assert free
        with pytest.raises(TellkitError, match="kept its states locked"):
            with reading_states(tmp_path, wait_s=0.2):
                pass


@pytest.mark.slow
def test_export_and_average_while_the_run_saves_and_prunes(tmp_path, capsys):
    """The run saves every 2 steps and keeps 3: every export and average read while it prunes
    succeeds (a state is never deleted under a reader)."""
    from tellkit.cli import main

    cfg = tmp_path / "toy.yaml"
    cfg.write_text(yaml.safe_dump(toy_task.recipe(max_epochs=100_000)))
    run = tmp_path / "run"
    trainer = subprocess.Popen(command("train", cfg, "--out", run, "--save-every-steps", 2, "--keep-checkpoints", 3,
                                       "--no-progress"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=ENV)
    try:
        wait_until(lambda: len(list((run / "checkpoints").glob("step_*[0-9]"))) >= 3, 120, trainer)
        codes = []
        for i in range(5):
            codes.append(main(["export", str(run), "--out", str(tmp_path / f"exp{i}")]))
            codes.append(main(["average", str(run), "--last", "3", "--out", str(tmp_path / f"avg{i}")]))
        err = capsys.readouterr().err
        assert trainer.poll() is None
    finally:
        trainer.send_signal(signal.SIGTERM)
        trainer.communicate(timeout=60)
    assert codes == [0] * 10, err
    steps = steps_logged(run / "train_log.csv")
    assert steps == list(range(1, len(steps) + 1)), steps
