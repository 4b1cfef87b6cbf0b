"""A device or a FIFO given as an image (or an InkML file), through the real command in a child
process: named for what it is in one line ("not a regular file: a character device"), never
opened, so a FIFO with no writer does not block; `tellkit features` counts them under their own
reason and goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tellkit.utils.images import REASONS, ImageError, open_image

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import one_line_error  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def tellkit(*args, cwd=None):
    # a FIFO that were opened would block with no writer: the timeout turns that into a failure
    return subprocess.run([sys.executable, "-m", "tellkit", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=ENV, cwd=cwd)




@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe.png"
    os.mkfifo(p)
    return p


def test_the_decoder_says_what_a_special_file_is(fifo):
    assert "not a regular file" in REASONS
    for path, kind in (("/dev/zero", "a character device"), (fifo, "a FIFO")):
        with pytest.raises(ImageError, match=f"not a regular file: {kind}") as e:
            open_image(path)
        assert e.value.reason == "not a regular file"


@pytest.mark.parametrize("command", [["caption", "--image"], ["recognize"]])
def test_caption_and_recognize_name_a_device_or_a_fifo(command, fifo, tmp_path):
    one_line_error(tellkit(*command, "/dev/zero"), "/dev/zero", "not a regular file: a character device")
    one_line_error(tellkit(*command, fifo), str(fifo), "not a regular file: a FIFO")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.png"]


def test_recognize_names_a_fifo_given_as_inkml(tmp_path):
    os.mkfifo(tmp_path / "pipe.inkml")
    one_line_error(tellkit("recognize", tmp_path / "pipe.inkml"), "not a regular file")


def test_features_counts_them_under_their_reason(fifo, tmp_path):
    (tmp_path / "list.txt").write_text(f"/dev/zero\n{fifo}\n")
    res = tellkit("features", tmp_path / "feats", "--images", tmp_path / "list.txt", "--no-faces", "--no-progress")
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(Path(tmp_path / "feats" / "features.json").read_text())["summary"]
    assert summary["skipped_by_reason"] == {"not a regular file": 2}, summary
    assert "not a regular file: a character device" in res.stdout and "not a regular file: a FIFO" in res.stdout
    one_line_error(tellkit("features", tmp_path / "f2", "--images", fifo), "not a folder or a regular file")
    assert not (tmp_path / "f2").exists()
