"""The last inputs that ended in a traceback answer one line instead (CLI exit 2, HTTP 4xx):
strokes whose median stroke is tiny, a 300-character file name, a folder that cannot be listed,
non-UTF-8 file names with --json, --device meta, writing into a read-only folder, a TorchScript
archive given to `convert` (no torch warning naming its install path)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tellkit.cli import main
from tellkit.data.inkml import render_strokes
from tellkit.errors import TellkitError

SAMPLES = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "samples"
BTTR = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "bttr_default"
TINY_MEDIAN = [[[0, 0], [1e-300, 0]], [[0, 0], [1e-300, 0]], [[0, 0], [1e9, 1e9]]]
DENORMAL = [[[0, 0], [5e-324, 0]]]


def one_line(capsys, *needles) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def inkml(strokes) -> str:
    traces = "".join(f"<trace>{', '.join(f'{x!r} {y!r}' for x, y in s)}</trace>" for s in strokes)
    return f'<ink xmlns="http://www.w3.org/2003/InkML">{traces}</ink>'


# --- strokes ------------------------------------------------------------------------------------
def test_tiny_median_strokes_render_or_say_why():
    assert render_strokes(TINY_MEDIAN).size[0] > 0  # the 1e-300 strokes are dots beside the 1e9 one
    with pytest.raises(TellkitError, match="too small to draw"):
        render_strokes(DENORMAL)


def test_tiny_strokes_in_the_cli_are_one_line(tmp_path, capsys):
    path = tmp_path / "tiny.inkml"
    path.write_text(inkml(DENORMAL))
    assert main(["recognize", str(path)]) == 2
    one_line(capsys, "too small to draw")


def test_tiny_strokes_over_http_are_422():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tellkit.pipelines.recognition import RecognitionPipeline
    from tellkit.server.app import create_app
    from tellkit.server.limits import Limits

    app = create_app({"recognize": RecognitionPipeline.untrained()}, Limits(), serve_page=False)
    with TestClient(app) as client:
        r = client.post("/api/recognize", data={"strokes": json.dumps(DENORMAL)})
        assert r.status_code == 422 and "too small to draw" in r.json()["detail"], r.text
        r = client.post("/api/recognize", data={"strokes": json.dumps(TINY_MEDIAN)})
        assert r.status_code == 200, r.text


# --- paths --------------------------------------------------------------------------------------
def test_a_300_character_file_name_is_one_line(tmp_path, capsys):
    assert main(["recognize", str(tmp_path / ("a" * 300 + ".png"))]) == 2
    one_line(capsys, "File name too long")


def test_an_unreadable_folder_is_one_line(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "locked"
    folder.mkdir()
    real = Path.iterdir

    def refuse(self):
        if self == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refuse)  # root reads any folder: refuse as the kernel would
    assert main(["recognize", str(folder)]) == 2
    one_line(capsys, str(folder), "Permission denied")


def test_an_os_refusal_anywhere_in_a_command_is_one_line(capsys, monkeypatch):
    import tellkit.cli.cmd_model_info as cmd

    def refuse(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/some/where")

    monkeypatch.setattr(cmd, "run", refuse)
    assert main(["model-info", "bttr"]) == 2
    one_line(capsys, "/some/where: Permission denied")


def test_non_utf8_file_names_with_json_print_valid_utf8(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    name = os.fsencode(folder) + b"/caf\xe9-\xff.png"
    with open(name, "wb") as f:
        f.write((SAMPLES / "bttr_x2_plus_1.png").read_bytes())
    res = subprocess.run([sys.executable, "-m", "tellkit", "recognize", str(folder), "--json"], capture_output=True,
                         timeout=300, env={**os.environ, "PYTHONIOENCODING": "utf-8:strict", "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr.decode(errors="replace")[-2000:]
    line = res.stdout.decode("utf-8")  # strict: valid UTF-8
    out = json.loads(line)
    assert out["input"].endswith("caf\ufffd-\ufffd.png") and out["text"]


def test_device_meta_is_one_line(capsys):
    assert main(["recognize", str(SAMPLES / "bttr_x2_plus_1.png"), "--device", "meta"]) == 2
    one_line(capsys, "meta device holds no data")


# --- writing into a read-only folder, converting a hostile file -----------------------------------
@pytest.fixture()
def read_only(tmp_path):
    """A read-only file system (a tmpfs mounted read-only): root writes anywhere else."""
    where = tmp_path / "ro"
    where.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(where)], capture_output=True).returncode:
        os.chmod(where, 0o500)  # not root: a folder without write permission does the same
        if os.access(where, os.W_OK):
            pytest.skip("cannot make a read-only folder here (root without mount)")
        yield where
        os.chmod(where, 0o700)
        return
    yield where
    subprocess.run(["umount", str(where)], check=False)


def test_export_and_convert_into_a_read_only_folder_are_one_line(read_only, tmp_path, capsys):
    assert main(["export", str(BTTR), "--format", "reference", "--out", str(read_only / "x.ckpt")]) == 2
    one_line(capsys, "x.ckpt", "cannot write there")
    assert main(["convert", str(BTTR), "--to", "reference", "--out", str(read_only / "y.ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "deprecated" in err[0] and len(err) == 2 and "cannot write there" in err[1], err
    ref = tmp_path / "ref.ckpt"
    assert main(["export", str(BTTR), "--format", "reference", "--out", str(ref)]) == 0
    capsys.readouterr()
    assert main(["convert", str(ref), "--out", str(read_only / "conv")]) == 2
    one_line(capsys, "conv", "cannot write there")
    assert main(["export", str(BTTR), "--out", str(read_only / "exp")]) == 2
    one_line(capsys, "exp", "cannot write there")


def test_convert_of_a_torchscript_archive_prints_no_torch_warning(tmp_path):
    import zipfile

    ref = tmp_path / "ref.ckpt"
    assert main(["export", str(BTTR), "--format", "reference", "--out", str(ref)]) == 0
    hostile = tmp_path / "script.ckpt"
    with zipfile.ZipFile(ref) as src, zipfile.ZipFile(hostile, "w") as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
        out.writestr("archive/constants.pkl", b"\x80\x02)\x85.")
    res = subprocess.run([sys.executable, "-m", "tellkit", "convert", str(hostile), "--out", str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "TorchScript archive" in res.stderr and "site-packages" not in res.stderr and "Warning" not in res.stderr
