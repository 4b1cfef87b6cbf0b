"""VG-BART / VG-T5 paper recipes as the reference (HLTCHKUST/VG-GPLMs) runs them: each test
re-states the reference's few lines (modeling_bart.py / modeling_t5.py fusion and init,
img_transformer.py, data_builder.py collate_fn, base_model.py configure_optimizers, the scripts'
arguments) and checks tellkit's switch against it; the labelled tellkit recipe keeps its own choices."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tellkit.config import load_yaml
from tellkit.layers.fusion import FusionBlock
from tellkit.models.vg_gplm import VGGPLM, VGGPLMConfig, load_tokenizer, save_tiny_backbone
from tellkit.recipes import train_config
from tellkit.tasks.summarization import SummarizationTask

VG = Path(__file__).resolve().parents[1] / "configs" / "vg"
PAPER = sorted(p for p in VG.glob("how2_*.yaml") if p.name != "how2_bart_tellkit.yaml")
TELLKIT = VG / "how2_bart_tellkit.yaml"
WORDS = " ".join(f"w{i}" for i in range(700))


@pytest.fixture(scope="module", params=["bart", "t5"])
def backbone(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tiny_{request.param}")
    return save_tiny_backbone(d, request.param, [WORDS, "a b c"], d_model=16, layers=2, heads=2, ffn=32)


def _task(path):
    recipe = load_yaml(path)
    return recipe, SummarizationTask(recipe), train_config(recipe)


# -- 4: dot-product fusion over text positions, no video mask -------------------------------------
@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.name)
def test_paper_recipes_fuse_as_the_reference(path):
    cfg = _task(path)[1].model_config
    assert cfg.softmax_over == "text" and cfg.mask_frames is False
    assert cfg.reference_init and cfg.group_params_by_value


def test_tellkit_recipe_keeps_its_own_choices():
    _, task, tc = _task(TELLKIT)
    cfg = task.model_config
    assert cfg.softmax_over == "frames" and cfg.mask_frames and not cfg.group_params_by_value
    assert task.data.max_source_tokens == 512 and task.data.source_special_tokens
    assert task.data.max_target_tokens == 128 and tc.batch_size * tc.accumulate == 120
    assert tc.max_epochs == 60 and tc.patience == 5


@torch.no_grad()
@pytest.mark.parametrize("gate", [False, True])
def test_reference_dot_product_fusion_with_padded_frames(gate):
    torch.manual_seed(0)
    blk = FusionBlock("dot_product", 8, 6, dropout=0.0, forget_gate=gate, softmax_over="text",
                      mask_frames=False).eval()
    text = torch.randn(2, 5, 8)
    video = torch.randn(2, 4, 6)
    video[1, 2:] = 0  # the second video has 2 frames, zero-padded as the reference's collate_fn pads
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    f = blk.fusion
    # cross_attn_type 0 as the reference writes it: no mask anywhere, softmax over dim 1 (text)
    vt = F.linear(video, f.video_proj.weight, f.video_proj.bias)
    attn = F.softmax(torch.bmm(text, vt.transpose(1, 2)), dim=1)
    img = torch.bmm(attn, video)
    if gate:
        img = torch.sigmoid(F.linear(torch.cat((img, text), 2), f.gate.proj.weight, f.gate.proj.bias)) * img
    out = F.linear(torch.cat((text, img), 2), f.out.weight, f.out.bias)
    torch.testing.assert_close(blk(text, video, mask), blk.norm(text + out))


@torch.no_grad()
def test_reference_multi_head_fusion_attends_to_padded_frames():
    torch.manual_seed(0)
    blk = FusionBlock("multi_head", 8, 6, d_common=4, heads=2, dropout=0.0, mask_frames=False).eval()
    masked = FusionBlock("multi_head", 8, 6, d_common=4, heads=2, dropout=0.0).eval()
    masked.load_state_dict(blk.state_dict())
    text, video = torch.randn(2, 5, 8), torch.randn(2, 4, 6)
    video[1, 2:] = 0
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    f = blk.fusion
    q = f.q(text).transpose(0, 1)
    k, v = f.k(video).transpose(0, 1), f.v(video).transpose(0, 1)
    mha = nn.MultiheadAttention(4, 2)
    mha.load_state_dict(f.attention.state_dict())
    o = mha(q, k, v)[0].transpose(0, 1)  # the reference: _multi_head_attn(Q, K, V), no key_padding_mask
    torch.testing.assert_close(blk(text, video, mask), blk.norm(text + f.out(torch.cat([text, o], 2))))
    assert not torch.allclose(masked(text, video, mask)[1], blk(text, video, mask)[1])


# -- 5: initialisation ------------------------------------------------------------------------------
def _vg(backbone, **kw):
    torch.manual_seed(3)
    kw = {"fusion": "dot_product", "forget_gate": True, "visual_encoder": True, "video_dim": 12, "vtf_layers": 4,
          "vtf_heads": 2, "vtf_ffn": 12, "dropout": 0.0, **kw}
    m = VGGPLM(VGGPLMConfig(backbone=str(backbone), **kw))
    m.load_backbone_weights()
    return m


@torch.no_grad()
def test_reference_init(backbone):
    m = _vg(backbone, reference_init=True)
    new = [m.visual_encoder, m.encoder_fusion]
    linears = [x for part in new for x in part.modules() if isinstance(x, nn.Linear)]
    layers = m.visual_encoder.layers
    if not m.is_t5:
        # BART's init_weights: every nn.Linear of the model N(0, init_std = 0.02), bias 0
        std = m.backbone.config.init_std
        assert std == 0.02
        weights = torch.cat([x.weight.flatten() for x in linears])
        assert abs(weights.std().item() - std) < 0.003 and abs(weights.mean().item()) < 0.003
        assert all(x.bias.abs().sum() == 0 for x in linears)
        assert not torch.equal(layers[0].linear1.weight, layers[1].linear1.weight)  # redrawn per layer
    else:
        # T5's _init_weights has no branch for a plain nn.Linear: PyTorch's defaults stay
        outs = {id(layer.self_attn.out_proj) for layer in layers}  # nn.MultiheadAttention zeroes its own
        assert all(x.bias.abs().sum() > 0 for x in linears if id(x) not in outs)
        assert torch.equal(layers[0].linear1.weight, layers[3].linear1.weight)
    # ImageTransformerEncoder deep-copies one layer: what no init redraws starts equal in all four
    for layer in layers[1:]:
        assert torch.equal(layer.self_attn.in_proj_weight, layers[0].self_attn.in_proj_weight)
    plain = _vg(backbone)
    assert not torch.equal(plain.visual_encoder.layers[0].self_attn.in_proj_weight,
                           plain.visual_encoder.layers[1].self_attn.in_proj_weight)
    if not m.is_t5:
        assert plain.encoder_fusion["1"].fusion.out.bias.abs().sum() > 0  # PyTorch's default


# -- 6: lengths, special tokens, batch, schedule ----------------------------------------------------
def test_paper_recipe_lengths_batch_and_schedule():
    for path in PAPER:
        recipe, task, tc = _task(path)
        assert task.data.max_source_tokens == 511 and not task.data.source_special_tokens
        assert task.data.max_target_tokens == (64 if "t5" in path.name else 65)
        assert not task.data.pad_frames  # the reference pads each batch to its longest video
        text_only = task.model_config.fusion == "none"
        assert tc.batch_size * tc.accumulate == (80 if text_only else 20)
        assert tc.max_epochs == 100 and tc.patience is None and tc.amp is False
        assert tc.step_every_epochs == 10 and tc.step_gamma == 0.95 and tc.seed == 0


def test_reference_source_and_target_tokens(backbone):
    from tellkit.data.how2 import How2Dataset, How2Example

    kind = "t5" if "t5" in str(backbone) else "bart"
    recipe = load_yaml(VG / ("how2_t5.yaml" if kind == "t5" else "how2_bart.yaml"))
    data = SummarizationTask(recipe).data
    tok = load_tokenizer(backbone)
    ds = How2Dataset([How2Example("v", WORDS, WORDS, None)], tok, max_source_tokens=data.max_source_tokens,
                     max_target_tokens=data.max_target_tokens, source_special_tokens=data.source_special_tokens,
                     use_video=False)
    item = ds[0]
    # data_builder.py: encode(add_special_tokens=False), source [:max_input_len - 1], target [:max_output_len - 1]
    ids = tok.encode(WORDS, add_special_tokens=False)
    max_input_len, max_output_len = 512, 64
    assert item["input_ids"] == ids[: max_input_len - 1]
    eos = tok.eos_token_id
    reference_labels = ids[: max_output_len - 1] + [eos]
    labels = item["labels"][1:] if kind == "bart" else item["labels"]  # tellkit's BART labels start with <s>
    assert labels == reference_labels
    if kind == "bart":
        assert item["labels"][0] == tok.bos_token_id


# -- 7: optimiser groups by value -------------------------------------------------------------------
def _reference_groups(model, boosted):
    # base_model.py configure_optimizers, re-stated
    bart_para = []
    for p in model.parameters():
        flag = 0
        for q in boosted:
            if p.shape == q.shape and torch.equal(p, q):
                flag = 1
        if flag == 0:
            bart_para.append(p)
    return bart_para


def test_grouping_by_value_leaves_zero_tensors_out(backbone):
    if "t5" in str(backbone):
        pytest.skip("the count is the BART recipe's (T5 keeps PyTorch's non-zero biases)")
    m = _vg(backbone, reference_init=True, group_params_by_value=True)
    with torch.no_grad():  # a pre-trained backbone has no zero bias; the tiny random one does
        for p in m.backbone.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    groups = m.parameter_groups(1e-3)
    boosted = list(m.boosted_parameters())
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in _reference_groups(m, boosted)]
    assert groups[1]["lr"] == pytest.approx(5e-3) and [id(p) for p in groups[1]["params"]] == [id(p) for p in boosted]
    grouped = {id(p) for g in groups for p in g["params"]}
    left = sorted(n for n, p in m.named_parameters() if id(p) not in grouped)
    per_layer = ["self_attn.out_proj.bias", "linear1.bias", "linear2.bias", "norm1.bias", "norm2.bias"]
    expected = sorted(["encoder_fusion.1.norm.bias"]
                      + [f"visual_encoder.layers.{i}.{n}" for i in range(4) for n in per_layer])
    assert left == expected and len(left) == 21
    # at the paper's sizes: 4 VTF layers x 5 tensors of 2048 (FFN 2048 = d) + the fusion LayerNorm's 768
    assert 4 * 5 * 2048 + 768 == 41_728
    # they stay zero through training
    opt = torch.optim.Adam(groups)
    m.train()
    tok = load_tokenizer(backbone)
    enc = tok(["w1 w2 w3"], return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
             "labels": tok(["w4 w5"], return_tensors="pt")["input_ids"], "video": torch.randn(1, 3, 12)}
    m(batch)["loss"].backward()
    opt.step()
    named = dict(m.named_parameters())
    assert all(named[n].abs().sum() == 0 and named[n].grad is not None for n in left)
    # without the switch every parameter is in a group
    m.config.group_params_by_value = False
    assert sum(len(g["params"]) for g in m.parameter_groups(1e-3)) == len(list(m.parameters()))
