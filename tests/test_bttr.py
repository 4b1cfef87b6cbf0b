"""BTTR model: sizes, bidirectional loss, padding invariance, search equivalences, save/load."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tellkit.data.crohme import collate
from tellkit.models.bttr import BTTR, EOS, PAD, SOS, BTTRConfig, bidirectional_targets
from tellkit.models.bttr_search import joint_search
from tellkit.registry import create_model

TINY = dict(growth_rate=4, block_depth=2, stem_channels=8, d_model=32, nhead=4, num_decoder_layers=2,
            dim_feedforward=64, max_len=12, beam_size=3)


def tiny_model(seed=0, eos_bias=2.5):
    torch.manual_seed(seed)
    m = BTTR(BTTRConfig(**TINY)).eval()
    with torch.no_grad():  # make random models end their sequences at varied lengths
        m.decoder.out.bias[EOS] += eos_bias
        m.decoder.out.bias[SOS] += eos_bias
    return m


LABELS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def fitted():
    """A tiny model whose decoder has learned (a little) to read three random images, so that
    searches end at different lengths and the directions disagree sometimes (a few seconds)."""
    torch.manual_seed(0)
    m = BTTR(BTTRConfig(**TINY)).eval()
    b = batch_of(images(), LABELS)
    with torch.no_grad():
        mem, mask = m.encode(b["image"], b["image_mask"])
    inp, tgt = bidirectional_targets(b["labels"], b["label_lengths"])
    opt = torch.optim.Adam(m.decoder.parameters(), 1e-2)
    m.decoder.train()
    for _ in range(40):
        logits = m.decoder(inp, mem.repeat(2, 1, 1), mask.repeat(2, 1))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def batch_of(images, labels=None):
    labels = labels or [[5, 6, 7]] * len(images)
    return collate([{"image": x, "labels": lab, "id": str(i), "tokens": []}
                    for i, (x, lab) in enumerate(zip(images, labels))])


def images(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(1, 32, 64, generator=g), torch.rand(1, 48, 32, generator=g), torch.rand(1, 16, 96, generator=g)]


def test_reference_size_is_6_38m():
    with torch.device("meta"):
        m = create_model("bttr/crohme")
    n = m.num_parameters(trainable_only=True)
    assert abs(n - 6.38e6) / 6.38e6 < 0.01, n
    assert m.encoder.densenet.out_channels == 684


def test_model_info_cli():
    out = subprocess.run([sys.executable, "-m", "tellkit", "model-info", "configs/bttr/crohme.yaml"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["family"] == "bttr" and abs(info["trainable_params"] - 6.38e6) / 6.38e6 < 0.01


def test_bidirectional_targets():
    labels = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    inp, tgt = bidirectional_targets(labels, torch.tensor([3, 2]))
    assert inp.tolist() == [[SOS, 5, 6, 7], [SOS, 8, 9, PAD], [EOS, 7, 6, 5], [EOS, 9, 8, PAD]]
    assert tgt.tolist() == [[5, 6, 7, EOS], [8, 9, EOS, PAD], [7, 6, 5, SOS], [9, 8, SOS, PAD]]


def test_loss_is_mean_over_both_directions_and_trains():
    m = tiny_model()
    b = batch_of(images()[:2], [[5, 6, 7], [8, 9]])
    out = m(b)
    assert out["ntokens"] == 2 * (4 + 3)
    inp, tgt = bidirectional_targets(b["labels"], b["label_lengths"])
    lp = F.log_softmax(out["logits"], -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    assert torch.allclose(out["loss"], -(lp * (tgt != PAD)).sum() / out["ntokens"], atol=1e-5)
    m.train()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    first = None
    for _ in range(6):
        loss = m(b)["loss"]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first * 0.9


def test_encoder_padding_invariance():
    m = tiny_model()
    imgs = images()
    b = batch_of(imgs)
    mem, mask = m.encode(b["image"], b["image_mask"])
    for i, x in enumerate(imgs):
        alone, amask = m.encode(x[None], None)
        n = int(amask.sum())
        real = mem[i][mask[i]]
        assert real.shape[0] == n
        assert torch.allclose(real, alone[0], atol=1e-5)


def test_cached_equals_uncached(fitted):
    m = fitted
    b = batch_of(images())
    a = m.generate(b["image"], b["image_mask"], use_cache=True)
    c = m.generate(b["image"], b["image_mask"], use_cache=False)
    assert a["tokens"] == c["tokens"]
    assert torch.allclose(torch.tensor(a["scores"]), torch.tensor(c["scores"]), atol=1e-4)
    assert len({len(t) for t in a["tokens"]}) > 1  # the searches ended at different steps


def test_batched_equals_one_by_one(fitted):
    m = fitted
    imgs = images()
    b = batch_of(imgs)
    together = m.generate(b["image"], b["image_mask"])
    for i, x in enumerate(imgs):
        alone = m.generate(x[None], None)
        assert alone["tokens"][0] == together["tokens"][i]
        assert abs(alone["scores"][0] - together["scores"][i]) < 1e-4


@torch.no_grad()
def _greedy(m, image, max_len):
    mem, mask = m.encode(image, None)
    seq = [SOS]
    total = 0.0
    for _ in range(max_len):
        lp = F.log_softmax(m.decoder(torch.tensor([seq]), mem, mask)[0, -1], -1)
        lp[PAD] = lp[SOS] = float("-inf")  # never generated
        tok = int(lp.argmax())
        total += float(lp[tok])
        if tok == EOS:
            return seq[1:], total
        seq.append(tok)
    return seq[1:], total


@pytest.mark.parametrize("which", ["fitted", "random"])
def test_beam_one_without_rescoring_is_greedy(which, fitted):
    m = fitted if which == "fitted" else tiny_model(seed=5, eos_bias=4.0)
    imgs = images()
    b = batch_of(imgs)
    out = m.generate(b["image"], b["image_mask"], beam_size=1, bidirectional=False, rescore=False)
    for i, x in enumerate(imgs):
        toks, score = _greedy(m, x[None], 12)
        assert out["tokens"][i] == toks
        assert abs(out["scores"][i] - score) < 1e-4


@pytest.mark.parametrize("i", [0, 1, 2])
@torch.no_grad()
def test_rescoring_uses_the_opposite_direction(fitted, i):
    m = fitted
    x = images()[i][None]
    out = joint_search(m, x, None, beam_size=3, max_len=12)
    toks = out["tokens"][0]
    mem, mask = m.encode(x, None)
    l2r = m.sequence_logprob(torch.tensor([[SOS] + toks]), torch.tensor([toks + [EOS]]), mem, mask)
    r2l = m.sequence_logprob(torch.tensor([[EOS] + toks[::-1]]), torch.tensor([toks[::-1] + [SOS]]), mem, mask)
    want = float(l2r + r2l) / max(len(toks), 1)  # the reference: score / len(symbols) ** alpha
    assert abs(out["scores"][0] - want) < 1e-4


def test_save_load_round_trip(tmp_path):
    m = tiny_model()
    m.save_pretrained(tmp_path / "ck")
    m2 = BTTR.from_pretrained(tmp_path / "ck").eval()
    x = images()[0][None]
    assert m.generate(x)["tokens"] == m2.generate(x)["tokens"]


@torch.no_grad()
def _reference_beam(m, x, start, end, k, max_len):
    """The reference's beam search, written plainly: one image, whole prefix recomputed, the
    best (k - finished) continuations kept, those ending in ``end`` finished."""
    mem, mask = m.encode(x, None)
    hyps, done = [([start], 0.0)], []
    for _ in range(max_len):
        cands = []
        for seq, s in hyps:
            lp = F.log_softmax(m.decoder(torch.tensor([seq]), mem, mask)[0, -1], -1)
            lp[PAD] = lp[start] = float("-inf")
            cands += [(s + float(lp[v]), seq, v) for v in range(lp.shape[0])]
        cands.sort(key=lambda c: -c[0])
        new = []
        for sc, seq, v in cands[: k - len(done)]:
            if v == end:
                done.append((seq[1:], sc))
            else:
                new.append((seq + [v], sc))
        hyps = new
        if len(done) >= k or not hyps:
            break
    if not done:
        best = max(hyps, key=lambda h: h[1])
        done.append((best[0][1:], best[1]))
    return done


@pytest.mark.parametrize("direction", ["l2r", "r2l"])
def test_batched_beam_matches_plain_reference_beam(fitted, direction):
    from tellkit.models.bttr_search import beam_search

    start, end = (SOS, EOS) if direction == "l2r" else (EOS, SOS)
    imgs = images()
    b = batch_of(imgs)
    mem, mask = fitted.encode(b["image"], b["image_mask"])
    n = len(imgs)
    got = beam_search(fitted, mem, mask, torch.full((n,), start), torch.full((n,), end), 4, 12)
    for i, x in enumerate(imgs):
        want = _reference_beam(fitted, x[None], start, end, 4, 12)
        assert [t for t, _ in got[i]] == [t for t, _ in want]
        assert all(abs(a - c) < 1e-4 for (_, a), (_, c) in zip(got[i], want))
    assert any(len(g) > 1 for g in got)  # several hypotheses finished
