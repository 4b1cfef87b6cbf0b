"""VG-BART / VG-T5 end to end through the real command line: a tiny random backbone (built here,
no weights exist offline) is fine-tuned for a few steps on the 28 real How2 samples with
`tellkit train`, evaluated with `tellkit evaluate`, and summarizes one video with
`tellkit summarize`. Plus: every configs/vg recipe parses, and the new layers get the higher lr."""
from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest
import torch

from tellkit.cli import main as cli_main
from tellkit.config import load_yaml
from tellkit.data.how2 import read_parts
from tellkit.models.vg_gplm import save_tiny_backbone
from tellkit.recipes import train_config
from tellkit.tasks.summarization import SummarizationTask

ROOT = Path(__file__).resolve().parents[1]
VG = ROOT / "configs" / "vg"


def _cli(*argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main([str(a) for a in argv])
    return rc, buf.getvalue()


def _tiny(tmp_path, kind, shared_data):
    recipe = load_yaml(VG / f"tiny_{kind}.yaml")
    exs = read_parts(shared_data / "how2", recipe["data"]["train"], with_video=False)
    assert len(exs) == 28
    return save_tiny_backbone(tmp_path / f"tiny_{kind}", kind, [e.transcript + " " + e.summary for e in exs])


@pytest.mark.parametrize("path", sorted(VG.glob("*.yaml")), ids=lambda p: p.name)
def test_recipes_parse(path):
    recipe = load_yaml(path)
    assert recipe["task"] == "summarize" and recipe["model"]["name"] == "vg_gplm"
    task = SummarizationTask(recipe)  # validates data / eval sections and the model config
    tc = train_config(recipe)
    assert task.monitor == "rouge2" and task.monitor_mode == "max"
    assert task.data.root is None and "shared" not in path.read_text()  # the data location is the user's
    if not path.name.startswith("tiny"):
        assert not set(recipe["data"]["test"]) & set(recipe["data"]["val"])
        assert not set(recipe["data"]["test"]) & set(recipe["data"]["train"])  # never train on the test split
        assert tc.clip_norm == 1.0 and tc.lr == 3e-5 and task.model_config.new_layer_lr_scale == 5.0
        assert task.eval.generation.kwargs() == {"beam_size": 5, "max_len": 64, "min_len": 0,
                                                   "no_repeat_ngram_size": 3, "length_penalty": 1.0}


def test_typed_sections_reject_unknown_keys_and_need_a_root():
    from tellkit.errors import TellkitError

    recipe = load_yaml(VG / "how2_bart_text.yaml")
    for section, key in (("data", "roots"), ("eval", "beams")):
        bad = {**recipe, section: {**recipe[section], key: 1}}
        with pytest.raises(TellkitError, match=key):
            SummarizationTask(bad)
    with pytest.raises(TellkitError, match="min_len"):
        SummarizationTask({**recipe, "eval": {**recipe["eval"], "min_len": 99}})
    with pytest.raises(TellkitError, match="data.root is not set"):
        SummarizationTask(recipe).build_dataset("train")


@pytest.mark.data
def test_new_layers_get_higher_lr(tmp_path, shared_data):
    bb = _tiny(tmp_path, "bart", shared_data)
    recipe = load_yaml(VG / "tiny_bart.yaml")
    recipe["model"]["backbone"] = str(bb)
    task = SummarizationTask(recipe)
    model = task.build_model()
    groups = task.param_groups(model, 1e-3)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(5e-3)]
    # the reference boosts the fusion linears, attention and gate, not the fusion LayerNorm
    new = {id(p) for n, p in model.named_parameters() if "fusion" in n and ".norm." not in n}
    assert {id(p) for p in groups[1]["params"]} == new
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_parameters()
    # the backbone weights were loaded from the folder, not left at random init
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(str(bb))
    assert torch.equal(model.backbone.lm_head.weight, hf.lm_head.weight)


@pytest.mark.data
@pytest.mark.slow
def test_train_evaluate_summarize_bart(tmp_path, shared_data):
    bb = _tiny(tmp_path, "bart", shared_data)
    run = tmp_path / "run"
    root = shared_data / "how2"
    rc, out = _cli("train", VG / "tiny_bart.yaml", f"model.backbone={bb}", f"data.root={root}",
                   "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 8 and summary["monitor"] == "rouge2"
    with open(run / "train_log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == 8 and losses[-1] < losses[0]  # it learns

    # one sample per batch, video padded to its own length: the same tensors `summarize` builds
    rc, out = _cli("evaluate", run, "data.pad_frames=false", "--split", "test", "--batch-size", "1",
                   "--out", tmp_path / "eval", "--no-progress", "--device", "cpu")
    assert rc == 0
    metrics = json.loads((tmp_path / "eval" / "metrics_test.json").read_text())["metrics"]
    assert {"rouge1", "rouge2", "rougeL", "rouge_score.rouge1"} <= set(metrics)
    preds = [json.loads(line) for line in (tmp_path / "eval" / "predictions_test.jsonl").read_text().splitlines()]
    test_set = read_parts(root, ["mcls_demo:test"])
    assert [p["id"] for p in preds] == [e.id for e in test_set]

    ex = test_set[0]
    transcript = tmp_path / "transcript.txt"
    transcript.write_text(ex.transcript + "\n")
    rc, out = _cli("summarize", transcript, "--features", ex.features, "--model", run, "--json")
    assert rc == 0
    result = json.loads(out.strip().splitlines()[-1])
    words = result["text"].split()
    assert words and result["frames"] == 173
    vocab = set(json.loads((bb / "tokenizer.json").read_text())["model"]["vocab"])
    assert set(words) <= vocab
    # same checkpoint (best), same decoding settings (the recipe's eval section): same summary
    assert result["text"] == preds[0]["prediction"]
    # bad input is one line and exit 2
    assert _cli("summarize", "--transcript", transcript, "--checkpoint", run)[0] == 2
    missing = tmp_path / "missing.txt"
    assert _cli("summarize", "--transcript", missing, "--features", ex.features, "--checkpoint", run)[0] == 2


@pytest.mark.data
@pytest.mark.slow
def test_train_t5_through_cli(tmp_path, shared_data):
    bb = _tiny(tmp_path, "t5", shared_data)
    run = tmp_path / "run"
    rc, out = _cli("train", VG / "tiny_t5.yaml", f"model.backbone={bb}", f"data.root={shared_data / 'how2'}",
                   "train.max_epochs=1", "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 4 and summary["best_checkpoint"]
    ex = read_parts(shared_data / "how2", ["mfn_sample:sum_devtest"])[1]
    (tmp_path / "t.txt").write_text(ex.transcript)
    rc, out = _cli("summarize", "--transcript", tmp_path / "t.txt", "--features", ex.features, "--checkpoint", run,
                   "--beam-size", "5", "--max-len", "12")
    assert rc == 0 and 1 <= len(out.split()) <= 12


def test_summarize_without_checkpoint_explains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("some words")
    rc, _ = _cli("summarize", "--transcript", tmp_path / "t.txt")
    assert rc == 2
