"""The summarization pipeline (``tellkit.pipelines.summarization.SummarizationPipeline``) on a
tiny random VG-BART checkpoint written here: stored data / eval settings are honoured, the summary
equals the model's own generate on the same tensors and the task's prediction (``tellkit
evaluate``), ``tellkit summarize`` and ``tellkit.pipeline("summarize")`` print the same, bad input
is a one-line error."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from tellkit.cli import main as cli_main
from tellkit.errors import TellkitError
from tellkit.models.vg_gplm import VGGPLM, VGGPLMConfig, load_tokenizer, save_tiny_backbone
from tellkit.pipelines.summarization import SummarizationPipeline

TEXTS = ["learn how to peel and chop onions for lentil soup in this free video",
         "use front layers as a guide to cut curly hair"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("vgpipe")
    bb = save_tiny_backbone(d / "bb", "bart", TEXTS, d_model=16, layers=2, heads=2, ffn=32)
    torch.manual_seed(0)
    model = VGGPLM(VGGPLMConfig(backbone=str(bb), fusion="dot_product", forget_gate=True, video_dim=12, dropout=0.0))
    model.load_backbone_weights()
    extra = {"task": "summarize",
             "data": {"max_frames": 4, "max_source_tokens": 9, "source_prefix": "learn "},
             "eval": {"beam_size": 2, "max_len": 5, "no_repeat_ngram_size": 0, "batch_size": 3, "metrics": ["rouge"]}}
    return model.save_pretrained(d / "ckpt", extra=extra, tokenizer=load_tokenizer(bb))


def test_pipeline_uses_the_stored_settings(ckpt):
    s = SummarizationPipeline.load(ckpt)
    assert s.uses_video and s.generation.beam_size == 2 and s.generation.max_len == 5
    video = np.random.default_rng(0).standard_normal((7, 12)).astype(np.float32)
    out = s({"transcript": TEXTS[1], "features": video})
    assert out["frames"] == 4 and not out["video_ignored"]
    # by hand: prefix + transcript cut to 9 tokens, the first 4 frames, beam 2, 5 new tokens
    tok = s.processor.tokenizer
    ids = tok("learn " + TEXTS[1], max_length=9, truncation=True)["input_ids"]
    assert len(ids) == 9
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, 9, dtype=torch.long),
             "video": torch.from_numpy(video[:4])[None], "video_mask": torch.ones(1, 4, dtype=torch.bool)}
    gen = s.model.generate(batch, beam_size=2, max_len=5, no_repeat_ngram_size=0)
    assert out["text"] == tok.decode(gen["tokens"][0], skip_special_tokens=True).strip()
    assert 1 <= len(tok(out["text"])["input_ids"]) <= 5 + 2
    # the task's prediction (what `tellkit evaluate` writes) on the processor's batch is the same
    from tellkit.tasks import make_task
    from tellkit.workflows import checkpoint_recipe

    task = make_task(checkpoint_recipe(ckpt))
    batch = s.processor.collate([s.processor.prepare((TEXTS[1], video))])
    assert task.predict(s.model, batch)[0]["prediction"] == out["text"]
    # overrides of the stored decoding settings
    assert SummarizationPipeline.load(ckpt, beam_size=1, max_len=None).generation.beam_size == 1
    with pytest.raises(TellkitError):
        SummarizationPipeline.load(ckpt, beam_size=0)


def test_pipeline_bad_input(ckpt, tmp_path):
    s = SummarizationPipeline.load(ckpt)
    with pytest.raises(TellkitError, match="fuses video"):
        s(TEXTS[0])
    with pytest.raises(TellkitError, match="shape"):
        s((TEXTS[0], np.zeros((3, 5), dtype=np.float32)))
    with pytest.raises(TellkitError, match="empty"):
        s({"transcript": "  ", "features": np.zeros((3, 12), dtype=np.float32)})
    with pytest.raises(TellkitError, match="unknown: video"):
        s({"transcript": TEXTS[0], "video": np.zeros((3, 12), dtype=np.float32)})
    with pytest.raises(TellkitError):
        SummarizationPipeline.load(tmp_path / "missing")
    with pytest.raises(TellkitError, match="no packaged default model for 'summarize'"):
        SummarizationPipeline.load()


def test_summarize_cli_prints_the_pipeline_summary(ckpt, tmp_path):
    video = np.random.default_rng(1).standard_normal((3, 12)).astype(np.float32)
    np.save(tmp_path / "v.npy", video)
    (tmp_path / "t.txt").write_text(TEXTS[0] + "\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["summarize", str(tmp_path / "t.txt"), "--features", str(tmp_path / "v.npy"),
                       "--model", str(ckpt), "--json"])
    assert rc == 0
    res = json.loads(buf.getvalue())
    want = SummarizationPipeline.load(ckpt)({"transcript": TEXTS[0], "features": video})["text"]
    assert res["text"] == want and res["frames"] == 3
    import tellkit

    # a transcript file and the <name>.npy beside it, through the public API
    np.save(tmp_path / "t.npy", video)
    assert tellkit.pipeline("summarize", ckpt)(tmp_path / "t.txt")["text"] == want
    (tmp_path / "t.npy").unlink()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli_main(["summarize", "--transcript", str(tmp_path / "t.txt"), "--checkpoint", str(ckpt)]) == 2


@pytest.mark.parametrize("special", [True, False])
def test_the_source_is_built_as_training_built_it(ckpt, special, monkeypatch):
    """``data.source_special_tokens: false`` (the reference's data builder: no <s> / </s> around
    the transcript) holds at inference too."""
    s = SummarizationPipeline.load(ckpt)
    s.processor.data.source_special_tokens = special
    seen = {}

    def fake_generate(batch, **kw):
        seen["ids"] = batch["input_ids"][0].tolist()
        return {"tokens": [[0, 2]]}

    monkeypatch.setattr(s.model, "generate", fake_generate)
    s((TEXTS[0], np.zeros((2, 12), np.float32)))
    tok = s.processor.tokenizer
    plain = {} if special else {"add_special_tokens": False}
    assert seen["ids"] == tok("learn " + TEXTS[0], max_length=9, truncation=True, **plain)["input_ids"]
    assert (seen["ids"][0] == tok.bos_token_id) == special
