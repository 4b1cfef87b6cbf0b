"""`tellkit curve RUN`: validation metrics against epochs, from a run's eval_log.csv."""
from __future__ import annotations

import json

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

