"""CoMER (BTTR + the Attention Refinement Module): exact size, the coverage's maths against a
plain re-statement of the reference's module, cached and batched search, training and
recognition through the command line, save/load, and weights that port from a Green-Wood/CoMER
Lightning checkpoint (the reference model re-stated with its module names)."""
import json
import math
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tellkit.cli import main
from tellkit.models.bttr import BTTR, EOS, PAD, SOS, bidirectional_targets
from tellkit.models.comer import AttentionRefinement, CoMER, ComerConfig, exclusive_cumsum
from tellkit.registry import create_model
from test_bttr import LABELS, batch_of, images  # noqa: I001  (tests/ is on the path)
from test_bttr_cli import _dataset
from test_bttr_reference import _randomise, _RefDenseNet

TINY = dict(growth_rate=4, block_depth=2, stem_channels=8, d_model=32, nhead=4, num_decoder_layers=3,
            dim_feedforward=64, max_len=12, beam_size=3, dc=6)


def _randomise_bn(m: nn.Module, seed=0) -> None:
    """Non-trivial BatchNorm statistics and affine weights (a fresh BN is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.3)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
                mod.weight.copy_(torch.rand(mod.weight.shape, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=g) * 0.3)


def tiny_comer(seed=0):
    torch.manual_seed(seed)
    m = CoMER(ComerConfig(**TINY)).eval()
    _randomise_bn(m.decoder, seed)
    with torch.no_grad():  # a strong coverage term, so that a mistake in it shows
        m.decoder.arm.proj.weight.mul_(20)
        m.decoder.out.bias[EOS] += 2.5
        m.decoder.out.bias[SOS] += 2.5
    return m


@pytest.fixture(scope="module")
def fitted():
    """A tiny CoMER whose decoder has learned a little to read three random images, so that
    searches end at different lengths (a few seconds)."""
    torch.manual_seed(0)
    m = CoMER(ComerConfig(**TINY)).eval()
    b = batch_of(images(), LABELS)
    with torch.no_grad():
        mem, mask = m.encode(b["image"], b["image_mask"])
    inp, tgt = bidirectional_targets(b["labels"], b["label_lengths"])
    opt = torch.optim.Adam(m.decoder.parameters(), 1e-2)
    m.decoder.train()
    for _ in range(40):
        logits = m.decoder(inp, mem.repeat(2, 1, 1), torch.cat([mask, mask]))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


# --- size -----------------------------------------------------------------------------------
def test_model_info_gives_the_reference_count():
    out = subprocess.run([sys.executable, "-m", "tellkit", "model-info", "configs/bttr/comer.yaml"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["family"] == "comer" and info["trainable_params"] == 6_389_041
    assert info["breakdown"] == {"encoder": 3_156_624, "decoder": 3_232_417}
    with torch.device("meta"):
        m = create_model("bttr/comer")
    assert sum(p.numel() for p in m.decoder.arm.parameters()) == 13_104
    assert sum(p.numel() for p in m.decoder.input_norm.parameters()) == 512
    assert isinstance(m, BTTR) and m.config.dc == 32 and m.config.cross_coverage and m.config.self_coverage


# --- the coverage ------------------------------------------------------------------------------
def test_exclusive_cumsum():
    a = torch.rand(2, 3, 5, 4)
    c = exclusive_cumsum(a, 2)
    assert torch.equal(c[:, :, 0], torch.zeros(2, 3, 4))
    for t in range(1, 5):
        assert torch.allclose(c[:, :, t], a[:, :, :t].sum(2))


def test_coverage_sums_the_earlier_steps_attention_only():
    """What the ARM receives at step t: for each head and each kind of coverage, t attention
    distributions summed (step 0 sees zero), over real pixels only."""
    m = tiny_comer()
    seen = []
    m.decoder.arm.register_forward_hook(lambda mod, inp, out: seen.append(inp))
    b = batch_of(images()[:2])
    mem, mask = m.encode(b["image"], b["image_mask"])
    tokens = torch.tensor([[SOS, 5, 6, 7, 8], [SOS, 9, 10, 11, 12]])
    with torch.no_grad():
        m.decoder(tokens, mem, mask)
    assert len(seen) == 2  # layers 2 and 3, one shared module
    for cov, real in seen:
        assert cov.shape == (2, 2 * 4, 5, mask.shape[1] * mask.shape[2])
        assert torch.equal(cov[:, :, 0], torch.zeros_like(cov[:, :, 0]))
        sums = cov.sum(-1)  # [N, C, T]
        assert torch.allclose(sums, torch.arange(5.0).expand_as(sums), atol=1e-5)
        assert torch.equal(real, mask)
        assert float(cov.masked_select(~real.reshape(2, 1, 1, -1).expand_as(cov)).abs().max()) == 0.0


def test_incremental_decoding_with_beam_reordering_equals_full_recomputation():
    m = tiny_comer()
    b = batch_of(images())
    mem, mask = m.encode(b["image"], b["image_mask"])
    g = torch.Generator().manual_seed(5)
    seqs = torch.cat([torch.full((6, 1), SOS), torch.randint(3, 100, (6, 7), generator=g)], 1)
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    dec = m.incremental(mem, mask, owner)
    # rows swap their histories half-way (a beam re-ranking): row i continues old row perm[i]
    perm = torch.tensor([1, 0, 3, 2, 4, 4])
    hist = seqs.clone()
    with torch.no_grad():
        for t in range(1, 9):
            if t == 4:
                dec.reorder(perm)
                hist = torch.cat([hist[perm, :4], seqs[:, 4:]], 1)
            got = dec.step(hist[:, :t])
            full = F.log_softmax(m.decoder(hist[:, :t], mem[owner], mask[owner])[:, -1], -1)
            assert torch.allclose(got, full, atol=1e-4), (t, (got - full).abs().max())
    assert "coverage" in dec.states[1] and "coverage" not in dec.states[0]


def test_cached_equals_uncached(fitted):
    b = batch_of(images())
    a = fitted.generate(b["image"], b["image_mask"], use_cache=True)
    c = fitted.generate(b["image"], b["image_mask"], use_cache=False)
    assert a["tokens"] == c["tokens"]
    assert torch.allclose(torch.tensor(a["scores"]), torch.tensor(c["scores"]), atol=1e-4)
    assert len({len(t) for t in a["tokens"]}) > 1  # the searches ended at different steps


def test_batched_search_equals_one_by_one(fitted):
    imgs = images()
    b = batch_of(imgs)
    together = fitted.generate(b["image"], b["image_mask"])
    for i, x in enumerate(imgs):
        alone = fitted.generate(x[None], None)
        assert alone["tokens"][0] == together["tokens"][i]
        assert abs(alone["scores"][0] - together["scores"][i]) < 1e-4


def test_save_load_round_trip(tmp_path):
    from tellkit.checkpoint import load_model

    m = tiny_comer()
    m.save_pretrained(tmp_path / "ck")
    m2 = load_model(tmp_path / "ck", expect=BTTR).eval()  # what `tellkit recognize` asks for
    assert type(m2) is CoMER and m2.config == m.config
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in m.state_dict().items())
    x = images()[0][None]
    assert m.generate(x)["tokens"] == m2.generate(x)["tokens"]


# --- the reference's module, re-stated ---------------------------------------------------------
class _RefARM(nn.Module):
    """Green-Wood/CoMER's AttentionRefinementModule (both coverages), in plain torch. Inputs in
    the reference's layout: attention [(b * nhead), t, l], key_padding_mask [b, l] True = pad."""

    def __init__(self, nhead, dc):
        super().__init__()
        self.nhead = nhead
        self.conv = nn.Conv2d(2 * nhead, dc, kernel_size=5, padding=2)
        self.proj = nn.Conv2d(dc, nhead, kernel_size=1, bias=False)
        self.post_norm = nn.Module()
        self.post_norm.bn = nn.BatchNorm1d(nhead)

    def forward(self, prev_attn, key_padding_mask, h, curr_attn):
        bn, t, s = curr_attn.shape
        b, n, w = bn // self.nhead, self.nhead, s // h
        mask = key_padding_mask.reshape(b, 1, 1, h, w).expand(b, t, 1, h, w).reshape(b * t, 1, h, w)
        attns = torch.cat([prev_attn.reshape(b, n, t, s), curr_attn.reshape(b, n, t, s)], 1)
        attns = attns.cumsum(2) - attns
        attns = attns.permute(0, 2, 1, 3).reshape(b * t, 2 * n, h, w)
        cov = F.relu(self.conv(attns)).masked_fill(mask, 0.0)
        cov = self.proj(cov).permute(0, 2, 3, 1).clone()  # [b t, h, w, n]
        keep = ~mask[:, 0]
        cov[keep] = self.post_norm.bn(cov[keep])
        return cov.reshape(b, t, s, n).permute(0, 3, 1, 2).reshape(b * n, t, s)


@pytest.mark.parametrize("training", [False, True])
def test_refinement_equals_the_reference_module(training):
    torch.manual_seed(2)
    n, b, t, h, w, dc = 4, 3, 5, 3, 4, 6
    ref = _RefARM(n, dc)
    _randomise_bn(ref)
    own = AttentionRefinement(n, dc, True, True)
    own.load_state_dict({"conv.weight": ref.conv.weight, "conv.bias": ref.conv.bias, "proj.weight": ref.proj.weight,
                         **{f"norm.{k}": v for k, v in ref.post_norm.bn.state_dict().items()}})
    ref.train(training)
    own.train(training)
    pad = torch.zeros(b, h, w, dtype=torch.bool)
    pad[1, :, 3:] = True  # padded columns and rows: the BN's statistics must skip them
    pad[2, 2:, :] = True
    kpm = pad.reshape(b, -1)

    def attention():
        s = torch.randn(b, n, t, h * w).masked_fill(kpm[:, None, None], float("-inf"))
        return s.softmax(-1)

    prev, curr = attention(), attention()
    want = ref(prev.reshape(b * n, t, -1), kpm, h, curr.reshape(b * n, t, -1)).reshape(b, n, t, -1)
    got = own(exclusive_cumsum(torch.cat([prev, curr], 1), 2), ~pad)
    real = ~kpm[:, None, None].expand_as(want)
    assert torch.allclose(got[real], want[real], atol=1e-5), (got - want)[real].abs().max()
    if training:  # the same running statistics afterwards
        assert torch.allclose(own.norm.running_mean, ref.post_norm.bn.running_mean, atol=1e-6)
        assert torch.allclose(own.norm.running_var, ref.post_norm.bn.running_var, atol=1e-6)


# --- the reference model, re-stated, and its Lightning checkpoint --------------------------------
class _RefMHA(nn.Module):
    """The reference's multi-head attention with the refinement hook (inputs [len, batch, d])."""

    def __init__(self, d, nhead):
        super().__init__()
        self.nhead = nhead
        self.in_proj_weight = nn.Parameter(torch.randn(3 * d, d) * 0.1)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d))
        self.out_proj = nn.Linear(d, d)

    def forward(self, query, key, arm=None, key_padding_mask=None, attn_mask=None):
        t, b, d = query.shape
        s, n, hd = key.shape[0], self.nhead, d // self.nhead
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq, bk, bv = self.in_proj_bias.chunk(3)
        q = (F.linear(query, wq, bq) * hd**-0.5).reshape(t, b * n, hd).transpose(0, 1)
        k = F.linear(key, wk, bk).reshape(s, b * n, hd).transpose(0, 1)
        v = F.linear(key, wv, bv).reshape(s, b * n, hd).transpose(0, 1)
        dots = torch.bmm(q, k.transpose(1, 2))

        def softmax(x):
            if attn_mask is not None:
                x = x.masked_fill(attn_mask, float("-inf"))
            if key_padding_mask is not None:
                x = x.reshape(b, n, t, s).masked_fill(key_padding_mask[:, None, None], float("-inf"))
                x = x.reshape(b * n, t, s)
            return x.softmax(-1)

        attn = softmax(dots)
        if arm is not None:
            attn = softmax(dots - arm(attn))
        out = torch.bmm(attn, v).transpose(0, 1).reshape(t, b, d)
        return self.out_proj(out), attn


class _RefLayer(nn.Module):
    def __init__(self, d, nhead, ffn):
        super().__init__()
        self.self_attn, self.multihead_attn = _RefMHA(d, nhead), _RefMHA(d, nhead)
        self.linear1, self.linear2 = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, memory, arm, causal, memory_pad, tgt_pad=None):
        x = self.norm1(x + self.self_attn(x, x, attn_mask=causal, key_padding_mask=tgt_pad)[0])
        h, attn = self.multihead_attn(x, memory, arm=arm, key_padding_mask=memory_pad)
        x = self.norm2(x + h)
        return self.norm3(x + self.linear2(F.relu(self.linear1(x)))), attn


class _RefTransformer(nn.Module):
    def __init__(self, d, nhead, ffn, layers, dc):
        super().__init__()
        self.layers = nn.ModuleList(_RefLayer(d, nhead, ffn) for _ in range(layers))
        self.arm = _RefARM(nhead, dc)

    def forward(self, x, memory, height, causal, memory_pad, tgt_pad=None):
        arm = None
        for i, layer in enumerate(self.layers):
            x, attn = layer(x, memory, arm, causal, memory_pad, tgt_pad)
            if i != len(self.layers) - 1:
                arm = (lambda a: lambda cur: self.arm(a, memory_pad, height, cur))(attn)
        return x


def _ref_positions(n, d):
    pe = torch.zeros(n, d)
    pos = torch.arange(n).float()[:, None]
    div = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    pe[:, 0::2], pe[:, 1::2] = (pos * div).sin(), (pos * div).cos()
    return pe


class _RefCoMER(nn.Module):
    def __init__(self, d=32, k=4, depth=2, nhead=4, layers=3, ffn=64, dc=6, vocab=113):
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.model = _RefDenseNet(k, depth)
        self.encoder.feature_proj = nn.Conv2d(self.encoder.model.out_channels, d, 1)
        self.encoder.norm = nn.LayerNorm(d)
        self.decoder = nn.Module()
        self.decoder.word_embed = nn.Sequential(nn.Embedding(vocab, d), nn.LayerNorm(d))
        self.decoder.pos_enc = nn.Module()
        self.decoder.pos_enc.register_buffer("pe", _ref_positions(500, d))
        self.decoder.norm = nn.LayerNorm(d)
        self.decoder.model = _RefTransformer(d, nhead, ffn, layers, dc)
        self.decoder.proj = nn.Linear(d, vocab)
        self.d = d

    def forward(self, img, tgt):
        f = self.encoder.feature_proj(self.encoder.model(img)).permute(0, 2, 3, 1)  # [b, h, w, d]
        b, h, w, d = f.shape
        half = d // 2
        ys = torch.arange(1, h + 1).float()[:, None].expand(h, w) / (h + 1e-6) * 2 * math.pi
        xs = torch.arange(1, w + 1).float()[None, :].expand(h, w) / (w + 1e-6) * 2 * math.pi
        inv = 1.0 / 10000 ** (torch.arange(0, half, 2).float() / half)

        def enc(v):
            a = v[..., None] * inv
            return torch.stack((a.sin(), a.cos()), -1).flatten(-2)

        f = self.encoder.norm(f + torch.cat((enc(xs), enc(ys)), -1)[None])
        src = f.reshape(b, h * w, d).transpose(0, 1)
        pad = torch.zeros(b, h * w, dtype=torch.bool)
        n = tgt.shape[1]
        x = self.decoder.word_embed(tgt) + self.decoder.pos_enc.pe[:n][None]
        x = self.decoder.norm(x).transpose(0, 1)
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        out = self.decoder.model(x, src, h, causal, pad, tgt == 0)  # the reference's PAD_IDX is 0
        return self.decoder.proj(out.transpose(0, 1))


@pytest.fixture()
def comer_ckpt(tmp_path, monkeypatch):
    """A checkpoint as the reference's Lightning trainer writes it: the model under
    ``state_dict`` with the ``comer_model.`` prefix, hyper-parameters in a Lightning class."""
    torch.manual_seed(0)
    ref = _RefCoMER().eval()
    _randomise(ref)
    with torch.no_grad():
        ref.decoder.pos_enc.pe.copy_(_ref_positions(500, 32))  # a fixed table, not a weight
        ref.decoder.model.arm.proj.weight.mul_(30)  # a coverage term strong enough to matter
    mod = types.ModuleType("pytorch_lightning.utilities.parsing")

    class AttributeDict(dict):
        pass

    AttributeDict.__module__, AttributeDict.__qualname__ = mod.__name__, "AttributeDict"
    mod.AttributeDict = AttributeDict
    for name in ("pytorch_lightning", "pytorch_lightning.utilities"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ckpt = {"epoch": 3, "global_step": 100, "pytorch-lightning_version": "1.4.9",
            "state_dict": {f"comer_model.{k}": v for k, v in ref.state_dict().items()},
            "hyper_parameters": AttributeDict(d_model=32, growth_rate=4, num_layers=2, nhead=4, dc=6,
                                              cross_coverage=True, self_coverage=True),
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.08}]}]}
    path = tmp_path / "epoch=3.ckpt"
    torch.save(ckpt, path)
    return ref, path


def test_convert_reference_checkpoint_gives_the_same_logits(comer_ckpt, tmp_path):
    from tellkit.checkpoint import load_model
    from tellkit.convert.bttr import COMER_SYMBOLS
    from tellkit.data.latex import Vocab

    ref, path = comer_ckpt
    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, "-m", "tellkit", "convert", str(path), "--out", str(out), "-o", "nhead=4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = load_model(out).eval()
    assert type(m) is CoMER
    assert (m.config.dc, m.config.nhead, m.config.num_decoder_layers, m.config.growth_rate) == (6, 4, 3, 4)
    vocab = Vocab()
    theirs = {s: 3 + i for i, s in enumerate(COMER_SYMBOLS)} | {"<pad>": 0, "<sos>": 1, "<eos>": 2}
    shared = [s for s in vocab.itos if s in theirs]
    assert len(shared) == 112 and "'" not in theirs and "\\Pi" not in vocab.stoi
    symbols = ["<sos>", "x", "^", "{", "2", "}", "+", "\\frac", "\\alpha", "\\Delta", "z"]
    img = torch.rand(1, 1, 64, 96)
    with torch.no_grad():
        want = ref(img, torch.tensor([[theirs[s] for s in symbols]]))
        mem, mask = m.encode(img, None)
        got = m.decoder(torch.tensor([[vocab.stoi[s] for s in symbols]]), mem, mask)
    own_rows = torch.tensor([vocab.stoi[s] for s in shared])
    ref_rows = torch.tensor([theirs[s] for s in shared])
    assert torch.allclose(got[..., own_rows], want[..., ref_rows], atol=1e-4), \
        (got[..., own_rows] - want[..., ref_rows]).abs().max()
    with torch.no_grad():  # the comparison sees the coverage: without it the logits move
        m.decoder.arm.proj.weight.zero_()
        assert (m.decoder(torch.tensor([[vocab.stoi[s] for s in symbols]]), mem, mask) - got).abs().max() > 1e-2
    assert float(m.decoder.out.bias.detach()[vocab.stoi["'"]]) == -1e4  # a symbol CoMER never learned
    # the converted model searches like any other
    assert isinstance(m.generate(img, beam_size=2, max_len=4)["tokens"][0], list)


def test_padded_targets_train_as_in_the_reference(comer_ckpt, tmp_path):
    """Teacher forcing on targets of different lengths, the ARM's BatchNorm on batch statistics
    (training mode, no dropout): every logit, padded rows included, equals the reference's,
    which masks padded target positions out of the decoder's self-attention."""
    from tellkit.convert import read_reference_state_dict
    from tellkit.convert.bttr import COMER_SYMBOLS, convert
    from tellkit.data.latex import Vocab
    from tellkit.registry import create_model

    ref, path = comer_ckpt
    config, state = convert(read_reference_state_dict(path), nhead=4)
    m = create_model({**config, "dropout": 0.0, "encoder_dropout": 0.0})
    m.load_state_dict(state)
    vocab = Vocab()
    theirs = {s: 3 + i for i, s in enumerate(COMER_SYMBOLS)} | {"<pad>": 0, "<sos>": 1, "<eos>": 2}
    rows = [["<sos>", "x", "^", "{", "2", "}", "+", "z"], ["<sos>", "\\alpha", "+", "<pad>", "<pad>", "<pad>",
                                                         "<pad>", "<pad>"]]
    assert vocab.stoi["<pad>"] == PAD
    img = torch.rand(2, 1, 64, 96)
    for model in (m, ref):
        model.eval()
    m.decoder.arm.train()
    ref.decoder.model.arm.train()
    with torch.no_grad():
        want = ref(img, torch.tensor([[theirs[s] for s in r] for r in rows]))
        mem, mask = m.encode(img, None)
        tokens = torch.tensor([[vocab.stoi[s] for s in r] for r in rows])
        got = m.decoder(tokens, mem, mask)
        own = torch.tensor([vocab.stoi[s] for s in vocab.itos if s in theirs])
        refs = torch.tensor([theirs[s] for s in vocab.itos if s in theirs])
        assert torch.allclose(got[..., own], want[..., refs], atol=1e-4), (got[..., own] - want[..., refs]).abs().max()
        # the mask is what makes them agree: without it padded rows attend to padded keys (and
        # reach every row's logits, weakly, through the BatchNorm's batch statistics)
        for layer in m.decoder.layers:
            layer.forward = (lambda f: lambda *a, pad=None, **k: f(*a, **k))(layer.forward)
        unmasked = m.decoder(tokens, mem, mask)
    err = (got[..., own] - want[..., refs]).abs().max()
    err_unmasked = (unmasked[..., own] - want[..., refs]).abs().max()
    assert err_unmasked > max(1e-4, 20 * err), (err, err_unmasked)


def test_convert_needs_the_coverage_kind_when_only_one_is_on(comer_ckpt, tmp_path):
    from tellkit.convert import read_reference_state_dict
    from tellkit.convert.bttr import convert

    _, path = comer_ckpt
    state = read_reference_state_dict(path)
    key = "comer_model.decoder.model.arm.conv.weight"
    state[key] = state[key][:, :4]  # a module that reads one kind of coverage (4 = nhead)
    from tellkit.errors import TellkitError

    with pytest.raises(TellkitError, match="cross_coverage=true or -o self_coverage=true"):
        convert(state, nhead=4)
    config, _ = convert(state, nhead=4, self_coverage=True)
    assert config["name"] == "comer" and (config["cross_coverage"], config["self_coverage"]) == (False, True)


# --- end to end through the command line ---------------------------------------------------------
def test_train_then_recognize_cli(tmp_path, capsys):
    _dataset(tmp_path / "data")
    run = tmp_path / "run"
    over = [f"data.root={tmp_path / 'data'}", "data.layout=tsv", "data.train=train", "data.val=train",
            "data.test=train", "data.limit={}", "data.scale=0.5", "train.max_steps=3", "eval.beam_size=2",
            "eval.max_len=6"]
    assert main(["train", "configs/bttr/comer_tiny.yaml", *over, "--out", str(run), "--device", "cpu",
                 "--no-progress"]) == 0
    meta = json.loads((run / "checkpoints" / "best" / "config.json").read_text())
    assert meta["family"] == "comer"
    capsys.readouterr()
    img = str(tmp_path / "data" / "train" / "S" / "e0.png")
    assert main(["recognize", img, "--model", str(run), "--json", "--beam-size", "2", "--max-len", "6"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["input"] == img and isinstance(res["text"], str) and len(res["tokens"]) <= 6
    from tellkit.export.safetensors import export_safetensors

    export_safetensors(run / "checkpoints" / "best", tmp_path / "small")
    assert main(["recognize", img, "--model", str(tmp_path / "small"), "--json",
                 "--beam-size", "2", "--max-len", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == res["tokens"]


# --- CoMER started from a BTTR model -------------------------------------------------------------
def _fitted_bttr():
    """A tiny BTTR with non-trivial BatchNorms whose decoder learned a little (searches of
    different lengths)."""
    from tellkit.models.bttr import BTTRConfig

    sizes = {k: v for k, v in TINY.items() if k != "dc"}
    torch.manual_seed(3)
    m = BTTR(BTTRConfig(**sizes))
    _randomise_bn(m, 3)
    b = batch_of(images(), LABELS)
    inp, tgt = bidirectional_targets(b["labels"], b["label_lengths"])
    opt = torch.optim.Adam(m.decoder.parameters(), 1e-2)
    m.eval()
    with torch.no_grad():
        mem, mask = m.encode(b["image"], b["image_mask"])
    m.decoder.train()
    for _ in range(60):
        logits = m.decoder(inp, mem.repeat(2, 1, 1), torch.cat([mask, mask]))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def test_comer_from_bttr_reads_as_the_bttr_at_step_0(tmp_path):
    from tellkit.checkpoint import load_weights_into
    from tellkit.errors import TellkitError

    bttr = _fitted_bttr()
    bttr.save_pretrained(tmp_path / "bttr")
    comer = CoMER(ComerConfig(**TINY, bttr_layout=True))
    assert load_weights_into(comer, tmp_path / "bttr") == tmp_path / "bttr"
    report = comer.init_report
    assert len(report["copied"]) == len(bttr.state_dict())
    assert report["new"] == sorted(f"decoder.arm.{k}" for k in comer.decoder.arm.state_dict())
    assert torch.all(comer.decoder.arm.norm.weight == 0) and torch.all(comer.decoder.arm.norm.bias == 0)
    comer.eval()
    b = batch_of(images(), LABELS)
    with torch.no_grad():
        a, c = bttr(b), comer(b)
        mem_b, mask_b = bttr.encode(b["image"], b["image_mask"])
        mem_c, mask_c = comer.encode(b["image"], b["image_mask"])
    assert torch.allclose(mem_b, mem_c, atol=1e-6) and torch.equal(mask_b.reshape(mask_c.shape[0], -1),
                                                                     mask_c.reshape(mask_c.shape[0], -1))
    lp_b, lp_c = F.log_softmax(a["logits"], -1), F.log_softmax(c["logits"], -1)
    assert (lp_b - lp_c).abs().max() < 1e-4 and abs(float(a["loss"]) - float(c["loss"])) < 1e-5
    gb, gc = bttr.generate(b["image"], b["image_mask"]), comer.generate(b["image"], b["image_mask"])
    assert gb["tokens"] == gc["tokens"] and len({len(t) for t in gb["tokens"]}) > 1
    assert torch.allclose(torch.tensor(gb["scores"]), torch.tensor(gc["scores"]), atol=1e-4)
    # the refinement does not stay neutral: one training step gives its scale a gradient
    comer.train()
    comer(b)["loss"].backward()
    assert float(comer.decoder.arm.norm.weight.grad.abs().sum()) > 0

    # CoMER's own layout has no place for BTTR's weights as BTTR uses them: refused, one line
    with pytest.raises(TellkitError, match="bttr_layout"):
        load_weights_into(CoMER(ComerConfig(**TINY)), tmp_path / "bttr")
    with pytest.raises(TellkitError, match="differ"):
        load_weights_into(CoMER(ComerConfig(**{**TINY, "d_model": 16}, bttr_layout=True)), tmp_path / "bttr")
    # a BTTR does not start from a CoMER
    comer.save_pretrained(tmp_path / "comer")
    with pytest.raises(TellkitError, match="holds a 'comer' model"):
        load_weights_into(bttr, tmp_path / "comer")


def test_bttr_layout_counts_the_arm_only():
    plain, layout = ComerConfig(**TINY), ComerConfig(**TINY, bttr_layout=True)
    from tellkit.models.bttr import BTTRConfig

    n_bttr = BTTR(BTTRConfig(**{k: v for k, v in TINY.items() if k != "dc"})).num_parameters()
    n_arm = sum(p.numel() for p in CoMER(layout).decoder.arm.parameters())
    assert CoMER(layout).num_parameters() == n_bttr + n_arm
    assert CoMER(plain).num_parameters() == n_bttr + n_arm + 2 * TINY["d_model"]  # + the input LayerNorm


def test_train_comer_from_a_bttr_run_cli(tmp_path, capsys):
    """`tellkit train` with model.name comer and train.init_from a BTTR run says what it copied."""
    _dataset(tmp_path / "data")
    over = [f"data.root={tmp_path / 'data'}", "data.layout=tsv", "data.train=train", "data.val=train",
            "data.test=train", "data.limit={}", "data.scale=0.5", "train.max_steps=1", "eval.beam_size=2",
            "eval.max_len=6"]
    assert main(["train", "configs/bttr/tiny.yaml", *over, "--out", str(tmp_path / "bttr"), "--device", "cpu",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", "configs/bttr/comer_tiny.yaml", *over, "model.bttr_layout=true",
                 f"train.init_from={tmp_path / 'bttr'}", "--out", str(tmp_path / "comer"), "--device", "cpu",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "initial weights from" in out
    line = next(x for x in out.splitlines() if "tensors copied" in x)
    assert "decoder.arm.norm.weight" in line and "decoder.arm.conv.weight" in line and "encoder." not in line
    meta = json.loads((tmp_path / "comer" / "checkpoints" / "best" / "config.json").read_text())
    assert meta["family"] == "comer" and meta["config"]["bttr_layout"] is True
    # without BTTR's layout the run is refused before it trains, in one line
    assert main(["train", "configs/bttr/comer_tiny.yaml", *over, f"train.init_from={tmp_path / 'bttr'}",
                 "--out", str(tmp_path / "comer2"), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bttr_layout" in err and "Traceback" not in err
