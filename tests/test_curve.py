"""`tellkit curve RUN`: validation metrics against epochs, from a run's eval_log.csv."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from tellkit.cli import main as cli_main
from tellkit.utils.plot import nice_ticks

LOG = """step,epoch,split,metric,value
398,1,val,exprate,4.5
398,1,val,exprate_le1,10.25
796,2,val,exprate,9.75
796,2,val,exprate_le1,18.5
1194,3,val,exprate,15.0
1194,3,val,exprate_le1,25
"""


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
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (760, 440)
        # the two series are drawn in their colours
        colours = {c for _, c in im.getcolors(1 << 16)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours


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


def test_nice_ticks():
    assert nice_ticks(0, 23) == [0, 5, 10, 15, 20, 25]
    assert nice_ticks(1, 3, integer=True) == [1, 2, 3]
    assert nice_ticks(4.2, 4.2)[0] <= 4.2 <= nice_ticks(4.2, 4.2)[-1]



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
                                           "not UTF-8 text (byte 40)")])
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
