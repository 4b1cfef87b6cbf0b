"""Loading hostile or broken checkpoints and recipes: refused with one line before anything
large is allocated; nothing is unpickled."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import toy_task  # noqa: E402

from tellkit import load_model  # noqa: E402
from tellkit.checkpoint import check_config_values  # noqa: E402
from tellkit.config import load_yaml  # noqa: E402
from tellkit.errors import TellkitError  # noqa: E402


@pytest.fixture()
def ckpt(tmp_path):
    model = toy_task.ToyLM(toy_task.ToyConfig())
    return model.save_pretrained(tmp_path / "ckpt")


def set_config(ckpt: Path, **fields):
    meta = json.loads((ckpt / "config.json").read_text())
    meta.update(fields)
    (ckpt / "config.json").write_text(json.dumps(meta))


def refused(ckpt, *needles, **kw):
    with pytest.raises(TellkitError) as err:
        load_model(ckpt, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_a_huge_dimension_is_refused_before_allocating(ckpt):
    # 1e12 x 8 float32 embedding = 32 TB: without the meta-device estimate this allocates
    set_config(ckpt, config={"vocab": 10**12, "dim": 8, "dropout": 0.1})
    refused(ckpt, "the model would take", "GiB", "TELLKIT_MAX_MODEL_BYTES")


def test_the_size_limit_is_configurable(ckpt, monkeypatch):
    load_model(ckpt)
    monkeypatch.setenv("TELLKIT_MAX_MODEL_BYTES", "1000")  # the toy model holds 1,104 bytes
    refused(ckpt, "more than the 0.0 GiB limit")


def test_negative_sizes_are_one_line_errors(ckpt):
    set_config(ckpt, config={"vocab": 12, "dim": -5, "dropout": 0.1})
    refused(ckpt, "does not build")


def test_a_huge_count_of_layers_is_refused_before_building(tmp_path):
    from tellkit import create_model

    m = create_model("lstm_captioner", vocab_size=20, embed_dim=4, hidden_dim=4, adaptive_cutoffs=(), num_layers=1,
                     contexts=("image",), image_dim=4)
    d = m.save_pretrained(tmp_path / "lstm")
    meta = json.loads((d / "config.json").read_text())
    meta["config"]["num_layers"] = 1025
    (d / "config.json").write_text(json.dumps(meta))
    refused(d, "num_layers = 1025", "1024")
    with pytest.raises(TellkitError, match="encoder_layers"):
        check_config_values({"backbone_config": {"encoder_layers": 10**6}}, "x")
    check_config_values({"fusion_layers": [-1, -2], "num_layers": 4}, "x")  # indices may be negative


@pytest.mark.parametrize("family", [["toy_lm"], {"name": "toy_lm"}, 3])
def test_family_must_be_a_name(ckpt, family):
    set_config(ckpt, family=family)
    refused(ckpt, "'family' must be a model family name")


def test_config_must_be_a_mapping(ckpt):
    set_config(ckpt, config=[1, 2])
    refused(ckpt, "'config' must be a mapping")


def test_deeply_nested_json(ckpt):
    good = json.loads((ckpt / "config.json").read_text())
    n = 200_000
    (ckpt / "config.json").write_text('{"family": "toy_lm", "config": {"x": ' + "[" * n + "]" * n + "}}")
    refused(ckpt, "config.json", "RecursionError")
    deep = json.dumps({**good, "note": "[" * 40 + "]" * 40}).replace('"[', "[").replace(']"', "]")
    (ckpt / "config.json").write_text(deep)
    refused(ckpt, "nested more than 32 levels")


def test_an_oversized_config_file(ckpt):
    set_config(ckpt, note="x" * (5 << 20))
    refused(ckpt, "more than the")


def test_nan_or_inf_weights_are_refused(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    w["hid.weight"][1, 2] = float("inf")
    save_file(w, str(ckpt / "model.safetensors"))
    refused(ckpt, "hid.weight", "NaN or infinite")


def test_integer_weights_are_refused(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    w["hid.weight"] = torch.ones_like(w["hid.weight"], dtype=torch.int64)
    save_file(w, str(ckpt / "model.safetensors"))
    refused(ckpt, "hid.weight is int64", "float32")


def test_half_precision_weights_still_load(ckpt):
    w = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v.half() for k, v in w.items()}, str(ckpt / "model.safetensors"))
    assert next(load_model(ckpt).parameters()).dtype == torch.float32


def test_cyclic_base_in_a_recipe(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\ntrain: {lr: 1}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(TellkitError, match=r"'base:' chain loops \(a.yaml -> b.yaml -> a.yaml\)"):
        load_yaml(tmp_path / "a.yaml")
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    with pytest.raises(TellkitError, match="loops"):
        load_yaml(tmp_path / "self.yaml")


def test_model_info_on_a_hostile_checkpoint(ckpt, capsys):
    from tellkit.cli import main

    set_config(ckpt, config={"vocab": 12, "dim": -5, "dropout": 0.1})
    assert main(["model-info", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not build" in err[0]
