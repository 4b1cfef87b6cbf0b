"""`tellkit export` / `tellkit average` through the real command (a child process) onto places
they cannot or should not write: an unwritable --out is one line with nothing written; --out as a
symbolic link replaces the folder it names (the link stays) and a dangling link is refused; no
staging or swapped-out folder is left behind, and the next call works."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import one_line_error  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def tellkit(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "tellkit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV)




def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny random BTTR checkpoints of one model configuration."""
    import torch

    from tellkit.registry import create_model

    root = tmp_path_factory.mktemp("src")
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out.append(create_model("bttr/tiny").save_pretrained(root / f"s{seed}"))
    return out


@pytest.mark.parametrize("command", ["export", "average"])
def test_an_unwritable_out_is_one_line_and_writes_nothing(ckpts, tmp_path, command):
    srcs = ckpts[:1] if command == "export" else ckpts
    (tmp_path / "plain").write_text("a regular file")
    before = listing(tmp_path)
    for out in ("/proc/tellkit-export/model", "/proc/tellkit-model", tmp_path / "plain" / "model"):
        one_line_error(tellkit(command, *srcs, "--out", out), str(out), "cannot write there")
        assert not Path(out).exists() and not Path(f"{out}.export-tmp").exists()
    assert listing(tmp_path) == before


def test_average_replace_through_a_symlink_replaces_its_folder(ckpts, tmp_path):
    real = tmp_path / "models" / "v1"
    real.mkdir(parents=True)
    link = tmp_path / "current"
    link.symlink_to(real)
    # an empty folder behind the link: written there, the link kept
    res = tellkit("average", *ckpts, "--out", link)
    assert res.returncode == 0, res.stderr[-2000:]
    assert link.is_symlink() and (real / "config.json").is_file()
    (real / "README.md").write_text("about the model")
    first = (real / "model.safetensors").read_bytes()
    # a checkpoint behind the link: refused without --replace, replaced with it, twice in a row
    one_line_error(tellkit("average", *ckpts, "--out", link), "not empty")
    for _ in range(2):
        res = tellkit("average", *ckpts, "--out", link, "--replace", "--float32")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "kept from the replaced folder: README.md" in res.stdout
        assert link.is_symlink() and link.resolve() == real.resolve()
        meta = json.loads((real / "config.json").read_text())
        assert meta["weights_dtype"] == "float32" and (real / "README.md").read_text() == "about the model"
        assert (real / "model.safetensors").read_bytes() != first
        assert listing(tmp_path) == ["current", "models", "models/v1", "models/v1/README.md",
                                     "models/v1/config.json", "models/v1/model.safetensors"]


@pytest.mark.parametrize("replace", [[], ["--replace"]])
def test_a_dangling_symlink_is_refused_in_one_line(ckpts, tmp_path, replace):
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "gone")
    one_line_error(tellkit("average", *ckpts, "--out", link, *replace), str(link), "does not exist")
    assert link.is_symlink() and listing(tmp_path) == ["current"]
    res = tellkit("average", *ckpts, "--out", tmp_path / "gone")  # the next call works
    assert res.returncode == 0, res.stderr[-2000:]
    assert (link / "config.json").is_file() and listing(tmp_path) == ["current", "gone", "gone/config.json",
                                                                      "gone/model.safetensors"]
