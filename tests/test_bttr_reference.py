"""BTTR as the reference builds it: exact size, positional-encoding layout, and weights that port
from a Green-Wood/BTTR Lightning checkpoint.

The reference model is re-stated plainly here (torch.nn modules named and ordered as in the
reference, PyTorch's own TransformerDecoder), saved in the reference's checkpoint layout, and
converted with ``tellkit convert``: the converted model must give the same logits."""
import json
import math
import subprocess
import sys
import types
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tellkit.cli import main
from tellkit.models.bttr import BTTR, BTTRConfig, image_positions, word_positions
from tellkit.registry import build_config, create_model


def test_model_info_gives_the_reference_count():
    out = subprocess.run([sys.executable, "-m", "tellkit", "model-info", "configs/bttr/crohme.yaml"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["trainable_params"] == 6_375_425
    assert info["breakdown"] == {"encoder": 3_156_624, "decoder": 3_218_801}


def test_word_positions_are_interleaved_sin_cos():
    d = 8
    pe = word_positions(5, d)
    for p in range(5):
        for j in range(d // 2):
            w = 1.0 / 10000 ** (2 * j / d)
            assert pe[p, 2 * j].item() == pytest.approx(math.sin(p * w), abs=1e-6)
            assert pe[p, 2 * j + 1].item() == pytest.approx(math.cos(p * w), abs=1e-6)
    assert torch.allclose(word_positions(2, d, start=3), pe[3:5])


def test_image_positions_follow_the_reference_formula():
    d, h, w = 8, 3, 4
    mask = torch.ones(1, h, w, dtype=torch.bool)
    mask_pad = torch.zeros(1, h, w + 2, dtype=torch.bool)
    mask_pad[:, :, :w] = True  # two padded columns must not change the real positions
    pos = image_positions(mask, d)
    assert torch.allclose(image_positions(mask_pad, d)[:, :, :w], pos, atol=1e-6)
    half = d // 2
    for y in range(h):
        for x in range(w):
            xs = (x + 1) / w * 2 * math.pi
            ys = (y + 1) / h * 2 * math.pi
            for i in range(half):
                f = 1.0 / 10000 ** (i / half)
                fn = math.sin if i % 2 == 0 else math.cos
                assert pos[0, y, x, i].item() == pytest.approx(fn(xs * f), abs=1e-5)
                assert pos[0, y, x, half + i].item() == pytest.approx(fn(ys * f), abs=1e-5)


# --- the reference, re-stated -------------------------------------------------------------------
class _RefBottleneck(nn.Module):
    def __init__(self, cin, k):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(4 * k)
        self.conv1 = nn.Conv2d(cin, 4 * k, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(k)
        self.conv2 = nn.Conv2d(4 * k, k, 3, padding=1, bias=False)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return torch.cat((x, out), 1)


class _RefTransition(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv1 = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x):
        return F.avg_pool2d(F.relu(self.bn1(self.conv1(x))), 2, ceil_mode=True)


class _RefDenseNet(nn.Module):
    def __init__(self, k, depth):
        super().__init__()
        ch = 2 * k
        self.conv1 = nn.Conv2d(1, ch, 7, padding=3, stride=2, bias=False)
        self.norm1 = nn.BatchNorm2d(ch)
        blocks = []
        for b in range(3):
            layers = []
            for _ in range(depth):
                layers.append(_RefBottleneck(ch, k))
                ch += k
            blocks.append(nn.Sequential(*layers))
            if b < 2:
                out = int(math.floor(ch * 0.5))
                setattr(self, f"trans{b + 1}", _RefTransition(ch, out))
                ch = out
        self.dense1, self.dense2, self.dense3 = blocks
        self.out_channels = ch
        self.post_norm = nn.BatchNorm2d(ch)

    def forward(self, x):
        out = F.max_pool2d(F.relu(self.norm1(self.conv1(x))), 2, ceil_mode=True)
        out = self.trans1(self.dense1(out))
        out = self.trans2(self.dense2(out))
        return self.post_norm(self.dense3(out))


class _RefEncoder(nn.Module):
    def __init__(self, d, k, depth):
        super().__init__()
        self.model = _RefDenseNet(k, depth)
        self.feature_proj = nn.Sequential(nn.Conv2d(self.model.out_channels, d, 1), nn.ReLU())
        self.norm = nn.LayerNorm(d)
        self.d = d

    def forward(self, img):
        f = self.feature_proj(self.model(img)).permute(0, 2, 3, 1)
        f = self.norm(f)
        b, h, w, d = f.shape
        ys = torch.arange(1, h + 1).float()[:, None].expand(h, w) / h * 2 * math.pi
        xs = torch.arange(1, w + 1).float()[None, :].expand(h, w) / w * 2 * math.pi
        half = d // 2
        inv = 1.0 / 10000 ** (torch.arange(half).float() / half)

        def enc(v):
            a = v[..., None] * inv
            return torch.stack((a[..., 0::2].sin(), a[..., 1::2].cos()), -1).flatten(-2)

        f = f + torch.cat((enc(xs), enc(ys)), -1)[None]
        return f.reshape(b, h * w, d)


class _RefDecoder(nn.Module):
    def __init__(self, d, nhead, layers, ffn, vocab):
        super().__init__()
        self.word_embed = nn.Sequential(nn.Embedding(vocab, d), nn.LayerNorm(d))
        self.model = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, nhead, ffn, 0.3), layers)
        self.proj = nn.Linear(d, vocab)
        self.d = d

    def forward(self, src, tgt):
        n = tgt.shape[1]
        pos = torch.arange(n).float()[:, None]
        div = 1.0 / 10000 ** (torch.arange(0, self.d, 2).float() / self.d)
        pe = torch.zeros(n, self.d)
        pe[:, 0::2], pe[:, 1::2] = (pos * div).sin(), (pos * div).cos()
        x = self.word_embed(tgt) + pe[None]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        out = self.model(x.transpose(0, 1), src.transpose(0, 1), tgt_mask=causal)
        return self.proj(out.transpose(0, 1))


class _RefBTTR(nn.Module):
    def __init__(self, d=32, k=4, depth=2, nhead=4, layers=2, ffn=64, vocab=113):
        super().__init__()
        self.encoder = _RefEncoder(d, k, depth)
        self.decoder = _RefDecoder(d, nhead, layers, ffn, vocab)

    def forward(self, img, tgt):
        return self.decoder(self.encoder(img), tgt)


def _randomise(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in m.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if "running_var" in name
                        else torch.randn(t.shape, generator=g) * 0.2)


@pytest.fixture()
def reference_ckpt(tmp_path, monkeypatch):
    """A checkpoint written as the reference's Lightning trainer writes it: the model under
    ``state_dict`` with the ``bttr.`` prefix, hyper-parameters in a Lightning class."""
    torch.manual_seed(0)
    ref = _RefBTTR().eval()
    _randomise(ref)
    mod = types.ModuleType("pytorch_lightning.utilities.parsing")

    class AttributeDict(dict):
        pass

    AttributeDict.__module__, AttributeDict.__qualname__ = mod.__name__, "AttributeDict"
    mod.AttributeDict = AttributeDict
    for name in ("pytorch_lightning", "pytorch_lightning.utilities"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    ckpt = {"epoch": 3, "global_step": 100, "pytorch-lightning_version": "1.2.0",
            "state_dict": {f"bttr.{k}": v for k, v in ref.state_dict().items()},
            "hyper_parameters": AttributeDict(d_model=32, growth_rate=4, num_layers=2, nhead=4),
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 1.0}]}]}
    path = tmp_path / "epoch=3.ckpt"
    torch.save(ckpt, path)
    return ref, path


def test_convert_reference_checkpoint_gives_the_same_logits(reference_ckpt, tmp_path):
    ref, path = reference_ckpt
    out = tmp_path / "converted"
    r = subprocess.run([sys.executable, "-m", "tellkit", "convert", str(path), "--out", str(out), "-o", "nhead=4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = BTTR.from_pretrained(out).eval()
    assert type(m) is BTTR and m.config.growth_rate == 4 and m.config.block_depth == 2
    img = torch.rand(1, 1, 64, 96)
    tgt = torch.tensor([[1, 10, 20, 30, 40]])
    with torch.no_grad():
        want = ref(img, tgt)
        mem, mask = m.encode(img, None)
        got = m.decoder(tgt, mem, mask)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_convert_refuses_a_wrong_dictionary_and_an_occupied_folder(reference_ckpt, tmp_path):
    _, path = reference_ckpt
    d = tmp_path / "dictionary.txt"
    d.write_text("\n".join(["a", "b"]) + "\n")
    assert main(["convert", str(path), "--out", str(tmp_path / "x"), "-o", "nhead=4", "-o", f"dictionary={d}"]) == 2
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    assert main(["convert", str(path), "--out", str(occupied), "-o", "nhead=4"]) == 2
    assert (occupied / "keep.txt").read_text() == "mine"


def test_convert_with_a_permuted_dictionary_maps_rows_by_symbol(reference_ckpt, tmp_path):
    from tellkit.data.latex import SYMBOLS

    ref, path = reference_ckpt
    order = list(SYMBOLS)[::-1]  # the checkpoint's rows in reverse symbol order
    d = tmp_path / "dictionary.txt"
    d.write_text("\n".join(order) + "\n")
    out = tmp_path / "converted"
    assert main(["convert", str(path), "--out", str(out), "-o", "nhead=4", "-o", f"dictionary={d}"]) == 0
    m = BTTR.from_pretrained(out).eval()
    from tellkit.data.latex import Vocab

    v = Vocab()
    sym = "\\frac"
    theirs = 3 + order.index(sym)
    assert torch.equal(m.decoder.out.weight[v.stoi[sym]], ref.decoder.proj.weight[theirs])
    assert torch.equal(m.decoder.embed.weight[v.stoi[sym]], ref.decoder.word_embed[0].weight[theirs])


def test_a_pickle_that_runs_code_is_not_executed(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as f:  # a plain pickle
        pickle.dump({"state_dict": {"x": Evil()}}, f)
    assert main(["convert", str(path), "--out", str(tmp_path / "o")]) == 2
    assert not marker.exists()
    zipped = tmp_path / "evil_zip.ckpt"  # PyTorch's zip format, read by the restricted unpickler
    torch.save({"state_dict": {"x": Evil(), "w": torch.ones(2)}}, zipped)
    assert main(["convert", str(zipped), "--out", str(tmp_path / "o2")]) == 2
    assert not marker.exists() and not (tmp_path / "o2").exists()


def test_export_to_the_reference_and_back(tmp_path):
    """tellkit -> reference: the exported .ckpt loads strictly into the re-stated reference
    model and gives the tellkit model's logits; converting it back gives the same tensors."""
    torch.manual_seed(1)
    m = BTTR(BTTRConfig(growth_rate=4, block_depth=2, stem_channels=8, d_model=32, nhead=4,
                        num_decoder_layers=2, dim_feedforward=64)).eval()
    for name, t in m.state_dict().items():  # non-trivial BatchNorm statistics as well
        if t.is_floating_point():
            t.copy_(torch.rand_like(t) + 0.5 if "running_var" in name else torch.randn_like(t) * 0.2)
    src = m.save_pretrained(tmp_path / "tellkit_model")
    ckpt = tmp_path / "exported.ckpt"
    assert main(["export", str(src), "--format", "reference", "--out", str(ckpt)]) == 0
    data = torch.load(ckpt, weights_only=True)  # tensors and plain values only
    assert data["hyper_parameters"] == {"d_model": 32, "growth_rate": 4, "num_layers": 2, "nhead": 4,
                                        "num_decoder_layers": 2, "dim_feedforward": 64, "dropout": 0.3,
                                        "beam_size": 10, "max_len": 200, "alpha": 1.0, "learning_rate": 1.0,
                                        "patience": 20}
    ref = _RefBTTR(d=32, k=4, depth=2, nhead=4, layers=2, ffn=64).eval()
    ref.load_state_dict({k[len("bttr."):]: v for k, v in data["state_dict"].items()}, strict=True)
    img, tgt = torch.rand(1, 1, 64, 96), torch.tensor([[1, 10, 20, 30, 40]])
    with torch.no_grad():
        mem, mask = m.encode(img, None)
        assert torch.allclose(ref(img, tgt), m.decoder(tgt, mem, mask), atol=1e-4)
    back = tmp_path / "back"
    assert main(["convert", str(ckpt), "--out", str(back), "-o", "nhead=4"]) == 0
    again = BTTR.from_pretrained(back).state_dict()
    assert again.keys() == m.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in m.state_dict().items())
    # an existing file is never overwritten; the old layout cannot be exported
    before = ckpt.read_bytes()
    assert main(["export", str(src), "--format", "reference", "--out", str(ckpt)]) == 2
    assert ckpt.read_bytes() == before
    legacy = _tellkit_0_1_checkpoint(tmp_path / "old")
    assert main(["export", str(legacy), "--format", "reference", "--out", str(tmp_path / "x.ckpt")]) == 2
    assert not (tmp_path / "x.ckpt").exists()


def test_convert_to_reference_still_exports_and_names_its_replacement(tmp_path, capsys):
    """The earlier spelling ``tellkit convert --to reference`` writes the same file as
    ``tellkit export --format reference``, with a one-line deprecation message naming it."""
    src = create_model("bttr/tiny").save_pretrained(tmp_path / "m")
    capsys.readouterr()
    assert main(["convert", str(src), "--to", "reference", "--out", str(tmp_path / "old.ckpt")]) == 0
    err = capsys.readouterr().err.strip()
    assert "deprecated" in err and "tellkit export --format reference" in err and "\n" not in err
    assert main(["export", str(src), "--format", "reference", "--out", str(tmp_path / "new.ckpt")]) == 0
    old, new = (torch.load(tmp_path / f"{n}.ckpt", weights_only=True) for n in ("old", "new"))
    assert old["hyper_parameters"] == new["hyper_parameters"]
    assert all(torch.equal(old["state_dict"][k], v) for k, v in new["state_dict"].items())


def test_export_reference_refuses_the_options_of_a_checkpoint_folder(tmp_path, capsys):
    src = create_model("bttr/tiny").save_pretrained(tmp_path / "m")
    assert main(["export", str(src), "--format", "reference", "--out", str(tmp_path / "x.ckpt"), "--int8"]) == 2
    assert "--format reference" in capsys.readouterr().err
    assert not (tmp_path / "x.ckpt").exists()


def _tellkit_0_1_checkpoint(d):
    """A (tiny) BTTR checkpoint as tellkit 0.1 wrote it: the old layout, family 'bttr', no
    'variant' in its config (format 1)."""
    torch.manual_seed(0)
    m = create_model({"name": "bttr_legacy", **asdict(build_config("bttr/tiny")[1])})
    m.save_pretrained(d)
    meta = json.loads((d / "config.json").read_text())
    meta.update(family="bttr", format_version=1, tellkit_version="0.1.0")
    (d / "config.json").write_text(json.dumps(meta))
    return d


def test_checkpoints_from_tellkit_0_1_still_load(tmp_path):
    """A BTTR config.json written by tellkit 0.1 has no 'variant': it loads as the old layout
    (family bttr_legacy), with its weights (their outputs: tests/test_bttr_legacy.py)."""
    from tellkit.checkpoint import load_model

    d = _tellkit_0_1_checkpoint(tmp_path / "old")
    m = load_model(d)
    assert m.family == "bttr_legacy"
    torch.manual_seed(0)
    want = create_model({"name": "bttr_legacy", **asdict(build_config("bttr/tiny")[1])}).state_dict()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())
