"""Recipe and override parsing bounded in work: file size, value count, nesting depth, no YAML
anchors or aliases (a circular one included), no 5,000-digit number; a FIFO or a device as the
recipe says what it is. Each is one line through `tellkit train` (exit 2), quickly."""
from __future__ import annotations

import os
import time

import pytest

from tellkit.cli import main
from tellkit.config import MAX_RECIPE_NODES, load_yaml, parse_overrides
from tellkit.errors import TellkitError

GOOD = "task: recognize\nmodel: {name: bttr}\n"


def run_train(capsys, *args) -> str:
    t0 = time.monotonic()
    assert main(["train", *map(str, args), "--out", "/nonexistent-never-made/run"]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("text, needle", [
    (GOOD + "data: {extra: &a [1, *a]}\n", "anchors and aliases"),
    (GOOD + "data: &d {root: x}\ntrain: *d\n", "anchors and aliases"),
    (GOOD + "data: {n: " + "7" * 5000 + "}\n", "a number of 5,000 characters"),
    (GOOD + "data: " + "[" * 200 + "]" * 200 + "\n", "nested more than 64 levels"),
    (GOOD + "data: [" + ",".join(["1"] * (MAX_RECIPE_NODES + 10)) + "]\n", "more than 100,000 values"),
    (GOOD + "data: [" + ",".join(["1"] * 3_000_000) + "]\n", "larger than the 1,048,576 bytes"),
    ("a: [1, 2\n", "not valid YAML"),
])
def test_hostile_recipes_are_one_line(tmp_path, capsys, text, needle):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    assert needle in run_train(capsys, path)


@pytest.mark.parametrize("override, needle", [
    ("model.extra=&a [1,*a]", "override model.extra: YAML anchors and aliases"),
    ("model.n=" + "9" * 5000, "override model.n: a number of 5,000 characters"),
    ("model.x=" + "[" * 100 + "]" * 100, "override model.x: nested more than 64"),
])
def test_hostile_overrides_are_one_line(tmp_path, capsys, override, needle):
    path = tmp_path / "r.yaml"
    path.write_text(GOOD)
    assert needle in run_train(capsys, path, override)


def test_plain_overrides_still_read():
    assert parse_overrides(["train.lr=0.001", "model.x=a:b", "data.tags=[a, b]", "eval.s="]) == {
        "train": {"lr": 0.001}, "model": {"x": "a:b"}, "data": {"tags": ["a", "b"]}, "eval": {"s": ""}}


def test_a_fifo_or_a_device_as_the_recipe_says_what_it_is(tmp_path, capsys):
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    assert "is a FIFO (named pipe), not a regular file" in run_train(capsys, fifo)
    assert "/dev/zero is a character device" in run_train(capsys, "/dev/zero")
    with pytest.raises(TellkitError, match="not a regular file"):
        load_yaml(fifo)


def test_every_packaged_recipe_passes_the_bounds():
    from tellkit.config import CONFIG_ROOT, recipe_names

    for name in recipe_names():
        assert isinstance(load_yaml(CONFIG_ROOT / f"{name}.yaml"), dict)
