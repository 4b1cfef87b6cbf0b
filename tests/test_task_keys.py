"""One key per task, the command's name, everywhere: the commands, ``tellkit.pipeline``, the
task registry, the processors, recipes and packaged checkpoints, the server's routes and its
``--models`` names. A former name (``captioning``, ``recognition``, ``summarization``, the
server's ``math``) is still read where users typed it, with a one-line deprecation message."""
from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

import tellkit
from tellkit import recipes
from tellkit.checkpoint import save_model
from tellkit.cli import build_parser, main
from tellkit.config import load_yaml
from tellkit.pipelines import TASKS, pipeline_class
from tellkit.recipes import ASSETS, FORMER_TASK_NAMES, TASK_KEYS, task_key
from tellkit.registry import create_model
from tellkit.tasks import _TASKS, _discover, get_task, make_task

CONFIGS = recipes.Path(recipes.__file__).resolve().parent / "configs"


@pytest.fixture
def told(monkeypatch, caplog):
    """The deprecation messages of this test (each is given once per name and place a process)."""
    monkeypatch.setattr(recipes, "_told", set())
    caplog.set_level(logging.WARNING, logger="tellkit")
    return lambda: [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_every_interface_names_each_task_by_its_key():
    _discover()
    commands = {name for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
                for name in a.choices}
    assert set(TASK_KEYS) <= commands  # the commands
    assert set(TASKS) == set(TASK_KEYS)  # tellkit.pipeline
    assert set(TASK_KEYS) <= set(_TASKS) and not set(FORMER_TASK_NAMES) & set(_TASKS)  # the registry
    for key in TASK_KEYS:
        cls = pipeline_class(key)
        assert cls.task == cls.processor_class.task == get_task(key).name == key
    for name, path in recipes.PACKAGED_DEFAULTS.items():  # packaged checkpoints
        assert json.loads((path / "config.json").read_text())["task"] == name
    shipped = {load_yaml(p).get("task") for p in CONFIGS.rglob("*.yaml")}  # shipped recipes
    assert shipped - {None} == set(TASK_KEYS)
    assert not (ASSETS / "configs").exists()


def test_a_former_name_is_read_once_with_a_message(told):
    assert task_key("recognize") == "recognize" and task_key("toy") == "toy" and told() == []
    assert task_key("recognition", "the recipe's task:") == "recognize"
    assert task_key("recognition", "the recipe's task:") == "recognize"
    assert told() == ["tellkit: the recipe's task: 'recognition' is deprecated, the task is now called 'recognize'"]
    assert pipeline_class("captioning") is pipeline_class("caption") and pipeline_class("math").task == "recognize"
    assert len(told()) == 3 and all(len(m.splitlines()) == 1 for m in told())


def test_the_default_path_gives_no_message(told):
    for key in TASK_KEYS:
        pipeline_class(key)
    for path in CONFIGS.rglob("*.yaml"):
        task_key(load_yaml(path).get("task"), str(path))
    assert told() == []


def test_a_recipe_with_a_former_name_builds_its_task(told):
    task = make_task({"task": "recognition", "model": {"name": "bttr"}})
    assert task.name == "recognize" and task.recipe["task"] == "recognize"
    assert len(told()) == 1
    with pytest.raises(tellkit.TellkitError, match="unknown task 'recognise'"):
        make_task({"task": "recognise", "model": {"name": "bttr"}})


def test_a_checkpoint_with_a_former_name_loads_and_evaluates(tmp_path, told, capsys):
    from PIL import Image

    from tellkit.data.crohme import render_square

    root = tmp_path / "data"
    (root / "test" / "t" / "S").mkdir(parents=True)
    for i in range(2):
        render_square([[(0, 0), (10 + 5 * i, 20)], [(0, 20), (10, i)]]).save(root / "test" / "t" / "S" / f"e{i}.png")
    (root / "groundtruth_t.tsv").write_text("S/e0\tx\nS/e1\ty\n", encoding="utf-8")
    torch.manual_seed(0)
    save_model(create_model("bttr/tiny"), tmp_path / "old",
               extra={"task": "recognition", "eval": {"beam_size": 2, "max_len": 4},
                      "data": {"layout": "tsv", "cache": None, "scale": 0.5}})
    image = Image.open(root / "test" / "t" / "S" / "e0.png")
    assert isinstance(tellkit.pipeline("recognition", tmp_path / "old")(image)["text"], str)
    assert main(["evaluate", str(tmp_path / "old"), "--data", str(root), "data.test=t", "--device", "cpu",
                 "--no-progress", "--out", str(tmp_path / "ev")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "ev" / "metrics_test.json").read_text())["task"] == "recognize"
    assert any(f"{tmp_path / 'old'}: task: 'recognition' is deprecated" in m for m in told())


def test_training_a_recipe_with_a_former_name_stores_the_key(tmp_path, told, capsys):
    from tellkit.data.crohme import render_square

    root = tmp_path / "data"
    (root / "train" / "S").mkdir(parents=True)
    for i in range(4):
        render_square([[(0, 0), (10 + 5 * i, 20)], [(0, 20), (10, i)]]).save(root / "train" / "S" / f"e{i}.png")
    (root / "groundtruth_train.tsv").write_text("".join(f"S/e{i}\tx\n" for i in range(4)), encoding="utf-8")
    over = [f"data.root={root}", "data.layout=tsv", "data.train=train", "data.val=train", "data.test=train",
            "data.limit={}", "data.scale=0.5", "train.max_steps=1", "eval.beam_size=1", "eval.max_len=3",
            "task=recognition"]
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(tmp_path / "run"), "--device", "cpu",
                 "--no-progress"]) == 0
    capsys.readouterr()
    stored = json.loads((tmp_path / "run" / "checkpoints" / "best" / "config.json").read_text())
    assert stored["task"] == "recognize"
    assert told() == ["tellkit: the recipe's task: 'recognition' is deprecated, the task is now called 'recognize'"]


def test_the_server_names_each_task_by_its_key(told):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tellkit.pipelines.captioning import CaptioningPipeline
    from tellkit.pipelines.recognition import RecognitionPipeline
    from tellkit.server.app import create_app
    from tellkit.server.backends import SERVED_TASKS

    served = {"caption": CaptioningPipeline.untrained(), "recognize": RecognitionPipeline.untrained()}
    assert set(SERVED_TASKS) == set(served) and set(SERVED_TASKS) <= set(TASK_KEYS)
    app = create_app(served, serve_page=False)
    routes = {r.path for r in app.routes if "POST" in getattr(r, "methods", ())}
    assert routes == {f"/api/{task}" for task in SERVED_TASKS}
    with TestClient(app) as client:
        health = client.get("/health").json()
    assert set(health["models"]) == set(health["workers"]) == set(SERVED_TASKS)
    parser = argparse.ArgumentParser()
    from tellkit.cli import cmd_serve

    cmd_serve.add_arguments(parser)
    assert parser.parse_args([]).models.split(",") == list(SERVED_TASKS)
    assert told() == []
    # the former name of the recognize endpoint, still read
    old = create_app({"math": served["recognize"]}, serve_page=False)
    assert old.state.models["recognize"] is not None and old.state.models["caption"] is None
    assert told() == ["tellkit: create_app model 'math' is deprecated, the task is now called 'recognize'"]
    with pytest.raises(tellkit.TellkitError, match="no endpoint for task 'summarize'"):
        create_app({"summarize": None}, serve_page=False)
