"""The baselines end to end through the real command line, on the real data in ../shared/data
with tiny models and a few optimizer steps (smoke tests, not measurements):

- `tellkit table` trains and evaluates Show and Tell, Show-Attend-and-Tell, the LSTM captioner
  (static word vectors and weighted MiniLM) and the Transformer rows (static vectors, weighted,
  no image) on a few Flickr8k captions, and writes the Markdown + JSON table;
- `tellkit train` + `tellkit evaluate` run a baseline recipe directly (the generic loop);
- the Bahdanau seq2seq trains and generates on the 28 How2 samples (summarization task).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tellkit.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
F8K = ROOT / "configs" / "baselines" / "flickr8k"
TINY_LSTM = {"embed_dim": 16, "hidden_dim": 16}
TINY_TAT = {"d_model": 16, "num_heads": 2, "ffn_dim": 32, "kernel_sizes": [3, 3], "adaptive_factor": 2.0}
SMALL_DATA = {"limit": {"train": 10, "val": 5, "test": 5}}
FAST_EVAL = {"metrics": ["bleu", "rouge", "cider"], "ner": False, "max_len": 8}


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _tiny_recipe(tmp_path: Path, name: str, model: dict, root: Path) -> Path:
    """A recipe that is the shipped one with a tiny model and a few samples (`base:` chain)."""
    import yaml

    recipe = {"base": str(F8K / f"{name}.yaml"), "model": model, "data": {**SMALL_DATA, "root": str(root)},
              "eval": FAST_EVAL, "train": {"batch_size": 4}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.mark.data
@pytest.mark.slow
def test_table_trains_evaluates_and_prints_every_caption_baseline(tmp_path, shared_data):
    root = shared_data / "flickr8k"
    rows = {"show_tell": TINY_LSTM, "show_attend_tell": {**TINY_LSTM, "attention_dim": 8},
            "lstm_static": TINY_LSTM, "lstm_weighted": TINY_LSTM,
            "transformer_static": TINY_TAT, "transformer_weighted": TINY_TAT, "no_image": TINY_TAT}
    paths = [_tiny_recipe(tmp_path, n, m, root) for n, m in rows.items()]
    out = tmp_path / "table"
    rc, stdout, err = _cli("table", *paths, "--budget", 2, "--out", out, "--features", tmp_path / "feat",
                           "--device", "cpu", "--threads", 1)
    assert rc == 0, err
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| Model | Encoder | BLEU-4 | ROUGE |") and "CIDEr" in lines[0]
    assert "Best val loss" in lines[0] and "| mobilenet_v2 |" in lines[2]
    assert len(lines) == 2 + len(rows)
    table = json.loads((out / "table.json").read_text(encoding="utf-8"))
    assert (out / "table.md").read_text(encoding="utf-8") == "\n".join(lines) + "\n"
    assert [r["row"] for r in table["rows"]] == ["Show and Tell", "Show, Attend and Tell", "LSTM + static vectors",
                                                "LSTM + weighted MiniLM", "Transformer + static vectors",
                                                "Transformer + weighted MiniLM", "Transformer, no image"]
    for r in table["rows"]:
        assert r["steps"] == 2 and r["n"] == 5 and r["task"] == "caption"
        assert {"bleu4", "rouge_l", "cider", "loss"} <= set(r["metrics"])
    fams = [r["family"] for r in table["rows"]]
    assert fams == ["show_tell", "show_attend_tell", "lstm_captioner", "lstm_captioner",
                    "transform_and_tell", "transform_and_tell", "transform_and_tell"]
    # every row generated a caption for every test sample
    for r in table["rows"]:
        run = out / f"{tmp_path.name}_{Path(r['config']).stem}"
        preds = (run / "eval" / "predictions_test.jsonl").read_text(encoding="utf-8").splitlines()
        assert len(preds) == 5 and all(isinstance(json.loads(p)["prediction"], str) for p in preds)
    # a second call reads the rows back instead of training again
    rc, stdout2, err2 = _cli("table", *paths[:2], "--budget", 2, "--out", out, "--device", "cpu")
    assert rc == 0 and "results exist" in err2
    again = [ln for ln in stdout2.splitlines() if ln.startswith("|")]
    assert again[2] == lines[2] and len(again) == 4


@pytest.mark.data
@pytest.mark.slow
def test_paper_rows_print_published_figures_and_resume_an_interrupted_row(tmp_path, shared_data, monkeypatch):
    """The Flickr8k paper rows: the published figures under each row, BLEU-1..3 columns because
    they are published, and a row whose training was interrupted resumes instead of restarting."""
    import os
    import signal

    import yaml

    from tellkit.tasks.captioning import CaptioningTask

    root = shared_data / "flickr8k"
    papers = ROOT / "configs" / "baselines" / "flickr8k_papers"
    path = tmp_path / "show_tell.yaml"
    path.write_text(yaml.safe_dump({"base": str(papers / "show_tell.yaml"), "model": TINY_LSTM,
                                    "encoders": {"image": "mobilenet_v2"},
                                    "data": {**SMALL_DATA, "root": str(root), "features": str(tmp_path / "feat")},
                                    "eval": {**FAST_EVAL, "beam_size": 2}, "train": {"batch_size": 4}}))
    out = tmp_path / "table"
    collate, calls = CaptioningTask.collate, []

    def stopped_after_two_batches(self, items):  # as if the person pressed Ctrl-C in the third step
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return collate(self, items)

    monkeypatch.setattr(CaptioningTask, "collate", stopped_after_two_batches)
    rc, _, err = _cli("table", path, "--budget", 4, "--out", out, "--no-progress", "--device", "cpu")
    assert rc == 130 and "interrupted" in err
    assert not (out / f"{tmp_path.name}_show_tell" / "table_row.json").exists()
    monkeypatch.setattr(CaptioningTask, "collate", collate)
    rc, stdout, err = _cli("table", path, "--budget", 4, "--out", out, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "Show and Tell: resuming" in err
    resumed = re.search(r"resumed from .* \(step (\d+),", stdout)
    assert resumed and 2 <= int(resumed.group(1)) < 4, stdout[:2000]
    (row,) = json.loads((out / "table.json").read_text(encoding="utf-8"))["rows"]
    assert row["steps"] == 4 and row["published"]["source"].startswith("Vinyals")
    assert row["published"]["metrics"]["bleu1"] == 63.0
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| Model | Encoder | BLEU-1 | BLEU-4 |")
    assert lines[3].startswith("| &nbsp;&nbsp;published: Vinyals et al. 2015 | GoogLeNet | 63.00 |")


def test_published_figures_are_checked(tmp_path):
    from tellkit.errors import TellkitError
    from tellkit.workflows import published_numbers

    assert published_numbers({"source": "X 2015", "bleu4": 19.5}, "r")["metrics"] == {"bleu4": 19.5}
    for bad in ({"bleu4": 1}, {"source": "X", "bleu4": "high"}, ["source"]):
        with pytest.raises(TellkitError, match="published"):
            published_numbers(bad, "r")


@pytest.mark.data
@pytest.mark.slow
def test_train_then_evaluate_show_attend_tell_directly(tmp_path, shared_data):
    recipe = _tiny_recipe(tmp_path, "show_attend_tell", {**TINY_LSTM, "attention_dim": 8}, shared_data / "flickr8k")
    run = tmp_path / "run"
    rc, stdout, err = _cli("train", recipe, f"data.features={tmp_path / 'feat'}", "train.max_steps=3",
                           "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "features:" not in err  # --no-progress: no bar for the feature cache either
    summary = json.loads(stdout[stdout.index("{"):])
    assert summary["steps"] == 3 and summary["best_checkpoint"]
    rc, stdout, err = _cli("evaluate", run, "--split", "test", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "features:" not in err  # evaluate extracted the test split's features without a bar
    res = json.loads(stdout[stdout.index("{"):])
    assert res["n"] == 5 and "cider" in res["metrics"]
    # the run serves `tellkit caption` like a Transform and Tell run: attention over the grid per token
    image = next((shared_data / "flickr8k").rglob("*.jpg"))
    rc, stdout, err = _cli("caption", image, "--model", run, "--json", "--max-len", 6)
    assert rc == 0, err
    cap = json.loads(stdout)
    assert cap["model"]["name"] == "show_attend_tell" and cap["model"]["trained"] is True
    assert 1 <= len(cap["tokens"]) <= 7 and isinstance(cap["text"], str)
    grid = cap["grid"]["rows"] * cap["grid"]["cols"]
    for tok in cap["tokens"]:
        assert set(tok["attention"]) == {"image"} and len(tok["attention"]["image"]) == grid
        assert abs(sum(tok["attention"]["image"]) - 1) < 1e-3


@pytest.mark.data
@pytest.mark.slow
@pytest.mark.parametrize("name,model", [("lstm_static", TINY_LSTM), ("transformer_static", TINY_TAT)])
def test_static_vector_rows_train_and_evaluate_directly(tmp_path, shared_data, name, model):
    """The "+ GloVe" rows through `tellkit train` / `tellkit evaluate` (not only `tellkit table`):
    the task's own featurizer reads the article with the static word-vector table."""
    recipe = _tiny_recipe(tmp_path, name, model, shared_data / "flickr8k")
    run = tmp_path / "run"
    rc, stdout, err = _cli("train", recipe, "train.max_steps=2", "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert json.loads(stdout[stdout.index("{"):])["steps"] == 2
    cfg = json.loads((run / "checkpoints" / "step_00000002" / "config.json").read_text(encoding="utf-8"))
    assert cfg["config"]["article_dim"] == 384 and cfg["config"]["article_layers"] == 1
    rc, stdout, err = _cli("evaluate", run, "--split", "test", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    res = json.loads(stdout[stdout.index("{"):])
    assert res["n"] == 5 and "cider" in res["metrics"]  # these rows score each caption against its own caption


def test_table_rejects_bad_input(tmp_path):
    rc, stdout, err = _cli("table", tmp_path / "missing.yaml", "--out", tmp_path / "t")
    assert rc == 1 and "config not found" in err and "failed: config not found" in stdout
    assert json.loads((tmp_path / "t" / "table.json").read_text(encoding="utf-8"))["rows"][0]["error"]
    rc, _, err = _cli("table", F8K / "show_tell.yaml", "--budget", 0, "--out", tmp_path / "t")
    assert rc == 2 and "--budget" in err


@pytest.mark.data
@pytest.mark.slow
def test_seq2seq_trains_and_summarizes_how2(tmp_path, shared_data):
    from tellkit.config import load_yaml
    from tellkit.data.how2 import read_parts
    from tellkit.models.vg_gplm import save_tiny_backbone

    cfg = ROOT / "configs" / "baselines" / "how2" / "tiny_seq2seq.yaml"
    exs = read_parts(shared_data / "how2", load_yaml(cfg)["data"]["train"], with_video=False)
    tok = save_tiny_backbone(tmp_path / "tok", "bart", [e.transcript + " " + e.summary for e in exs])
    run = tmp_path / "run"
    rc, stdout, err = _cli("train", cfg, f"model.backbone={tok}", f"data.root={shared_data / 'how2'}",
                           "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    summary = json.loads(stdout[stdout.index("{"):])
    assert summary["steps"] == 14 and summary["monitor"] == "rouge2"
    rc, stdout, err = _cli("evaluate", run, "--split", "test", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    res = json.loads(stdout[stdout.index("{"):])
    assert res["n"] == 2 and "rouge2" in res["metrics"]
    preds = [json.loads(ln) for ln in Path(res["predictions"]).read_text(encoding="utf-8").splitlines()]
    assert all(isinstance(p["prediction"], str) for p in preds)


@pytest.mark.data
@pytest.mark.slow
def test_hard_attention_paper_row_trains_and_evaluates(tmp_path, shared_data):
    """The Flickr8k hard-attention row (a tiny version of its recipe) through `tellkit train` and
    `tellkit evaluate`; its REINFORCE baseline is saved with the weights."""
    import yaml
    from safetensors.torch import load_file

    papers = ROOT / "configs" / "baselines" / "flickr8k_papers"
    path = tmp_path / "hard.yaml"
    path.write_text(yaml.safe_dump({"base": str(papers / "show_attend_tell_hard.yaml"),
                                    "model": {**TINY_LSTM, "attention_dim": 8}, "encoders": {"image": "mobilenet_v2"},
                                    "data": {**SMALL_DATA, "root": str(shared_data / "flickr8k"),
                                             "features": str(tmp_path / "feat")},
                                    "eval": FAST_EVAL, "train": {"batch_size": 4}}))
    run = tmp_path / "run"
    rc, stdout, err = _cli("train", path, "train.max_steps=3", "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    last = (run / "checkpoints" / "last").resolve()
    state = load_file(last / "model.safetensors")
    assert bool(state["baseline_started"]) and float(state["reward_baseline"]) < 0  # log p(y|s) < 0
    rc, stdout, err = _cli("evaluate", run, "--split", "test", "--no-progress", "--device", "cpu")
    assert rc == 0, err
    res = json.loads(stdout[stdout.index("{"):])
    assert res["n"] == 1 and "cider" in res["metrics"]  # the 5 test captions are one photo's, scored per photo
