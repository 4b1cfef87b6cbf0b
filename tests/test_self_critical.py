"""Self-critical sequence training: the CIDEr-D reward, drawing captions, the weighted loss, the
batch of drawn captions, the recipe section, and training that raises the reward."""
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml

import tellkit
from tellkit.decoding.search import sample_search
from tellkit.errors import TellkitError
from tellkit.metrics.cider_d import CiderD, prepare
from tellkit.recipes import SelfCriticalConfig, section
from tellkit.training.self_critical import SelfCritical

ROOT = Path(__file__).resolve().parents[1]
BOS, PAD, EOS = 0, 1, 2
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, input_dropout=0.0, weight_dropout=0.0)


def tiny(**kw):
    torch.manual_seed(0)
    return tellkit.create_model("tat/tiny", vocab_size=99, adaptive_cutoffs=[20, 50], contexts=["image"], **kw)


def image_batch(B=2, n_img=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(3, 99, (B, 6), generator=g)
    cap[:, 0], cap[:, -1] = BOS, EOS
    return {"caption": cap, "image": torch.randn(B, n_img, 16, generator=g),
            "image_mask": torch.ones(B, n_img, dtype=torch.bool),
            "ids": [f"i{b}" for b in range(B)], "image_ids": [f"i{b}" for b in range(B)]}


def words(tokens):
    return " ".join(f"w{t}" for t in tokens)


# --- the reward ---------------------------------------------------------------------------------
def test_cider_d_equals_the_coco_code_with_the_same_document_frequencies():
    from pycocoevalcap.cider.cider import Cider

    refs = {"a": ["a dog runs on the grass", "a brown dog is running", "the dog runs outside"],
            "b": ["two men play football", "men playing soccer on a field", "a soccer game"],
            "c": ["a girl in a red dress", "a little girl wearing red", "a child in red on a swing"]}
    hyps = {"a": "a dog is running on the grass", "b": "a man plays soccer", "c": "a girl in red is on a swing"}
    mean, per = Cider().compute_score(refs, {k: [v] for k, v in hyps.items()})
    scorer = CiderD(refs.values())
    mine = [scorer.score(hyps[k], refs[k]) for k in refs]
    assert mine == pytest.approx(list(per), abs=1e-12)
    assert sum(mine) / 3 == pytest.approx(mean, abs=1e-12)
    # the frequencies are fixed by the corpus: scoring one caption alone gives the same value
    assert CiderD(refs.values()).score(hyps["b"], refs["b"]) == pytest.approx(per[1], abs=1e-12)
    assert scorer.score("", refs["a"]) == 0.0


def test_cider_d_text_and_bad_input():
    assert prepare("A Dog, running!") == "a dog running"
    assert prepare("A Dog", lowercase=False) == "A Dog"
    with pytest.raises(TellkitError, match="at least one image"):
        CiderD([])
    with pytest.raises(TellkitError, match="at least one reference"):
        CiderD([["a dog"]]).score("a dog", [])


# --- drawing captions ---------------------------------------------------------------------------
class FixedDecoder:
    """The same next-token log-probabilities at every step."""

    def __init__(self, lp: torch.Tensor, rows: int):
        self.lp, self.rows = lp, rows

    def step(self, tokens):
        assert tokens.size(0) == self.rows and bool((tokens[:, 0] == BOS).all())
        return self.lp.expand(self.rows, -1).clone()

    def reorder(self, index):
        self.rows = index.numel()


def test_sample_search_draws_by_probability_under_the_search_constraints():
    lp = torch.tensor([0.0, 0.0, 0.3, 0.2, 0.5]).clamp(min=1e-9).log()  # BOS PAD EOS a b
    hyps = sample_search(FixedDecoder(lp, 4000), 4000, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=3, min_len=2,
                         generator=torch.Generator().manual_seed(0))
    lens = torch.tensor([len(h.tokens) for h in hyps])
    assert int(lens.min()) >= 1 and int(lens.max()) <= 2  # EOS not before 2 tokens, forced at 3
    assert (lens == 1).float().mean().item() == pytest.approx(0.3, abs=0.03)  # P(EOS) at the second step
    assert all(t in (3, 4) for h in hyps for t in h.tokens)
    first = torch.tensor([h.tokens[0] for h in hyps])
    assert (first == 4).float().mean().item() == pytest.approx(5 / 7, abs=0.03)  # a : b = 0.2 : 0.5 (EOS banned)
    for h in hyps[:200]:  # the model's own log-probabilities of the drawn tokens, EOS included
        assert h.log_prob == pytest.approx(sum(float(lp[t]) for t in h.tokens) + float(lp[EOS]), abs=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        sample_search(FixedDecoder(lp, 1), 1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=3, temperature=0.0)


def test_drawn_captions_carry_their_log_probability_under_the_model():
    m = tiny(**NO_DROPOUT).eval()
    batch = image_batch()
    out = m.sample(batch, num_samples=3, max_len=6, generator=torch.Generator().manual_seed(1))
    assert len(out["tokens"]) == 6 and all(len(t) <= 5 for t in out["tokens"])
    for row, (toks, lp) in enumerate(zip(out["tokens"], out["log_probs"])):
        b = row // 3  # the rows of one image are consecutive
        seq = torch.tensor([[BOS, *toks, EOS]])
        full = m.log_probs({"caption": seq, "image": batch["image"][b:b + 1],
                            "image_mask": batch["image_mask"][b:b + 1]})
        teacher = full[0].gather(1, seq[0, 1:, None]).sum().item()
        assert lp == pytest.approx(teacher, abs=1e-4)  # a forced EOS (max_len) counts the model's own value
    # the same generator seed draws the same captions
    again = m.sample(batch, num_samples=3, max_len=6, generator=torch.Generator().manual_seed(1))
    assert again["tokens"] == out["tokens"]


# --- the weighted loss and the batch of drawn captions -----------------------------------------
def test_sequence_weights_weight_each_caption_token_log_probability():
    m = tiny(**NO_DROPOUT).eval()
    batch = image_batch(B=3)
    plain = m(batch)["loss"]
    ones = m({**batch, "sequence_weights": torch.ones(3)})["loss"]
    torch.testing.assert_close(ones, plain)
    w = torch.tensor([0.5, -2.0, 0.0])
    lp = m.log_probs(batch)
    tgt = batch["caption"][:, 1:]
    per_caption = lp.gather(2, tgt[..., None]).squeeze(-1).sum(1)
    expect = -(w * per_caption).sum() / tgt.numel()
    torch.testing.assert_close(m({**batch, "sequence_weights": w})["loss"], expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(TellkitError, match="sequence_weights"):
        m({**batch, "sequence_weights": torch.ones(2)})


def _critic(baseline="mean", samples=4, refs=None):
    cfg = SelfCriticalConfig(samples=samples, max_len=5, baseline=baseline)
    refs = refs or [["w5 w6 w7", "w5 w6"], ["w8 w9"]]
    return SelfCritical(cfg, CiderD(refs), words, bos_id=BOS, eos_id=EOS, pad_id=PAD,
                        encode=lambda text: [int(w[1:]) for w in text.split()],
                        generator=torch.Generator().manual_seed(0)), refs


@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_the_batch_of_drawn_captions(baseline):
    m = tiny(**NO_DROPOUT).train()
    critic, refs = _critic(baseline)
    batch = {**image_batch(B=2), "references": refs}
    out = critic.batch(m, batch)
    assert m.training  # the greedy baseline's eval mode is undone
    cap, w = out["caption"], out["sequence_weights"]
    assert cap.shape[0] == 8 and w.shape == (8,)
    assert bool((cap[:, 0] == BOS).all())
    for row in cap.tolist():  # BOS, tokens, EOS, then padding only
        end = row.index(EOS)
        assert set(row[end + 1:]) <= {PAD} and PAD not in row[:end]
    torch.testing.assert_close(out["image"], batch["image"].repeat_interleave(4, 0))
    assert out["references"] == [refs[0]] * 4 + [refs[1]] * 4 and out["ids"][:5] == ["i0"] * 4 + ["i1"]
    drawn = [[t for t in row[1:row.index(EOS)]] for row in cap.tolist()]
    rewards = torch.tensor(critic.score(drawn, out["references"])).view(2, 4)
    if baseline == "mean":  # each caption against the mean of the image's other three
        expect = rewards - (rewards.sum(1, keepdim=True) - rewards) / 3
        torch.testing.assert_close(w.view(2, 4).sum(1), torch.zeros(2), atol=1e-5, rtol=0)
    else:
        greedy = m.eval().generate(batch, max_len=5, beam_size=1)["tokens"]
        expect = rewards - torch.tensor(critic.score(greedy, refs))[:, None]
    torch.testing.assert_close(w.view(2, 4), expect, atol=1e-5, rtol=1e-5)
    stats = critic.take_stats()
    assert stats["reward"] == pytest.approx(float(rewards.mean()), abs=1e-5) and critic.take_stats() == {}
    assert ("baseline" in stats) == (baseline == "greedy")
    loss = m.train()(out)["loss"]
    loss.backward()
    assert torch.isfinite(loss)


def test_self_critical_training_raises_the_reward():
    """A few hundred drawn captions of a tiny model: the mean CIDEr-D reward of what it draws
    goes up when the weighted loss is minimised."""
    m = tiny(**NO_DROPOUT).train()
    refs = [["w5 w6 w7"], ["w8 w9 w10"]]
    critic = SelfCritical(SelfCriticalConfig(samples=8, max_len=4), CiderD(refs), words, bos_id=BOS, eos_id=EOS,
                          pad_id=PAD, generator=torch.Generator().manual_seed(0))
    batch = {**image_batch(B=2), "references": refs}
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    curve = []
    for _ in range(60):
        out = critic.batch(m, batch)
        opt.zero_grad()
        m(out)["loss"].backward()
        opt.step()
        curve.append(critic.take_stats()["reward"])
    early, late = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    assert late > early + 1.0, (early, late)


def test_a_model_that_cannot_draw_is_refused():
    critic, refs = _critic()
    with pytest.raises(TellkitError, match="cannot draw"):
        critic.batch(torch.nn.Linear(2, 2), {**image_batch(), "references": refs})


# --- the recipe section ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad,match", [({"baseline": "best"}, "baseline"), ({"samples": 1}, "samples"),
                                       ({"max_len": 0}, "min_len"), ({"temperature": 0}, "temperature"),
                                       ({"xe_weight": -1}, "xe_weight"), ({"xe_weight": 1.0}, "xe_weight"),
                                       ({"sample": 5}, "unknown key")])
def test_scst_section_is_checked(bad, match):
    with pytest.raises(TellkitError, match=match):
        section({"scst": bad}, "scst", SelfCriticalConfig)
    assert section({"scst": {"samples": 1, "baseline": "greedy"}}, "scst", SelfCriticalConfig).samples == 1


def test_a_task_that_does_not_read_scst_refuses_it(tmp_path):
    from tellkit.config import load_yaml
    from tellkit.tasks import make_task

    recipe = load_yaml(ROOT / "configs" / "bttr" / "crohme.yaml")
    with pytest.raises(TellkitError, match="'scst' section"):
        make_task({**recipe, "scst": {}})


def _cli(*argv):
    from tellkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.data
@pytest.mark.slow
def test_scst_recipe_trains_through_the_cli(tmp_path, shared_data):
    """The shipped self-critical recipe, with a tiny model and a few Flickr8k photos, through
    `tellkit train`: captions drawn per training photo, the reward logged, a checkpoint saved."""
    recipe = {"base": str(ROOT / "configs" / "tat" / "flickr8k_scst.yaml"),
              "model": {"d_model": 16, "num_heads": 2, "ffn_dim": 32, "kernel_sizes": [3, 3], "num_layers": 2,
                        "adaptive_factor": 2.0},
              "encoders": {"image": "mobilenet_v2"},
              "data": {"root": str(shared_data / "flickr8k"), "features": str(tmp_path / "feat"),
                       "limit": {"train": 10, "val": 5, "test": 5}},
              "train": {"init_from": None, "batch_size": 2, "log_every": 1},
              "eval": {"metrics": ["bleu", "cider"], "max_len": 8}}
    path = tmp_path / "scst.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    run = tmp_path / "run"
    rc, stdout, err = _cli("train", path, "train.max_steps=2", "--out", run, "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert json.loads(stdout[stdout.index("{"):])["steps"] == 2
    assert " reward " in stdout  # the log lines: mean reward of the drawn captions
    cfg = json.loads((run / "checkpoints" / "last" / "config.json").read_text(encoding="utf-8"))
    assert cfg["config"]["d_model"] == 16


def test_xe_weight_adds_every_reference_caption():
    """With ``xe_weight`` every reference of every image joins the batch (the mixed loss itself
    is re-stated in tests/test_sat_reference.py)."""
    m = tiny(**NO_DROPOUT).eval()
    critic, refs = _critic()
    critic.cfg.xe_weight = 0.5
    batch = {**image_batch(B=2), "references": refs}
    mixed = critic.batch(m, batch)
    assert mixed["caption"].size(0) == 8 + 3 and mixed["references"][8:] == [refs[0], refs[0], refs[1]]
    assert mixed["caption"][8:, :4].tolist() == [[BOS, 5, 6, 7], [BOS, 5, 6, EOS], [BOS, 8, 9, EOS]]
    torch.testing.assert_close(mixed["image"][8:], batch["image"][[0, 0, 1]])
    with pytest.raises(TellkitError, match="xe_weight"):
        SelfCritical(SelfCriticalConfig(xe_weight=0.5), CiderD(refs), words, bos_id=BOS, eos_id=EOS, pad_id=PAD)


# --- Show, Attend and Tell draws and weights the same way ---------------------------------------
def tiny_sat(**kw):
    torch.manual_seed(0)
    return tellkit.create_model("show_attend_tell", vocab_size=99, image_dim=16, embed_dim=16, hidden_dim=14,
                                attention_dim=10, dropout=0.0, doubly_stochastic=0.0, adaptive_cutoffs=[20, 50],
                                **kw)


def _sat_caption_log_prob(m, batch, b, toks):
    """log p(toks + EOS | image b) from the model's teacher-forced loss."""
    one = {"caption": torch.tensor([[BOS, *toks, EOS]]), "image": batch["image"][b:b + 1],
           "image_mask": batch["image_mask"][b:b + 1]}
    out = m(one)
    return -(out["loss"] * out["ntokens"]).item()


def test_show_attend_tell_draws_captions_with_their_log_probability():
    m = tiny_sat().eval()
    batch = image_batch()
    out = m.sample(batch, num_samples=3, max_len=6, generator=torch.Generator().manual_seed(1))
    assert len(out["tokens"]) == 6 and all(len(t) <= 5 for t in out["tokens"])
    assert len({tuple(t) for t in out["tokens"]}) > 1  # drawn, not searched
    for row, (toks, lp) in enumerate(zip(out["tokens"], out["log_probs"])):
        assert lp == pytest.approx(_sat_caption_log_prob(m, batch, row // 3, toks), abs=1e-4)
    again = m.sample(batch, num_samples=3, max_len=6, generator=torch.Generator().manual_seed(1))
    assert again["tokens"] == out["tokens"]
    with pytest.raises(TellkitError, match="soft attention"):
        tiny_sat(attention="hard").sample(batch)


def test_show_attend_tell_weights_each_caption():
    m = tiny_sat().eval()
    batch = image_batch(B=3)
    torch.testing.assert_close(m({**batch, "sequence_weights": torch.ones(3)})["loss"], m(batch)["loss"])
    w = torch.tensor([0.5, -2.0, 0.0])
    per = torch.tensor([_sat_caption_log_prob(m, batch, b, batch["caption"][b, 1:-1].tolist()) for b in range(3)])
    expect = -(w * per).sum() / batch["caption"][:, 1:].numel()
    torch.testing.assert_close(m({**batch, "sequence_weights": w})["loss"], expect, atol=1e-5, rtol=1e-5)
    with pytest.raises(TellkitError, match="sequence_weights"):
        m({**batch, "sequence_weights": torch.ones(2)})
    # one self-critical batch trains it: drawn captions, weights, a finite loss with gradients
    critic, refs = _critic("greedy")
    m.train()
    out = critic.batch(m, {**image_batch(B=2), "references": refs})
    loss = m(out)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and m.embed.weight.grad is not None
