"""Every shipped recipe under configs/ loads: the YAML (with its `base:` chain) parses, its
`train:` section validates, its task exists and accepts the recipe, and its model builds on
the meta device (no memory, no weights). Recipes with a placeholder for a file only the user
has (``REQUIRED-...``) must fail to build with a one-line TellkitError naming it.

Plus the baseline recipes' own promises: the Transformer ablation rows are Transform and Tell
recipes derived with `base:` (not copies), and the last rows reproduce the flagship recipes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tellkit.config import check_recipe_sections, load_yaml
from tellkit.errors import TellkitError
from tellkit.recipes import train_config
from tellkit.registry import build_config, create_model
from tellkit.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
PLACEHOLDER = "REQUIRED-"


def _placeholders(obj) -> list[str]:
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in _placeholders(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in _placeholders(v)]
    return [obj] if isinstance(obj, str) and obj.startswith(PLACEHOLDER) else []


def test_there_are_configs():
    assert len(CONFIGS) >= 30
    assert len(list((ROOT / "configs" / "baselines").rglob("*.yaml"))) >= 20


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_loads_and_builds_on_meta(path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a placeholder must not wait for the network
    recipe = load_yaml(path)
    assert "base" not in recipe  # inheritance resolved
    check_recipe_sections(recipe, str(path))  # `tellkit train` refuses unknown top-level sections
    assert isinstance(recipe.get("task"), str) and recipe["model"]["name"]
    train_config(recipe)
    task = get_task(recipe["task"])(recipe)
    assert task.name == recipe["task"]
    entry, cfg = build_config(recipe)
    assert entry.name == recipe["model"]["name"]
    missing = _placeholders(recipe["model"])
    if missing:
        with pytest.raises(TellkitError, match=missing[0]):
            with torch.device("meta"):
                create_model(recipe)
        return
    with torch.device("meta"):
        model = create_model(recipe)
    assert model.num_parameters() > 0
    assert type(model).family == recipe["model"]["name"]
    # one breakdown shape for every family: disjoint parts that add up to the trainable count
    parts = model.parameter_breakdown()
    assert parts and all(isinstance(v, int) and v >= 0 for v in parts.values())
    assert sum(parts.values()) == model.num_parameters(trainable_only=True)


BL = ROOT / "configs" / "baselines" / "nytimes"


def _section(path, *names):
    r = load_yaml(path)
    return {n: r.get(n) for n in names}


def test_transformer_rows_are_derived_from_the_flagship_recipe():
    for name in ("transformer_glove", "transformer_roberta", "transformer_weighted_roberta", "location_aware",
                 "face_attention", "object_attention", "copying", "no_image"):
        text = (BL / f"{name}.yaml").read_text(encoding="utf-8")
        assert "\nbase: " in text, name
        assert "d_model" not in text and "kernel_sizes" not in text, f"{name} copies the model"
        assert load_yaml(BL / f"{name}.yaml")["model"]["name"] == "transform_and_tell"


def test_last_rows_reproduce_the_flagship_recipes():
    keys = ("task", "model", "encoders", "data", "train", "eval")
    assert _section(BL / "face_attention.yaml", *keys) == _section(ROOT / "configs/tat/nytimes_faces.yaml", *keys)
    assert _section(BL / "object_attention.yaml", *keys) == _section(ROOT / "configs/tat/nytimes_full.yaml", *keys)
    with torch.device("meta"):
        assert create_model(BL / "face_attention.yaml").num_parameters() == 171_068_441
        assert create_model(BL / "object_attention.yaml").num_parameters() == 200_461_337


def test_ablation_steps_change_one_thing_at_a_time():
    def cfg(name):
        return build_config(load_yaml(BL / f"{name}.yaml"))[1], load_yaml(BL / f"{name}.yaml")

    glove, rg = cfg("transformer_glove")
    last, rl = cfg("transformer_roberta")
    weighted, rw = cfg("transformer_weighted_roberta")
    located, rloc = cfg("location_aware")
    faces, _ = cfg("face_attention")
    copying, _ = cfg("copying")
    assert (glove.article_dim, glove.article_layers, rg["encoders"]["article"]) == (300, 1, "glove:glove.840B.300d.txt")
    assert (last.article_dim, last.article_layers, rl["encoders"]["article"]) == (1024, 1, "roberta-large")
    assert weighted.article_layers == 25 and rw["data"]["context"] == "first_tokens"
    assert rloc["data"]["context"] == "location_aware" and located.contexts == ("image", "article")
    assert faces.contexts == ("image", "article", "faces") and not faces.copy and copying.copy
    assert build_config(load_yaml(BL / "no_image.yaml"))[1].contexts == ("article",)
    lstm_glove = build_config(load_yaml(BL / "lstm_glove.yaml"))[1]
    lstm_rob = build_config(load_yaml(BL / "lstm_weighted_roberta.yaml"))[1]
    assert (lstm_glove.article_dim, lstm_glove.article_layers) == (300, 1)
    assert (lstm_rob.article_dim, lstm_rob.article_layers) == (1024, 25)


def test_a_recipe_is_named_by_path_or_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """`bttr/crohme`, `bttr/crohme.yaml` and `configs/bttr/crohme.yaml` name the packaged recipe from
    any folder; a name not found is one line naming the nearest packaged recipes."""
    from tellkit.cli import main
    from tellkit.config import CONFIG_ROOT, resolve_config_path

    monkeypatch.chdir(tmp_path)
    want = CONFIG_ROOT / "bttr" / "crohme.yaml"
    for name in ("bttr/crohme", "bttr/crohme.yaml", "configs/bttr/crohme.yaml", "configs/bttr/crohme"):
        assert resolve_config_path(name) == want
    (tmp_path / "configs" / "bttr").mkdir(parents=True)
    (tmp_path / "configs" / "bttr" / "crohme.yaml").write_text("model: {name: bttr}\n")
    assert resolve_config_path("configs/bttr/crohme.yaml") == Path("configs/bttr/crohme.yaml")  # a file here wins
    assert main(["model-info", "configs/bttr/crohme_cpu.yaml"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "bttr"
    assert main(["model-info", "bttr/crohm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config not found: bttr/crohm; nearest packaged recipes: bttr/crohme" in err
