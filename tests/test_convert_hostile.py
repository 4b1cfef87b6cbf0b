"""Hostile reference checkpoints through the real ``tellkit convert`` (a child process): a zip
entry that inflates far past its tensor, sizes past the total cap, an empty file, an option of
the wrong kind, NaN or integer weights. Each is one line and exit 2, with nothing written."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from cli_checks import one_line_error  # noqa: E402

TELLKIT = [sys.executable, "-m", "tellkit"]


class LightningState(dict):
    """Stands for a class other than tensors in a checkpoint (read by the restricted unpickler)."""


def tellkit(*args, env=None, timeout=180):
    return subprocess.run([*TELLKIT, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})




@pytest.fixture(scope="module")
def reference_state(tmp_path_factory):
    """A tiny BTTR exported as the reference's .ckpt, and its tensors."""
    from tellkit.convert import read_reference_state_dict
    from tellkit.export.reference import export_reference
    from tellkit.registry import create_model

    root = tmp_path_factory.mktemp("ref")
    ckpt = create_model("bttr/tiny").save_pretrained(root / "tiny")
    ref = export_reference(ckpt, root / "tiny.ckpt")
    return Path(ref), read_reference_state_dict(ref)


def bomb(path: Path, inflate_to: int, restricted: bool) -> Path:
    """A torch zip checkpoint whose one storage (4 floats) is replaced by a deflated entry of
    ``inflate_to`` zero bytes."""
    obj = {"state_dict": {"w": torch.zeros(4)}}
    if restricted:
        obj["hparams"] = LightningState(lr=1)
    buf = io.BytesIO()
    torch.save(obj, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                out.writestr(info.filename, b"\0" * inflate_to, compress_type=zipfile.ZIP_DEFLATED)
            else:
                out.writestr(info, src.read(info.filename))
    return path


@pytest.mark.parametrize("restricted", [False, True])
def test_a_zip_entry_that_inflates_past_its_tensor_is_refused_before_reading(tmp_path, restricted):
    f = bomb(tmp_path / "bomb.ckpt", 64 << 20, restricted)
    assert f.stat().st_size < 200_000
    err = one_line_error(tellkit("convert", f, "--out", tmp_path / "out"), "storage entry")
    assert "inflates" in err or "declares" in err
    assert not (tmp_path / "out").exists()


def test_a_declared_size_that_disagrees_with_the_tensor_is_refused(tmp_path):
    f = bomb(tmp_path / "odd.ckpt", 20, restricted=True)  # 4 floats take 16 bytes, not 20
    one_line_error(tellkit("convert", f, "--out", tmp_path / "out"), "declares 20 bytes", "take 16")


def test_the_total_is_capped(reference_state, tmp_path):
    ref, _ = reference_state
    one_line_error(tellkit("convert", ref, "--out", tmp_path / "out", env={"TELLKIT_MAX_MODEL_BYTES": "1000"}),
                   "TELLKIT_MAX_MODEL_BYTES")
    res = tellkit("convert", ref, "--out", tmp_path / "ok")
    assert res.returncode == 0, res.stderr


def test_an_empty_file_is_one_line(tmp_path):
    (tmp_path / "empty.ckpt").write_bytes(b"")
    one_line_error(tellkit("convert", tmp_path / "empty.ckpt", "--out", tmp_path / "out"), "empty")


@pytest.mark.parametrize("option, needle", [("nhead=abc", "expected a whole number"),
                                            ("beam_size=true", "expected a whole number"),
                                            ("colour=red", "not an option")])
def test_an_option_of_the_wrong_kind_is_one_line(reference_state, tmp_path, option, needle):
    ref, _ = reference_state
    one_line_error(tellkit("convert", ref, "--out", tmp_path / "out", "-o", option), needle)


@pytest.mark.parametrize("damage, needle", [("nan", "NaN or infinite"), ("int64", "not floating point")])
def test_nan_or_integer_weights_are_refused_at_conversion(reference_state, tmp_path, damage, needle):
    _, state = reference_state
    state = dict(state)
    key = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
    state[key] = state[key].clone().fill_(float("nan")) if damage == "nan" else state[key].to(torch.int64)
    save_file(state, str(tmp_path / "bad.safetensors"))
    one_line_error(tellkit("convert", tmp_path / "bad.safetensors", "--out", tmp_path / "out"), needle, "tensor ")
    assert not (tmp_path / "out").exists()
