"""VG-BART / VG-T5 on tiny random backbones built here (no weights exist offline): the wrapped
model reproduces the plain HF backbone exactly when fusion is off, fusion changes the output,
padded frames are ignored, a closed forget gate shuts the video out, cached beam-1 generation
equals step-by-step full recomputation (with encoder and decoder fusion), save/load round trip,
and parameter counts (the VTF at d = 2048 within 1% of 100.7M)."""
from __future__ import annotations

import contextlib
import io
import json
import math

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
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": lab, "video": video,
            "video_mask": mask}


def _model(backbone, **kw):
    kw.setdefault("video_dim", 12)
    torch.manual_seed(1)
    m = VGGPLM(VGGPLMConfig(backbone=str(backbone), dropout=0.0, **kw))
    m.load_backbone_weights()
    return m.eval()


def _hf(backbone):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(str(backbone)).eval()


FULL = dict(fusion="multi_head", forget_gate=True, visual_encoder=True, vtf_layers=1, vtf_heads=2, vtf_ffn=16,
            fusion_heads=2, fusion_dim=8)


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
    # BART starts with <s>
    forced = {} if hf.config.model_type == "t5" else {"forced_bos_token_id": hf.config.bos_token_id}
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
    # independent count: 4 post-norm layers, d=2048, FFN 2048: attention 4(d^2+d), FFN 2(2048 d)+2048+d, 2 LayerNorms
    d = 2048
    assert vtf == 4 * (4 * (d * d + d) + (d * 2048 + 2048) + (2048 * d + d) + 4 * d) == 100_745_216
    assert info["breakdown"]["backbone"] == 139_420_416  # BART-base, 139.4M
    added = info["trainable_params"] - info["breakdown"]["backbone"]
    assert added == vtf + info["breakdown"]["encoder_fusion"] + info["breakdown"]["decoder_fusion"]
    base = _model_info("vg_gplm", "fusion=none")
    assert base["breakdown"]["backbone"] == base["total_params"] == 139_420_416


def _lin(i, o):
    return i * o + o


@pytest.mark.parametrize(
    "recipe, fusion, vtf",
    [
        # dot-product + forget gate: W1 (2048->768), W2 (768+2048->768), Wf (2048+768->2048), LayerNorm
        ("how2_bart.yaml", _lin(2048, 768) + _lin(2816, 768) + _lin(2816, 2048) + 2 * 768, 100_745_216),
        # multi-head, d_c 256, one head, gate over d_c: K, V, Q linears, attention (in + out), W3, Wf, LayerNorm
        ("how2_bart_multihead.yaml",
         2 * _lin(2048, 256) + _lin(768, 256) + 3 * _lin(256, 256) + _lin(256, 256) + _lin(1024, 768)
         + _lin(1024, 256) + 2 * 768, 0),
        ("how2_bart_dot_product.yaml", _lin(2048, 768) + _lin(2816, 768) + 2 * 768, 0),
        ("how2_t5.yaml", 9_507_840, 100_745_216),
    ],
)
def test_recipe_parameter_breakdown(monkeypatch, recipe, fusion, vtf):
    """`tellkit model-info` on the meta device: the reference's module sizes, recipe by recipe."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from pathlib import Path

    info = _model_info(str(Path(__file__).resolve().parents[1] / "configs" / "vg" / recipe))
    assert info["breakdown"]["encoder_fusion"] == fusion
    assert info["breakdown"]["visual_encoder"] == vtf
    if recipe == "how2_bart.yaml":
        assert fusion == 9_507_840
    if recipe == "how2_bart_multihead.yaml":
        assert fusion == 2_560_256


def test_boosted_parameters_are_the_references(backbone):
    """x lr only for fusion linears, attention and forget gate: not the fusion LayerNorm, not the VTF."""
    from tellkit.tasks.summarization import SummarizationTask

    m = _model(backbone, **FULL)
    boosted = {id(p) for p in m.boosted_parameters()}
    names = {n for n, p in m.named_parameters() if id(p) in boosted}
    assert names and all(n.startswith("encoder_fusion.") and ".norm." not in n for n in names)
    assert {n for n in names if ".gate." in n} and {n for n in names if ".attention." in n}
    assert not {n for n, _ in m.named_parameters() if n.startswith("visual_encoder.")} & names
    recipe = {"task": "summarize", "model": {"name": "vg_gplm", "backbone": str(backbone), **FULL}}
    groups = SummarizationTask(recipe).param_groups(m, 1e-3)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(5e-3)]
    assert {id(p) for p in groups[1]["params"]} == boosted
    assert sum(p.numel() for g in groups for p in g["params"]) == m.num_parameters()


def test_visual_transformer_scales_input_before_positions():
    from tellkit.models.vg_gplm import VisualTransformerEncoder, interleaved_sinusoids

    vtf = VisualTransformerEncoder(8, layers=0, heads=2, ffn=8, dropout=0.0)
    x = torch.randn(2, 5, 8)
    out = vtf(x, torch.ones(2, 5, dtype=torch.bool))
    pos = interleaved_sinusoids(5, 8)
    assert pos[1, 0] == pytest.approx(math.sin(1.0)) and pos[1, 1] == pytest.approx(math.cos(1.0))
    assert pos[3, 2] == pytest.approx(math.sin(3 * 10000 ** (-2 / 8)))
    torch.testing.assert_close(out, x * math.sqrt(8) + pos)


def test_fusion_block_residual_and_norm():
    from tellkit.layers.fusion import FusionBlock

    torch.manual_seed(0)
    blk = FusionBlock("multi_head", 8, 6, d_common=4, heads=1, dropout=0.0, forget_gate=True).eval()
    text, video = torch.randn(2, 5, 8), torch.randn(2, 3, 6)
    torch.testing.assert_close(blk(text, video), blk.norm(text + blk.fusion(text, video)))
    assert blk.norm.eps == 1e-5 and blk.fusion.attention.dropout == 0.0 and blk.fusion.attention.num_heads == 1


@torch.no_grad()
def test_multi_head_fusion_equals_a_restatement_of_the_reference():
    """cross_attn_type 4 written out as the reference computes it (sequence-first attention,
    no mask, gate over d_c, W4 over [Z_t ; O]) with tellkit's weights: the same numbers."""
    from torch.nn import functional as F

    from tellkit.layers.fusion import MultiHeadFusion

    torch.manual_seed(0)
    f = MultiHeadFusion(8, 6, 4, heads=2, dropout=0.0, forget_gate=True).eval()
    text, video = torch.randn(2, 5, 8), torch.randn(2, 3, 6)
    mha = torch.nn.MultiheadAttention(4, 2)  # the reference's module, sequence-first
    mha.load_state_dict(f.attention.state_dict())
    k = F.linear(video, f.k.weight, f.k.bias).transpose(0, 1)
    v = F.linear(video, f.v.weight, f.v.bias).transpose(0, 1)
    q = F.linear(text, f.q.weight, f.q.bias).transpose(0, 1)
    o = mha(q, k, v)[0].transpose(0, 1)
    o = torch.sigmoid(f.gate.proj(torch.cat([o, text], 2))) * o
    torch.testing.assert_close(f(text, video, torch.ones(2, 3, dtype=torch.bool)), f.out(torch.cat([text, o], 2)))


def test_forget_gate_dropout():
    from tellkit.layers.fusion import ForgetGate

    torch.manual_seed(0)
    gate = ForgetGate(6, 4, dropout=0.5)
    ctx, text = torch.randn(3, 7, 6), torch.randn(3, 7, 4)
    assert bool((gate.train()(ctx, text) == 0).any())  # some gate entries dropped in training
    expected = torch.sigmoid(gate.proj(torch.cat([ctx, text], -1))) * ctx
    torch.testing.assert_close(gate.eval()(ctx, text), expected)


def test_dot_product_softmax_over_text_is_the_references():
    from tellkit.layers.fusion import DotProductFusion

    torch.manual_seed(0)
    f = DotProductFusion(4, 6, softmax_over="text")
    text, video = torch.randn(2, 5, 4), torch.randn(2, 3, 6)
    attn = (text @ f.video_proj(video).transpose(1, 2)).softmax(1)  # over the 5 text positions
    torch.testing.assert_close(f(text, video), f.out(torch.cat([text, attn @ video], -1)))
    g = DotProductFusion(4, 6)  # the paper / tellkit: over frames
    g.load_state_dict(f.state_dict())
    attn = (text @ g.video_proj(video).transpose(1, 2)).softmax(-1)
    torch.testing.assert_close(g(text, video), g.out(torch.cat([text, attn @ video], -1)))


@torch.no_grad()
@pytest.mark.parametrize("point", ["final_norm", "block"])
def test_t5_fusion_point(tmp_path, point):
    """VG-T5 fuses after the encoder's final LayerNorm (the reference) or after the last block."""
    bb = save_tiny_backbone(tmp_path / "t5", "t5", TEXTS, d_model=16, layers=2, heads=2, ffn=32)
    m = _model(bb, fusion="dot_product", t5_fusion_point=point)
    seen = {}
    block = m.encoder_fusion["1"]
    block.register_forward_pre_hook(lambda mod, args: seen.update(fusion_input=args[0].clone()))
    enc = m.backbone.get_encoder()
    enc.block[-1].register_forward_hook(lambda mod, a, out: seen.update(last_block=out[0].clone()))
    b = _batch(bb)
    m(b)
    m.fusion_enabled = False
    plain = enc(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    if point == "final_norm":
        torch.testing.assert_close(seen["fusion_input"], plain)
    else:
        torch.testing.assert_close(seen["fusion_input"], seen["last_block"])
        assert not torch.allclose(seen["fusion_input"], plain)


def test_video_information_reaches_the_summary(tmp_path):
    """Synthetic task whose summary word depends only on the video: the fused model learns it,
    the text-only baseline (same backbone, same data) cannot beat chance."""
    colours = ["red", "green", "blue", "yellow"]
    bb = save_tiny_backbone(tmp_path / "bb", "bart", ["the same words every time", *colours], d_model=32, layers=1,
                            heads=2, ffn=64)
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
        for _ in range(100):
            opt.zero_grad()
            m(batch)["loss"].backward()
            opt.step()
        m.eval()
        out = m.generate(batch, max_len=3, beam_size=1, no_repeat_ngram_size=0)
        words = [tok.decode(t, skip_special_tokens=True).strip() for t in out["tokens"]]
        return sum(w == colours[int(c)] for w, c in zip(words, cls)) / n

    assert train_and_decode(fusion="multi_head", forget_gate=True, fusion_heads=2, fusion_dim=32) >= 0.95
    assert train_and_decode(fusion="none") <= 0.5
