"""The captioning task end to end on the GoodNews fixture with a tiny Transform and Tell and fake
encoders (random but fixed features of the tiny config's sizes): cache, train, evaluate."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tellkit.config import deep_merge, load_yaml
from tellkit.tasks.captioning import CaptioningTask, Featurizer, collate_captions
from tellkit.training import train

FIX = Path(__file__).parent / "fixtures"


class FakeFeaturizer(Featurizer):
    """Sizes of configs/tat/tiny.yaml; values fixed by a hash of the input."""

    calls = 0

    def images(self, pils):
        FakeFeaturizer.calls += 1
        return torch.stack([torch.full((5, 16), float(sum(p.getpixel((0, 0)))) / 765) for p in pils])

    def faces(self, pil):
        return {"embeddings": torch.ones(1, 8), "boxes": torch.zeros(1, 4), "probs": torch.ones(1)}

    def context_text(self, sample, mode):
        return " ".join(([sample.title] if sample.title else []) + sample.paragraphs)[:60]

    def articles(self, texts):
        out = []
        for t in texts:
            n = len(t.split())
            g = torch.Generator().manual_seed(len(t))
            out.append({"hidden": torch.randn(3, n, 24, generator=g), "ids": torch.arange(n) + 100, "tokens": t.split()})
        return out


def recipe(tmp_path, **train):
    r = load_yaml("tat/tiny")
    return deep_merge(r, {
        "data": {"format": "goodnews", "root": str(FIX / "goodnews"), "context": "first_tokens", "features": str(tmp_path / "feats")},
        "train": {"max_steps": 4, "max_epochs": 10, "lr": 1e-3, "log_every": 1, **train},
        "eval": {"metrics": ["bleu", "rouge", "cider"], "ner": False, "max_len": 6},
    })


def test_feature_cache_and_collate(tmp_path):
    task = CaptioningTask(recipe(tmp_path), featurizer=FakeFeaturizer(None, ("image", "article", "faces")))
    ds = task.build_dataset("train")
    calls = FakeFeaturizer.calls
    assert (tmp_path / "feats" / "train.safetensors").is_file()
    again = task.build_dataset("train")  # read from the cache, no encoder call
    assert FakeFeaturizer.calls == calls and len(again) == 1
    item = ds[0]
    assert item["caption"][0] == 0 and item["caption"][-1] == 2  # <s> ... </s>
    assert task.tokenizer.decode(item["caption"][1:-1].tolist()) == "Mayor Jane Doe cuts the ribbon in Albany on Monday."
    b = collate_captions([item, {**item, "faces": torch.zeros(0, 8), "caption": item["caption"][:3]}], task.contexts)
    assert b["caption"].shape == (2, len(item["caption"])) and b["caption"][1, 3:].eq(1).all()
    assert b["faces_mask"].tolist() == [[True], [False]] and b["article"].shape[:2] == (2, 3)
    assert b["image"].dtype == torch.float32 and b["article_ids"].min() >= -1
    other = recipe(tmp_path)
    other["data"]["context"] = "location_aware"
    with pytest.raises(Exception, match="other settings"):
        CaptioningTask(other, featurizer=FakeFeaturizer(None, ())).build_dataset("train")


def test_train_then_evaluate_through_the_cli(tmp_path, capsys):
    r = recipe(tmp_path, max_tokens=None)
    task = CaptioningTask(r, featurizer=FakeFeaturizer(None, ("image", "article", "faces")))
    s = train(r, tmp_path / "run", task=task, progress=False)
    assert s["steps"] == 4 and s["best"] is not None
    task.build_dataset("test")  # cache the test split with the fake encoders
    from tellkit.cli import main

    assert main(["evaluate", str(tmp_path / "run"), "--data", str(FIX / "goodnews"), "--split", "test", "--no-progress"]) == 0
    out = tmp_path / "run" / "eval"
    summary = json.loads((out / "metrics_test.json").read_text())
    assert summary["n"] == 1 and {"bleu4", "rouge_l", "cider", "length", "ttr", "flesch", "loss"} <= set(summary["metrics"])
    row = json.loads((out / "predictions_test.jsonl").read_text())
    assert row["id"] == "5a1b2c_1" and row["references"] == ["The new bridge at dusk."] and "cider" in row["scores"]
    assert isinstance(row["prediction"], str)
