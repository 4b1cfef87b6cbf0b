"""VG-BART / VG-T5 on tiny random backbones built here (no weights exist offline): the wrapped
model reproduces the plain HF backbone exactly when fusion is off, fusion changes the output,
padded frames are ignored, a closed forget gate shuts the video out, cached beam-1 generation
equals step-by-step full recomputation (with encoder and decoder fusion), save/load round trip,
and parameter counts (the VTF at d = 2048 within 1% of 100.7M)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tellkit.cli import main as cli_main
from tellkit.errors import TellkitError
from tellkit.models.vg_gplm import VGGPLM, VGGPLMConfig, load_tokenizer, save_tiny_backbone

TEXTS = [
    "hi everybody i 'm john from the martial arts teacher 's association",
    "learn how to peel and chop onions for lentil soup in this free video",
    "use front layers as a guide to cut curly hair",
]


@pytest.fixture(scope="module", params=["bart", "t5"])
def backbone(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return save_tiny_backbone(d, request.param, TEXTS, d_model=16, layers=2, heads=2, ffn=32)


def _batch(backbone, frames=(5, 3), dim=12, seed=0):
    tok = load_tokenizer(backbone)
    enc = tok(TEXTS[:2], padding=True, return_tensors="pt")
    lab = tok(["learn to cut hair", "peel onions"], padding=True, return_tensors="pt")["input_ids"]
    lab[lab == tok.pad_token_id] = -100
    g = torch.Generator().manual_seed(seed)
    m = max(frames)
    mask = torch.tensor([[t < n for t in range(m)] for n in frames])
    video = torch.randn(len(frames), m, dim, generator=g) * mask[..., None]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": lab, "video": video, "video_mask": mask}


def _model(backbone, **kw):
    kw.setdefault("video_dim", 12)
    torch.manual_seed(1)
    m = VGGPLM(VGGPLMConfig(backbone=str(backbone), dropout=0.0, **kw))
    m.load_backbone_weights()
    return m.eval()


def _hf(backbone):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(str(backbone)).eval()


FULL = dict(fusion="multi_head", forget_gate=True, visual_encoder=True, vtf_layers=1, vtf_heads=2, vtf_ffn=16, fusion_heads=2)


@torch.no_grad()
def test_fusion_off_reproduces_backbone_exactly(backbone):
    b = _batch(backbone)
    hf = _hf(backbone)
    dec = hf.prepare_decoder_input_ids_from_labels(labels=b["labels"])
    ref = hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"], decoder_input_ids=dec).logits
    fused = _model(backbone, **FULL)
    fused.fusion_enabled = False
    assert torch.equal(fused(b)["logits"], ref)
    text_only = _model(backbone, fusion="none")
    assert torch.equal(text_only(b)["logits"], ref)
    # and generation: same beams, same tokens
    gen = text_only.generate(b, max_len=8, beam_size=3)
    forced = {} if hf.config.model_type == "t5" else {"forced_bos_token_id": hf.config.bos_token_id}  # BART starts with <s>
    seqs = hf.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"], num_beams=3, max_new_tokens=8,
                       no_repeat_ngram_size=3, early_stopping=True, do_sample=False, **forced)
    fused_off = fused.generate(b, max_len=8, beam_size=3)
    assert gen["tokens"] == fused_off["tokens"]
    tok = load_tokenizer(backbone)
    assert [tok.decode(t) for t in gen["tokens"]] == tok.batch_decode(seqs, skip_special_tokens=True)
    # with fusion on, the same weights give different outputs (the hooks are active)
    fused.fusion_enabled = True
    assert not torch.allclose(fused(b)["logits"], ref)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dot_product", "dot_product_projected", "multi_head"])
def test_padded_frames_are_ignored(backbone, kind):
    m = _model(backbone, fusion=kind, fusion_heads=2, visual_encoder=True, vtf_layers=1, vtf_heads=2, vtf_ffn=16,
               fusion_layers=(0, -1), decoder_fusion_layers=(-1,))
    b = _batch(backbone)
    out = m(b)["logits"]
    b2 = dict(b)
    junk = torch.randn(2, 4, 12) * 100  # 4 extra padded frames full of junk
    b2["video"] = torch.cat([b["video"], junk], 1)
    b2["video_mask"] = torch.cat([b["video_mask"], torch.zeros(2, 4, dtype=torch.bool)], 1)
    torch.testing.assert_close(m(b2)["logits"], out, rtol=1e-5, atol=1e-5)
    b3 = dict(b)  # changing a real frame does change the output
    b3["video"] = b["video"].clone()
    b3["video"][0, 0] += 5.0
    assert not torch.allclose(m(b3)["logits"][0], out[0], atol=1e-4)


@torch.no_grad()
def test_closed_forget_gate_shuts_video_out(backbone):
    m = _model(backbone, fusion="multi_head", forget_gate=True, fusion_heads=2)
    b1, b2 = _batch(backbone, seed=0), _batch(backbone, seed=1)
    assert not torch.allclose(m(b1)["logits"], m(b2)["logits"])  # open gate: video matters
    for blk in m.encoder_fusion.values():
        blk.fusion.gate.proj.weight.zero_()
        blk.fusion.gate.proj.bias.fill_(-1e4)  # sigmoid -> 0
    torch.testing.assert_close(m(b1)["logits"], m(b2)["logits"], rtol=0, atol=0)


@torch.no_grad()
def test_cached_generation_equals_full_recomputation(backbone):
    m = _model(backbone, fusion="dot_product", forget_gate=True, fusion_layers=(-1,), decoder_fusion_layers=(0,))
    b = _batch(backbone)
    out = m.generate(b, max_len=6, beam_size=1, no_repeat_ngram_size=0)
    hf = m.backbone.config
    start = hf.decoder_start_token_id
    forced = None if hf.model_type == "t5" else hf.bos_token_id  # BART: <s> is forced first
    eos = hf.eos_token_id
    # with a forced eos the last of the 6 new tokens is eos whatever the model predicts
    steps = 5 if m.backbone.generation_config.forced_eos_token_id is not None else 6
    for i in range(2):
        one = {k: v[i : i + 1] for k, v in b.items() if k != "labels"}
        ids = [start]
        for step in range(steps):
            one["labels"] = torch.tensor([ids[1:] + [0]])  # decoder input = shift(labels) = ids
            logits = m(one)["logits"][0, -1]
            nxt = forced if (step == 0 and forced is not None) else int(logits.argmax())
            ids.append(nxt)
            if nxt == eos:
                break
        manual = [t for t in ids[1:] if t not in (eos, hf.pad_token_id, getattr(hf, "bos_token_id", None))]
        assert out["tokens"][i] == manual


def test_save_load_round_trip(backbone, tmp_path):
    m = _model(backbone, **FULL)
    b = _batch(backbone)
    with torch.no_grad():
        ref = m(b)["logits"]
    m.save_pretrained(tmp_path / "ckpt", tokenizer=load_tokenizer(backbone))
    import tellkit

    m2 = tellkit.load_model(tmp_path / "ckpt").eval()
    assert isinstance(m2, VGGPLM) and m2.config.backbone_config == m.config.backbone_config
    with torch.no_grad():
        assert torch.equal(m2(b)["logits"], ref)
    assert load_tokenizer("/nonexistent", tmp_path / "ckpt")("learn to cut hair")["input_ids"]


def test_loss_is_mean_over_target_tokens(backbone):
    m = _model(backbone, fusion="none")
    b = _batch(backbone)
    out = m(b)
    lab = b["labels"]
    logp = out["logits"].log_softmax(-1)
    valid = lab != -100
    nll = -logp.gather(-1, lab.clamp(min=0)[..., None])[..., 0][valid]
    assert int(out["ntokens"]) == int(valid.sum())
    torch.testing.assert_close(out["loss"], nll.mean())


def test_bad_input_and_config(backbone):
    m = _model(backbone, fusion="dot_product")
    b = _batch(backbone)
    del b["video"]
    with pytest.raises(TellkitError, match="video"):
        m(b)
    with pytest.raises(TellkitError):
        VGGPLMConfig(fusion="nope")
    with pytest.raises(TellkitError, match="out of range"):
        VGGPLM(VGGPLMConfig(backbone=str(backbone), fusion_layers=(7,)))
    with pytest.raises(TellkitError):
        VGGPLM(VGGPLMConfig(backbone="/no/such/folder/or/hub/name"))


def _model_info(*args):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["model-info", *args]) == 0
    return json.loads(buf.getvalue())


def test_model_info_counts(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = _model_info("vg_gplm", "visual_encoder=true", "forget_gate=true")
    vtf = info["breakdown"]["visual_encoder"]
    assert abs(vtf - 100.7e6) / 100.7e6 < 0.01
    # independent count: 4 post-norm layers, d=2048, FFN 2048: attention 4(d^2+d), FFN 2(2048 d)+2048+d, 2 LayerNorms
    d = 2048
    assert vtf == 4 * (4 * (d * d + d) + (d * 2048 + 2048) + (2048 * d + d) + 4 * d)
    assert info["breakdown"]["backbone"] == 139_420_416  # BART-base, 139.4M
    assert info["breakdown"]["add_on"] == info["total_params"] - info["breakdown"]["backbone"]
    base = _model_info("vg_gplm", "fusion=none")
    assert base["breakdown"]["add_on"] == 0 and base["total_params"] == 139_420_416


def test_video_information_reaches_the_summary(tmp_path):
    """Synthetic task whose summary word depends only on the video: the fused model learns it,
    the text-only baseline (same backbone, same data) cannot beat chance."""
    colours = ["red", "green", "blue", "yellow"]
    bb = save_tiny_backbone(tmp_path / "bb", "bart", ["the same words every time", *colours], d_model=32, layers=1, heads=2, ffn=64)
    tok = load_tokenizer(bb)
    g = torch.Generator().manual_seed(0)
    n = 48
    cls = torch.arange(n) % len(colours)
    video = torch.randn(n, 6, 12, generator=g) * 0.1
    video[torch.arange(n), :, cls] += 1.0  # the colour is visible in every frame
    enc = tok(["the same words every time"] * n, return_tensors="pt")
    labels = tok([colours[int(c)] for c in cls], return_tensors="pt")["input_ids"]
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels,
             "video": video, "video_mask": torch.ones(n, 6, dtype=torch.bool)}

    def train_and_decode(**kw):
        m = _model(bb, **kw).train()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        torch.manual_seed(0)
        for _ in range(60):
            opt.zero_grad()
            m(batch)["loss"].backward()
            opt.step()
        m.eval()
        out = m.generate(batch, max_len=3, beam_size=1, no_repeat_ngram_size=0)
        words = [tok.decode(t, skip_special_tokens=True).strip() for t in out["tokens"]]
        return sum(w == colours[int(c)] for w, c in zip(words, cls)) / n

    assert train_and_decode(fusion="multi_head", forget_gate=True, fusion_heads=2) >= 0.95
    assert train_and_decode(fusion="none") <= 0.5
