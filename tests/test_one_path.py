"""One path from input to answer: `tellkit evaluate`, the command (`tellkit recognize` /
`tellkit caption`), the server's API and `tellkit.pipeline` give the same answers on the same
real inputs, because they run the same processor and the same `generate` with the same stored
generation settings (the runaway stop and the runtime included). BTTR on 20 CROHME 2014 InkML
files, the packaged model with its search stored at beam 4 (to keep the test short; otherwise
the default's: bidirectional, rescored) and with a non-default setting stored as well (no
rescoring), on PyTorch and on ONNX Runtime (`--runtime onnx`); photos given to the formula reader,
whose searches run away and are stopped; the packaged captioner on 8 Flickr8k test photos."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import tellkit
from tellkit.cli import main
from tellkit.recipes import ASSETS, PACKAGED_DEFAULTS

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tellkit.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow
N_INKML, N_PHOTOS = 20, 8


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _evaluated(capsys, checkpoint, data, out, *overrides) -> dict[str, dict]:
    assert main(["evaluate", str(checkpoint), "--data", str(data), *overrides, "--device", "cpu", "--no-progress",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    rows = [json.loads(line) for line in (out / "predictions_test.jsonl").read_text().splitlines()]
    return {r["id"]: r for r in rows}


@pytest.fixture(scope="module")
def inkml_root(shared_data, tmp_path_factory) -> Path:
    """A data root holding the first 20 InkML files of CROHME 2014 test (by name)."""
    src = sorted((shared_data / "crohme_inkml" / "test" / "2014").glob("*.inkml"))[:N_INKML]
    root = tmp_path_factory.mktemp("crohme")
    (root / "test" / "2014").mkdir(parents=True)
    for f in src:
        (root / "test" / "2014" / f.name).symlink_to(f)
    return root


def _stored_search(folder: Path, **search) -> Path:
    """The packaged BTTR with another search setting stored in its config.json."""
    folder.mkdir()
    meta = json.loads((PACKAGED_DEFAULTS["recognize"] / "config.json").read_text())
    meta["eval"] = {**meta["eval"], **search}
    (folder / "config.json").write_text(json.dumps(meta))
    shutil.copy2(PACKAGED_DEFAULTS["recognize"] / "model.safetensors", folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def stored_searches(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bttr")
    return {"rescored": _stored_search(root / "rescored", beam_size=4),
            "no_rescore": _stored_search(root / "plain", beam_size=4, rescore=False)}


@pytest.mark.parametrize("stored", ["rescored", "no_rescore"])
def test_bttr_answers_the_same_everywhere(stored, inkml_root, stored_searches, tmp_path, capsys):
    from tellkit.data.inkml import read_inkml

    ckpt = stored_searches[stored]
    files = sorted((inkml_root / "test" / "2014").glob("*.inkml"))
    ids = {f.stem: str(f) for f in files}

    evaluated = _evaluated(capsys, ckpt, inkml_root, tmp_path / "ev", "data.test=2014", "data.limit={}",
                           f"data.cache={tmp_path / 'renders'}")
    assert sorted(evaluated) == sorted(ids)
    by_eval = {ids[i]: r["prediction"] for i, r in evaluated.items()}
    eval_scores = {ids[i]: r["score"] for i, r in evaluated.items()}

    assert main(["recognize", str(inkml_root / "test" / "2014"), "--model", str(ckpt), "--json"]) == 0
    by_cli = {r["input"]: r for r in _json_lines(capsys.readouterr().out)}

    pipe = tellkit.pipeline("recognize", ckpt)
    by_api = dict(zip(map(str, files), pipe([str(f) for f in files])))

    by_server = {}
    with TestClient(create_app({"recognize": tellkit.pipeline("recognize", ckpt)}, serve_page=False)) as client:
        for f in files:
            strokes = [[[float(x), float(y)] for x, y in s[:, :2]] for s in read_inkml(f).strokes]
            r = client.post("/api/recognize", data={"strokes": json.dumps(strokes)})
            assert r.status_code == 200, r.text
            by_server[str(f)] = r.json()

    for f in map(str, files):
        answers = {"evaluate": by_eval[f], "recognize": by_cli[f]["text"], "pipeline": by_api[f]["text"],
                   "server": by_server[f]["latex"]}
        assert len(set(answers.values())) == 1, (f, answers)
        scores = [eval_scores[f], by_cli[f]["score"], by_api[f]["score"], by_server[f]["score"]]
        assert max(scores) - min(scores) < 1e-4, (f, scores)
    # the stored search setting reached every path (and the search): the model says what it ran
    gen = pipe.generation
    assert (gen.rescore, gen.beam_size, gen.bidirectional) == (stored == "rescored", 4, True)
    assert by_server[str(files[0])]["model"]["served_with"]["beam_size"] == gen.beam_size
    assert sum(r["correct"] for r in evaluated.values()) >= 4  # a trained reader, not noise


def test_the_stored_search_setting_changes_the_search(inkml_root, stored_searches):
    """No rescoring gives other scores than rescoring on the same inputs."""
    files = [str(f) for f in sorted((inkml_root / "test" / "2014").glob("*.inkml"))[:4]]
    rescored = tellkit.pipeline("recognize", stored_searches["rescored"])(files)
    plain = tellkit.pipeline("recognize", stored_searches["no_rescore"])(files)
    assert any(abs(a["score"] - b["score"]) > 1e-3 for a, b in zip(rescored, plain))


def test_a_runaway_input_answers_the_same_everywhere(stored_searches, capsys):
    """Photos given to the formula reader: every entry point stops the same runaway searches
    (the stored generation setting, not the caller) and gives the same answer, flagged unsure."""
    from tellkit.tasks import make_task
    from tellkit.workflows import checkpoint_recipe

    ckpt = stored_searches["rescored"]
    photos = [str(ASSETS / "demo_caption" / name) for name in ("chelsea.jpg", "coffee.jpg")]
    pipe = tellkit.pipeline("recognize", ckpt)
    by_api = dict(zip(photos, pipe(photos)))
    unstopped = dict(zip(photos, tellkit.pipeline("recognize", ckpt, stop_runaways=False)(photos)))

    assert main(["recognize", *photos, "--model", str(ckpt), "--json"]) == 0
    by_cli = {r["input"]: r for r in _json_lines(capsys.readouterr().out)}

    task = make_task(checkpoint_recipe(ckpt))  # what evaluation runs: the task's predict
    by_eval = {f: task.predict(pipe.model, pipe.preprocess(pipe.prepare([f])))[0] for f in photos}

    by_server = {}
    with TestClient(create_app({"recognize": tellkit.pipeline("recognize", ckpt)}, serve_page=False)) as client:
        for f in photos:
            r = client.post("/api/recognize", files={"image": (Path(f).name, Path(f).read_bytes(), "image/jpeg")})
            assert r.status_code == 200, r.text
            by_server[f] = r.json()

    for f in photos:
        answers = {"evaluate": (by_eval[f]["prediction"], by_eval[f]["unsure"]),
                   "recognize": (by_cli[f]["text"], by_cli[f]["unsure"]),
                   "pipeline": (by_api[f]["text"], by_api[f]["unsure"]),
                   "server": (by_server[f]["latex"], by_server[f]["unsure"])}
        assert len(set(answers.values())) == 1 and by_api[f]["unsure"] is True, (f, answers)
        # the search was stopped: without the stop it writes on to the length limit
        assert len(by_api[f]["tokens"]) < len(unstopped[f]["tokens"]) == pipe.generation.max_len, f


def test_bttr_answers_the_same_on_onnx_runtime(inkml_root, stored_searches, tmp_path, capsys, monkeypatch):
    """``--runtime onnx`` (evaluate, the command, the pipeline and a server over it) gives the
    answers of PyTorch: the runtime is chosen where the model is loaded, the same way for all."""
    pytest.importorskip("onnxruntime")
    from tellkit.data.inkml import read_inkml

    monkeypatch.setenv("TELLKIT_CACHE", str(tmp_path / "cache"))
    ckpt = stored_searches["rescored"]
    root = tmp_path / "crohme"
    (root / "test" / "2014").mkdir(parents=True)
    files = []
    for f in sorted((inkml_root / "test" / "2014").glob("*.inkml"))[:8]:
        (root / "test" / "2014" / f.name).symlink_to(f.resolve())
        files.append(root / "test" / "2014" / f.name)
    paths = [str(f) for f in files]
    by_torch = dict(zip(paths, (r["text"] for r in tellkit.pipeline("recognize", ckpt)(paths))))

    evaluated = _evaluated(capsys, ckpt, root, tmp_path / "ev", "data.test=2014", "data.limit={}",
                           f"data.cache={tmp_path / 'renders'}", "--runtime", "onnx")
    by_eval = {str(root / "test" / "2014" / f"{i}.inkml"): r["prediction"] for i, r in evaluated.items()}
    assert json.loads((tmp_path / "ev" / "metrics_test.json").read_text())["runtime"] == "onnx"

    assert main(["recognize", *paths, "--model", str(ckpt), "--runtime", "onnx", "--json"]) == 0
    by_cli = {r["input"]: r["text"] for r in _json_lines(capsys.readouterr().out)}
    pipe = tellkit.pipeline("recognize", ckpt, runtime="onnx")
    assert pipe.info["runtime"] == "onnx" and pipe.runner is not pipe.model
    by_api = dict(zip(paths, (r["text"] for r in pipe(paths))))
    by_server = {}
    with TestClient(create_app({"recognize": pipe}, serve_page=False)) as client:
        for f in files:
            strokes = [[[float(x), float(y)] for x, y in s[:, :2]] for s in read_inkml(f).strokes]
            r = client.post("/api/recognize", data={"strokes": json.dumps(strokes)})
            assert r.status_code == 200, r.text
            by_server[str(f)] = r.json()["latex"]

    for f in paths:
        answers = {"torch": by_torch[f], "evaluate": by_eval[f], "recognize": by_cli[f], "pipeline": by_api[f],
                   "server": by_server[f]}
        assert len(set(answers.values())) == 1, (f, answers)


def test_the_captioner_answers_the_same_everywhere(shared_data, tmp_path, capsys):
    from tellkit.tasks import make_task
    from tellkit.workflows import checkpoint_recipe

    ckpt = PACKAGED_DEFAULTS["caption"]
    data = shared_data / "flickr8k"
    recipe = checkpoint_recipe(ckpt)
    recipe["data"] = {**recipe["data"], "root": str(data)}
    samples = make_task(recipe).load_samples("test")
    photos = list(dict.fromkeys(s.image_id for s in samples))[:N_PHOTOS]
    paths = {s.image_id: s.image_path for s in samples if s.image_id in photos}
    n_captions = sum(1 for s in samples if s.image_id in photos)
    assert samples[n_captions - 1].image_id == photos[-1]  # the 8 photos' captions come first

    evaluated = _evaluated(capsys, ckpt, data, tmp_path / "ev", f"data.limit={{test: {n_captions}}}",
                           "eval.metrics=[bleu]")
    by_eval = {paths[r["image_id"]]: r["prediction"] for r in evaluated.values()}
    assert sorted(by_eval) == sorted(paths.values())

    files = [paths[i] for i in photos]
    assert main(["caption", *files, "--json"]) == 0
    by_cli = {r["input"]: r["text"] for r in _json_lines(capsys.readouterr().out)}
    by_api = dict(zip(files, (r["text"] for r in tellkit.pipeline("caption")(files))))
    by_server = {}
    with TestClient(create_app({"caption": tellkit.pipeline("caption")}, serve_page=False)) as client:
        for f in files:
            r = client.post("/api/caption", files={"image": (Path(f).name, Path(f).read_bytes(), "image/jpeg")})
            assert r.status_code == 200, r.text
            by_server[f] = r.json()["caption"]
    for f in files:
        answers = {"evaluate": by_eval[f], "caption": by_cli[f], "pipeline": by_api[f], "server": by_server[f]}
        assert len(set(answers.values())) == 1, (f, answers)
        assert len(by_api[f].split()) >= 3
