"""The package works outside its checkout.

The wheel is built from a copy of the sources (so the checkout's ``build/`` can not leak stale
files into it), checked to hold every package-data file of ``src/tellkit``, unpacked into a
temporary folder, and the README's Python blocks run as written (the quick start's
``tellkit.pipeline`` calls on ``photo.jpg`` and ``formula.png``, the model API) from another
folder with the checkout removed from ``sys.path`` (dependencies come from the running
interpreter's site-packages); the command line finds the packaged recipes from there too.

Also here: the test process runs with the model hub offline (set by ``tests/conftest.py``) and
the ``shared_data`` fixture honours ``$TELLKIT_SHARED_DATA`` (skip locally, fail in CI).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tellkit"
# Files under src/tellkit that are never package contents.
_NOT_SHIPPED = re.compile(r"(^|/)(__pycache__/|\.[^/]*$)|\.py[co]$")


def readme_python_blocks() -> list[str]:
    """Every ```python block of the README, in order."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)
    assert blocks, "README.md has no ```python block"
    return blocks


def _source_files() -> set[str]:
    out = set()
    for p in PACKAGE.rglob("*"):
        rel = p.relative_to(PACKAGE.parent).as_posix()
        if p.is_file() and not _NOT_SHIPPED.search(rel):
            out.add(rel)
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src-copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "-q", "-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("tellkit-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_wheel_ships_every_package_file_and_the_default_models(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"files of src/tellkit missing from the wheel (add them to package-data): {missing}"
    for required in ("tellkit/py.typed", "tellkit/configs/tat/tiny.yaml",
                     "tellkit/assets/default_caption/config.json", "tellkit/assets/default_caption/model.safetensors",
                     "tellkit/assets/bttr_default/config.json", "tellkit/assets/bttr_default/model.safetensors",
                     "tellkit/server/static/index.html"):
        assert required in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tellkit = tellkit.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


# Runs in a fresh interpreter (-I: no PYTHONPATH, no user site, no script folder on sys.path).
# The checkout's src would still arrive through the editable install's .pth in site-packages,
# so every sys.path entry inside the checkout is dropped before tellkit is imported, and no
# module may be loaded from the checkout afterwards.
_RUNNER = textwrap.dedent("""
    import contextlib
    import io
    import json
    import sys
    from importlib.resources import files
    from pathlib import Path

    site, checkout, example = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    env = Path(sys.prefix).resolve()  # the interpreter's environment may live in the checkout (.venv)


    def in_checkout(path) -> bool:
        path = Path(path).resolve()
        return path.is_relative_to(checkout) and not path.is_relative_to(env)


    sys.path[:] = [p for p in sys.path if p and not in_checkout(p)]
    sys.path.insert(0, str(site))

    for i, block in enumerate(json.loads(example)):  # one namespace, as a reader would run them
        exec(compile(block, f"README.md (Python block {i + 1})", "exec"))

    import tellkit
    from tellkit.cli import main

    assert Path(tellkit.__file__).resolve().is_relative_to(site), tellkit.__file__
    assert Path("ckpt/config.json").is_file() and Path("ckpt/model.safetensors").is_file()
    assert model.num_parameters() > 0
    # the quick start's pipelines ran on the packaged default models installed with the wheel
    assert Path(captioner.info["checkpoint"]).resolve().is_relative_to(site)
    assert len(captioner("photo.jpg")["text"].split()) >= 3
    assert reader("formula.png")["text"] == "x ^ { 2 } + 1"
    assert reader.info["dtype"] in ("bfloat16", "float32")
    for name in ("default_caption", "bttr_default"):  # the packaged default models load
        default = tellkit.load_model(files("tellkit") / "assets" / name)
        assert default.num_parameters() > 0, name
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the command line finds the packaged recipe too
        assert main(["model-info", "tat/tiny"]) == 0
    assert json.loads(out.getvalue())["family"] == model.family
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # a configs/ path of the checkout names the packaged recipe
        assert main(["model-info", "configs/bttr/crohme.yaml"]) == 0
    assert json.loads(out.getvalue())["family"] == "bttr"

    leaked = sorted(n for n, m in list(sys.modules.items()) if in_checkout(getattr(m, "__file__", None) or "/"))
    assert not leaked, f"modules imported from the checkout: {leaked}"
    print("family", model.family)
""")


@pytest.mark.slow
def test_readme_python_blocks_run_from_the_unpacked_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the files the quick start names: a photo and a handwritten formula
    shutil.copy2(PACKAGE / "assets" / "demo_caption" / "coffee.jpg", elsewhere / "photo.jpg")
    shutil.copy2(PACKAGE / "assets" / "samples" / "bttr_x2_plus_1.png", elsewhere / "formula.png")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        [sys.executable, "-I", "-c", _RUNNER, str(site), str(ROOT), json.dumps(readme_python_blocks())],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"README example failed outside the checkout:\n{proc.stdout}\n{proc.stderr}"
    assert "family transform_and_tell" in proc.stdout


def test_readme_examples_are_the_documented_ones():
    quick, api = readme_python_blocks()[:2]
    assert 'tellkit.pipeline("caption")' in quick and 'tellkit.pipeline("recognize"' in quick
    assert '("photo.jpg")["text"]' in quick and '("formula.png")["text"]' in quick
    assert 'tellkit.create_model("tat/tiny")' in api
    assert "save_pretrained(" in api and "tellkit.load_model(" in api


def test_model_hub_is_offline_in_the_test_process():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE is True  # read once at import: the variable came first


_PROBE = """
def test_probe(shared_data):
    print("DATA", shared_data)
"""


def _run_probe(tmp_path, *args: str, **env_overrides: str) -> subprocess.CompletedProcess:
    shutil.copy2(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    data: shared data\n", encoding="utf-8")
    (tmp_path / "test_probe.py").write_text(_PROBE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TELLKIT_SHARED_DATA")}
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-s", "-p", "no:cacheprovider", *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )


def test_shared_data_fixture_honours_the_variable_skips_locally_and_fails_in_ci(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    found = _run_probe(tmp_path, TELLKIT_SHARED_DATA=str(data), CI="true")
    assert found.returncode == 0 and f"DATA {data}" in found.stdout, found.stdout

    absent = str(tmp_path / "absent")
    local = _run_probe(tmp_path, TELLKIT_SHARED_DATA=absent)
    assert local.returncode == 0 and "1 skipped" in local.stdout and absent in local.stdout, local.stdout

    ci = _run_probe(tmp_path, TELLKIT_SHARED_DATA=absent, CI="true")
    # pytest.fail in a fixture reports an error (exit status 1), never a skip
    assert ci.returncode == 1 and "1 error" in ci.stdout and "CI=true" in ci.stdout, ci.stdout

    # a test that takes the fixture is marked `data`, so -m leaves it out
    unmarked = _run_probe(tmp_path, "-m", "not data", TELLKIT_SHARED_DATA=absent, CI="true")
    assert unmarked.returncode == 5 and "1 deselected" in unmarked.stdout, unmarked.stdout
