"""Issue 39 outside the server: files that are not files (/dev/zero, FIFOs, /proc, looping links)
are refused before anything is read or written; config values of the wrong type or not finite are
refused where a config is read; `tellkit serve` refuses out-of-range settings in one line before
it loads a model."""
from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tellkit.config import from_dict, load_yaml
from tellkit.errors import TellkitError
from tellkit.utils.files import check_output_path, read_bytes, read_text

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import one_line_error  # noqa: E402

TELLKIT = [sys.executable, "-m", "tellkit"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run_main(capsys, *argv) -> tuple[int, str]:
    from tellkit.cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip()


@pytest.fixture()
def fifo(tmp_path):
    p = tmp_path / "pipe.txt"
    os.mkfifo(p)
    return p


@pytest.fixture()
def loop(tmp_path):
    p = tmp_path / "loop"
    p.symlink_to(p)
    return p


# --- the safe reader and the output check -------------------------------------------------------------
@pytest.mark.parametrize("make, needle", [
    (lambda tmp, fifo: Path("/dev/zero"), "a character device"),
    (lambda tmp, fifo: fifo, "a FIFO"),
    (lambda tmp, fifo: (tmp / "z").symlink_to("/dev/zero") or tmp / "z", "a character device"),
    (lambda tmp, fifo: tmp, "a folder"),
    (lambda tmp, fifo: Path("/proc/self/status"), "under /proc"),
    (lambda tmp, fifo: tmp / "missing.txt", "not found"),
])
def test_only_regular_files_are_read(tmp_path, fifo, make, needle):
    with pytest.raises(TellkitError, match=needle):
        read_text(make(tmp_path, fifo), "--article", max_bytes=1 << 20)


def test_reading_stops_at_the_cap_and_names_bad_bytes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"x" * 101)
    assert read_bytes(f, "--article", 101) == b"x" * 101
    with pytest.raises(TellkitError, match="larger than the 100 bytes"):
        read_bytes(f, "--article", 100)
    f.write_bytes(b"caf\xe9")
    with pytest.raises(TellkitError, match="not UTF-8 text .byte 0xe9 at offset 3"):
        read_text(f, "--article", 100)


@pytest.mark.parametrize("make, kw, needle", [
    (lambda tmp, loop, fifo: loop, {"folder": True}, "a symbolic link that loops"),
    (lambda tmp, loop, fifo: (tmp / "d").symlink_to(tmp / "nowhere") or tmp / "d", {}, "which does not exist"),
    (lambda tmp, loop, fifo: Path("/proc/tellkit/x"), {}, "under /proc"),
    (lambda tmp, loop, fifo: (tmp / "f").write_text("") or tmp / "f" / "out", {}, "is not a folder"),
    (lambda tmp, loop, fifo: fifo, {}, "a FIFO"),
    (lambda tmp, loop, fifo: (tmp / "g").write_text("") or tmp / "g", {"folder": True}, "not a folder"),
])
def test_outputs_are_checked_before_any_work(tmp_path, loop, fifo, make, kw, needle):
    with pytest.raises(TellkitError, match=needle):
        check_output_path(make(tmp_path, loop, fifo), "--out", **kw)
    assert check_output_path(tmp_path / "new" / "dir", "--out", folder=True) == tmp_path / "new" / "dir"


def test_a_recipe_that_is_a_fifo_or_a_device_is_refused(fifo):
    for path in (fifo, "/dev/zero"):
        with pytest.raises(TellkitError):
            load_yaml(path)


# --- config values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, needle", [
    ({"d_model": "32"}, "d_model: expected a whole number, got '32'"),
    ({"d_model": 32.5}, "d_model: expected a whole number"),
    ({"d_model": True}, "d_model: expected a whole number"),
    ({"dropout": math.nan}, "dropout: expected a finite number"),
    ({"dropout": math.inf}, "dropout: expected a finite number"),
    ({"dropout": "nan"}, "dropout: expected a finite number"),
    ({"nhead": [8]}, "nhead: expected a whole number"),
])
def test_model_config_values_of_the_wrong_type_are_refused(values, needle):
    from tellkit.models.bttr import BTTRConfig

    with pytest.raises(TellkitError, match=needle):
        from_dict(BTTRConfig, values, "config")
    assert from_dict(BTTRConfig, {"d_model": 32.0}).d_model == 32  # a whole number written as a float


@pytest.fixture(scope="module")
def tiny_bttr(tmp_path_factory):
    from tellkit.registry import create_model

    return create_model("bttr/tiny").save_pretrained(tmp_path_factory.mktemp("bttr") / "tiny")


def _copy_with(src: Path, dst: Path, **config) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    meta = json.loads((dst / "config.json").read_text())
    meta["config"].update(config)
    (dst / "config.json").write_text(json.dumps(meta))  # NaN is written as the JSON extension NaN
    return dst


@pytest.mark.parametrize("config, needle", [({"dropout": math.nan}, "dropout: expected a finite number"),
                                            ({"d_model": "32"}, "d_model: expected a whole number")])
def test_a_checkpoint_config_with_bad_values_is_refused_when_loaded(tiny_bttr, tmp_path, config, needle):
    from tellkit.checkpoint import load_model

    with pytest.raises(TellkitError, match=needle):
        load_model(_copy_with(tiny_bttr, tmp_path / "bad", **config))


def test_a_checkpoint_config_that_is_a_fifo_is_refused(tiny_bttr, tmp_path):
    from tellkit.checkpoint import read_checkpoint_config

    d = tmp_path / "ck"
    d.mkdir()
    (d / "model.safetensors").write_bytes((tiny_bttr / "model.safetensors").read_bytes())
    os.mkfifo(d / "config.json")
    with pytest.raises(TellkitError, match="config.json"):
        read_checkpoint_config(d)


def test_export_and_average_refuse_a_looping_out_before_any_work(tiny_bttr, loop, capsys):
    code, err = run_main(capsys, "export", tiny_bttr, "--out", loop)
    assert code == 2 and "a symbolic link that loops" in err and len(err.splitlines()) == 1, err
    code, err = run_main(capsys, "export", tiny_bttr, "--out", "/proc/tellkit-export")
    assert code == 2 and "under /proc" in err, err
    code, err = run_main(capsys, "average", tiny_bttr, tiny_bttr, "--out", loop)
    assert code == 2 and "a symbolic link that loops" in err, err


# --- tellkit serve's settings -------------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["--max-upload-mb", "inf"], "--max-upload-mb must be a number of MiB above 0"),
    (["--max-upload-mb", "nan"], "--max-upload-mb must be a number of MiB above 0"),
    (["--threads", "-1"], "--threads must be 0"),
    (["--max-wait-ms", "-1"], "--max-wait-ms must be a number of milliseconds"),
    (["--max-wait-ms", "nan"], "--max-wait-ms must be a number of milliseconds"),
    (["--header-timeout", "inf"], "--header-timeout must be a number of seconds above 0 and at most 3600"),
    (["--body-idle-timeout", "nan"], "--body-idle-timeout must be a number of seconds"),
    (["--max-beam-size", "100000"], "--max-beam-size must be a whole number from 1 to 256"),
    (["--max-gen-len", "1000000000"], "--max-gen-len must be a whole number from 1 to 1,024"),
    (["--memory-budget-mb", "0"], "--memory-budget-mb must be a whole number from 1"),
    (["--max-batch", "0"], "--max-batch must be from 1 to 1024"),
    (["--device", "tpu"], "device"),
])
def test_serve_refuses_out_of_range_settings_in_one_line(capsys, argv, needle):
    code, err = run_main(capsys, "serve", "--api-only", "--port", "0", *argv)
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_serve_on_a_gpu_this_machine_lacks_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    code, err = run_main(capsys, "serve", "--api-only", "--port", "0", "--device", "cuda")
    assert code == 2 and "no CUDA GPU" in err and len(err.splitlines()) == 1, err


# --- the inference and evaluation commands' paths and sizes ------------------------------------------
def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # an endless read fails instead of eating the machine


def tellkit(*args, timeout=60):
    try:
        return subprocess.run([*TELLKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV,
                              preexec_fn=_limited)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"tellkit {' '.join(map(str, args))} hung for {exc.timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("article", ["/dev/zero", "fifo"])
def test_caption_refuses_an_article_that_is_not_a_file(tmp_path, fifo, article):
    from tellkit.bench.serve_load import ASSETS

    photo = next((ASSETS / "demo_caption").glob("*.jpg"))
    path = fifo if article == "fifo" else article
    one_line_error(tellkit("caption", "--image", photo, "--article", path, timeout=30),
                   "not a regular file")


def test_evaluate_refuses_an_out_under_proc_before_evaluating(tiny_bttr, tmp_path):
    res = tellkit("evaluate", tiny_bttr, "--data", tmp_path, "--out", "/proc/tellkit-eval", timeout=60)
    one_line_error(res, "under /proc")


def test_recognize_refuses_a_huge_stroke_size(tmp_path):
    from tellkit.pipelines.recognition import SAMPLE_INKML

    one_line_error(tellkit("recognize", SAMPLE_INKML, "--stroke-size", "1e9", timeout=60), "stroke")


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "true", "'ten'"])
def test_a_data_limit_that_is_not_a_whole_number_of_samples_is_refused(value):
    import yaml

    from tellkit.data.recognition import RecognitionDataConfig
    from tellkit.errors import TellkitError
    from tellkit.recipes import section
    from tellkit.tasks.captioning import CaptionDataConfig

    n = yaml.safe_load(value)
    for cls in (RecognitionDataConfig, CaptionDataConfig):
        with pytest.raises(TellkitError, match=r"data\.limit.*whole number"):
            section({"data": {"limit": {"train": n}}}, "data", cls)
    assert section({"data": {"limit": {"train": None, "val": 5}}}, "data", RecognitionDataConfig).limit == {"val": 5}
