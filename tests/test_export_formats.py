"""``tellkit export --format safetensors|onnx|reference``: one command, one module per format
(``tellkit.export``); the earlier format name ``checkpoint`` still means safetensors, and says so."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tellkit.cli import main
from tellkit.registry import create_model


def test_the_default_format_is_safetensors_and_the_old_name_still_works(tmp_path, capsys):
    src = create_model("bttr/tiny").save_pretrained(tmp_path / "m")
    assert main(["export", str(src), "--out", str(tmp_path / "a")]) == 0
    assert main(["export", str(src), "--format", "safetensors", "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main(["export", str(src), "--format", "checkpoint", "--out", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().err.strip() == "tellkit: --format checkpoint is now --format safetensors"
    states = [load_file(str(tmp_path / d / "model.safetensors")) for d in "abc"]
    for k, v in states[0].items():
        assert all(torch.equal(s[k], v) for s in states[1:]), k
    assert json.loads((tmp_path / "a" / "config.json").read_text())["weights_dtype"] == "float16"


def test_a_family_without_a_reference_format_is_one_line(tmp_path, capsys):
    src = create_model("show_attend_tell", vocab_size=50, image_dim=8, embed_dim=8, hidden_dim=8,
                       attention_dim=8, adaptive_cutoffs=[]).save_pretrained(tmp_path / "m")
    assert main(["export", str(src), "--format", "reference", "--out", str(tmp_path / "x.ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no export to the reference format for 'show_attend_tell'" in err and "\n" not in err
    assert not (tmp_path / "x.ckpt").exists()


def test_help_lists_only_the_three_formats(capsys):
    try:
        main(["export", "--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    assert "{safetensors,onnx,reference}" in text
    assert "checkpoint}" not in text and "checkpoint," not in text
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error
        main(["export", "x", "--format", "nonsense", "--out", "y"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "choose from safetensors, onnx, reference" in err and "checkpoint" not in err
