"""How2 loaders: both on-disk layouts (real samples in ../shared/data/how2 and small fixtures
written here), feature truncation/padding with masks, transcript truncation, collation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tellkit.data.how2 import How2Dataset, collate_how2, load_features, pad_video, read_part, read_parts
from tellkit.errors import TellkitError


class WordTok:
    """Whitespace tokenizer stand-in: ids are word lengths + 3, then an end id 2."""

    def __call__(self, text, max_length=None, truncation=False):
        ids = [len(w) + 3 for w in text.split()] + [2]
        if truncation and max_length is not None:
            ids = ids[: max_length - 1] + [2] if len(ids) > max_length else ids
        return {"input_ids": ids}


def _write_demo(tmp_path, n_frames=(3, 300)):
    d = tmp_path / "demo"
    (d / "video_action_features").mkdir(parents=True)
    ids = [f"vid{i}" for i in range(len(n_frames))]
    (d / "train_art_en.txt").write_text("\n".join(f"transcript number {i} here" for i in range(len(ids))) + "\n")
    (d / "train_sum.txt").write_text("\n".join(f"summary {i}" for i in range(len(ids))))
    (d / "train_action.txt").write_text("\n".join(ids))
    for vid, t in zip(ids, n_frames):
        np.save(d / "video_action_features" / f"{vid}.npy", np.full((t, 8), float(t), dtype=np.float32))
    return d


def test_demo_layout_fixture_and_padding(tmp_path):
    _write_demo(tmp_path)
    exs = read_part(tmp_path, "demo:train")
    assert [e.id for e in exs] == ["vid0", "vid1"]
    assert exs[1].transcript == "transcript number 1 here" and exs[1].summary == "summary 1"
    ds = How2Dataset(exs, WordTok(), max_source_tokens=3, max_frames=256, video_dim=8)
    items = [ds[0], ds[1]]
    assert len(items[0]["input_ids"]) == 3 and items[0]["input_ids"][-1] == 2  # truncated, ends with eos
    assert items[1]["video"].shape == (256, 8)  # 300 frames truncated to 256
    batch = collate_how2(items, pad_id=1, video_dim=8, frames=256)
    assert batch["video"].shape == (2, 256, 8)
    assert batch["video_mask"][0].sum() == 3 and batch["video_mask"][1].all()
    assert torch.all(batch["video"][0, 3:] == 0) and torch.all(batch["video"][0, :3] == 3.0)
    assert batch["labels"].shape == (2, 3) and batch["ids"] == ["vid0", "vid1"]


def test_official_layout_fixture(tmp_path):
    d = tmp_path / "how2"
    (d / "text" / "sum_cv").mkdir(parents=True)
    (d / "video_action_features").mkdir()
    (d / "text" / "sum_cv" / "cv_tran_text.txt").write_text("a b c\nd e\n")
    (d / "text" / "sum_cv" / "cv_desc_text.txt").write_text("s1\ns2\n")
    (d / "text" / "sum_cv" / "cv_action.txt").write_text(
        "../how2data/video_action_features/X1.npy\n../how2data/video_action_features/X2.npy\n"
    )
    for v in ("X1", "X2"):
        np.save(d / "video_action_features" / f"{v}.npy", np.zeros((5, 4), np.float32))
    exs = read_part(d, "sum_cv")
    assert [(e.id, e.transcript, e.summary) for e in exs] == [("X1", "a b c", "s1"), ("X2", "d e", "s2")]
    assert exs[0].features == d / "video_action_features" / "X1.npy"


def test_errors(tmp_path):
    d = _write_demo(tmp_path)
    with pytest.raises(TellkitError, match="neither"):
        read_part(tmp_path, "demo:nosuch")
    (d / "train_sum.txt").write_text("only one line")
    with pytest.raises(TellkitError, match="line counts"):
        read_part(tmp_path, "demo:train")
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((0, 4), np.float32))
    with pytest.raises(TellkitError):
        load_features(bad)
    with pytest.raises(TellkitError, match="not found"):
        load_features(tmp_path / "missing.npy")


def test_pad_video_batch_max():
    v, m = pad_video([np.ones((2, 3), np.float32), np.ones((5, 3), np.float32)], 3)
    assert v.shape == (2, 5, 3) and m.sum(1).tolist() == [2, 5]


@pytest.mark.data
def test_real_how2_both_layouts(shared_data):
    root = shared_data / "how2"
    demo = read_parts(root, ["mcls_demo:pretrain", "mcls_demo:train", "mcls_demo:val", "mcls_demo:test"])
    parts = ("sum_train", "sum_cv", "sum_devtest", "sum_asr_train", "sum_asr_cv", "sum_asr_devtest")
    official = read_parts(root, [f"mfn_sample:{p}" for p in parts])
    assert len(demo) == 18 and len(official) == 12
    everything = read_parts(root, [*(f"mcls_demo:{p}" for p in ("pretrain", "train", "val", "test")),
                                   *(f"mfn_sample:{p}" for p in parts)])
    assert len(everything) == 28  # two videos appear in both layouts
    for ex in everything:
        assert ex.features is not None and ex.features.is_file()
        assert ex.transcript and ex.summary
        f = load_features(ex.features, 256, 2048)
        assert f.dtype == np.float32 and f.shape[1] == 2048 and 1 <= f.shape[0] <= 256
    long = next(e for e in everything if e.id == "SCj-GsrzJ7o")  # 441 frames on disk
    assert load_features(long.features).shape == (256, 2048)
