"""`tellkit curve RUN`: validation metrics against epochs, from a run's eval_log.csv; the PNG is
drawn with matplotlib (the ``plot`` extra), one panel per kind of quantity."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from tellkit.cli import main as cli_main
from tellkit.errors import MissingExtraError
from tellkit.utils.plot import curve_figure, metric_kind

LOG = """step,epoch,split,metric,value
398,1,val,exprate,4.5
398,1,val,exprate_le1,10.25
796,2,val,exprate,9.75
796,2,val,exprate_le1,18.5
1194,3,val,exprate,15.0
1194,3,val,exprate_le1,25
"""
# what a recognition run logs: a loss, percentages and a sample count
FULL_LOG = "step,epoch,split,metric,value\n" + "".join(
    f"{s},{e},val,loss,{loss}\n{s},{e},val,exprate,{x}\n{s},{e},val,exprate_le1,{x + 9}\n{s},{e},val,n,400\n"
    for s, e, loss, x in [(100, 1, 2.5, 3.0), (200, 2, 1.9, 11.5), (300, 3, 1.6, 14.25), (400, 4, 1.7, 13.0)])


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "eval_log.csv").write_text(LOG)
    return tmp_path


def test_markdown_table_has_one_row_per_evaluation(run_dir, capsys):
    assert cli_main(["curve", str(run_dir), "--metric", "exprate", "--format", "markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| epoch | step | exprate |"
    assert lines[2:] == ["| 1 | 398 | 4.50 |", "| 2 | 796 | 9.75 |", "| 3 | 1194 | 15.00 |"]


def test_json_and_png(run_dir, capsys):
    png = run_dir / "plots" / "curve.png"
    assert cli_main(["curve", str(run_dir), "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metrics"] == ["exprate", "exprate_le1"]
    assert [e["exprate_le1"] for e in out["evaluations"]] == [10.25, 18.5, 25.0]
    assert out["png"] == str(png) and out["chosen_step"] is None  # no checkpoint: nothing to mark
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] >= 600 and im.size[1] >= 300
        assert len(im.convert("RGB").getcolors(1 << 20)) > 50  # drawn, not blank


def test_metric_kinds():
    assert [metric_kind(m) for m in ("loss", "exprate", "exprate_le2", "bleu4", "cider", "rouge_l", "meteor",
                                     "person_recall", "n", "length", "flesch")] == [
        "loss", "percent", "percent", "percent", "percent", "percent", "percent", "percent", "count", "words",
        "other"]


def test_one_panel_per_kind_with_units_and_the_chosen_step_marked():
    table = [{"step": s, "epoch": e, "loss": lo, "exprate": x, "exprate_le1": x + 9, "n": 400}
             for s, e, lo, x in [(100, 1, 2.5, 3.0), (200, 2, 1.9, 11.5), (300, 3, 1.6, 14.25)]]
    fig = curve_figure(table, ["loss", "exprate", "exprate_le1", "n"], x="epoch", title="run", chosen_step=200)
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == ["loss (nats per token)", "score (%)", "count (samples)"]
    assert axes[-1].get_xlabel() == "completed epochs"
    assert [t.get_text() for t in axes[1].get_legend().get_texts()] == ["exprate", "exprate_le1"]
    assert fig.get_suptitle() == "run"
    for ax in axes:  # a dashed line at the chosen evaluation's epoch on every panel
        marks = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(marks) == 1 and list(marks[0].get_xdata()) == [2, 2]
    assert "epoch 2, step 200" in axes[0].get_title(loc="left")
    series = {ln.get_label(): ln for ln in axes[1].get_lines() if not ln.get_label().startswith("_")}
    assert list(series["exprate"].get_ydata()) == [3.0, 11.5, 14.25]


def test_the_chosen_step_comes_from_the_run_or_the_option(tmp_path, capsys):
    (tmp_path / "eval_log.csv").write_text(FULL_LOG)
    last = tmp_path / "checkpoints" / "step_00000300"
    last.mkdir(parents=True)
    (last / "trainer_state.json").write_text(json.dumps({"step": 400, "best": 14.25, "best_step": 300}))
    (tmp_path / "checkpoints" / "last").symlink_to("step_00000300")
    assert cli_main(["curve", str(tmp_path), "--png", str(tmp_path / "c.png")]) == 0
    assert json.loads(capsys.readouterr().out)["chosen_step"] == 300
    assert cli_main(["curve", str(tmp_path), "--png", str(tmp_path / "c.png"), "--chosen-step", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen_step"] == 100
    assert cli_main(["curve", str(tmp_path), "--png", str(tmp_path / "c.png"), "--chosen-step", "150"]) == 2
    err = capsys.readouterr().err
    assert "--chosen-step 150: no evaluation at that step" in err and len(err.strip().splitlines()) == 1


def test_non_finite_values_are_left_out_of_the_plot_and_said(tmp_path):
    log = FULL_LOG.replace("200,2,val,loss,1.9", "200,2,val,loss,nan").replace("300,3,val,exprate,14.25",
                                                                                "300,3,val,exprate,inf")
    (tmp_path / "eval_log.csv").write_text(log)
    res = tellkit("curve", tmp_path, "--png", tmp_path / "c.png")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-1500:]
    assert "2 value(s) not finite (left out of the plot; null in the JSON)" in res.stderr
    assert "loss at step 200 (nan)" in res.stderr and "exprate at step 300 (inf)" in res.stderr
    out = json.loads(res.stdout)  # strict JSON: no NaN or Infinity tokens
    assert [e["loss"] for e in out["evaluations"]] == [2.5, None, 1.6, 1.7]
    with Image.open(tmp_path / "c.png") as im:
        assert im.format == "PNG"


def test_a_log_with_no_finite_value_is_one_line(tmp_path):
    (tmp_path / "eval_log.csv").write_text("step,epoch,split,metric,value\n1,1,val,loss,nan\n2,2,val,loss,inf\n")
    one_line_error(tellkit("curve", tmp_path, "--png", tmp_path / "c.png"), "nothing to plot")
    assert not (tmp_path / "c.png").exists()


def test_without_matplotlib_the_message_names_the_extra(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'tellkit\[plot\]'"):
        curve_figure([{"step": 1, "epoch": 1, "loss": 1.0}], ["loss"])
    assert cli_main(["curve", str(run_dir), "--png", str(run_dir / "c.png")]) == 2
    err = capsys.readouterr().err
    assert "tellkit[plot]" in err and len(err.strip().splitlines()) == 1
    assert not (run_dir / "c.png").exists()


def test_unknown_metric_is_one_line(run_dir, capsys):
    assert cli_main(["curve", str(run_dir), "--metric", "bleu"]) == 2
    err = capsys.readouterr().err
    assert "no validation values for ['bleu']" in err and len(err.strip().splitlines()) == 1


def test_not_a_run_folder(tmp_path, capsys):
    assert cli_main(["curve", str(tmp_path)]) == 2
    assert "no eval_log.csv" in capsys.readouterr().err
    (tmp_path / "eval_log.csv").write_text("step,epoch,split,metric,value\n1,0,val,exprate,high\n")
    assert cli_main(["curve", str(tmp_path)]) == 2
    assert "line 2: not a number" in capsys.readouterr().err


def tellkit(*args):
    return subprocess.run([sys.executable, "-m", "tellkit", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def one_line_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stdout[-1500:], res.stderr[-1500:])
    assert not res.stdout.strip(), res.stdout
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


@pytest.mark.parametrize("data, needle", [(LOG.encode("utf-16"), "not UTF-8 text"),
                                          (b"step,epoch,split,metric,value\n398,1,val,\xe9xprate,4.5\n",
                                           "not UTF-8 text (byte 0xe9 at offset 40)")])
def test_a_log_that_is_not_utf8_text_is_one_line(tmp_path, data, needle):
    (tmp_path / "eval_log.csv").write_bytes(data)
    one_line_error(tellkit("curve", tmp_path), needle)


def test_png_onto_a_folder_or_under_a_file_is_one_line_and_leaves_nothing(run_dir):
    (run_dir / "plots").mkdir()
    (run_dir / "notes").write_text("a file")
    before = sorted(p.name for p in run_dir.rglob("*"))
    for _ in range(2):  # each try used to leave a temporary file
        one_line_error(tellkit("curve", run_dir, "--png", run_dir / "plots"), "is a folder")
        one_line_error(tellkit("curve", run_dir, "--png", run_dir / "notes" / "c.png"), "is a file")
        one_line_error(tellkit("curve", run_dir, "--png", "/proc/tellkit-curve.png"), "cannot write the plot")
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    res = tellkit("curve", run_dir, "--png", run_dir / "plots" / "curve.png")  # the next call works
    assert res.returncode == 0, res.stderr[-1500:]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["curve.png"]


def test_a_log_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    import os

    os.mkfifo(tmp_path / "eval_log.csv")
    one_line_error(tellkit("curve", tmp_path), "not a regular file")


def test_writing_the_png_does_not_import_torch(run_dir):
    """The PNG is written atomically through ``tellkit.utils.files``, not through the checkpoint
    module, so the curve command itself never loads torch."""
    code = ("import argparse, sys; from tellkit.cli import cmd_curve; p = argparse.ArgumentParser(); "
            f"cmd_curve.add_arguments(p); rc = cmd_curve.run(p.parse_args([{str(run_dir)!r}, '--png', "
            f"{str(run_dir / 'c.png')!r}])); assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    with Image.open(run_dir / "c.png") as im:
        assert im.format == "PNG"
