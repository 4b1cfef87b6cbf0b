"""Transform and Tell: the model on tiny configs (made-up context features, no weights)."""
import json
import subprocess
import sys

import pytest
import torch

import tellkit
from tellkit.errors import TellkitError
from tellkit.models.transform_and_tell import TransformAndTell, TransformAndTellConfig, _Incremental

NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, input_dropout=0.0, weight_dropout=0.0)
TINY = dict(vocab_size=99, adaptive_cutoffs=[20, 50])


def tiny(**kw):
    torch.manual_seed(0)
    return tellkit.create_model("tat/tiny", **{**TINY, **kw})


def make_batch(B=3, T=9, n_img=5, n_art=7, n_faces=2, n_obj=3, seed=0, vocab=99):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(3, vocab, (B, T), generator=g)
    cap[:, 0] = 0
    cap[:, -1] = 2
    return {
        "caption": cap,
        "image": torch.randn(B, n_img, 16, generator=g), "image_mask": torch.ones(B, n_img, dtype=torch.bool),
        "article": torch.randn(B, 3, n_art, 24, generator=g), "article_mask": torch.ones(B, n_art, dtype=torch.bool),
        "article_ids": torch.randint(-1, vocab, (B, n_art), generator=g),
        "faces": torch.randn(B, n_faces, 8, generator=g), "faces_mask": torch.ones(B, n_faces, dtype=torch.bool),
        "objects": torch.randn(B, n_obj, 12, generator=g), "objects_mask": torch.ones(B, n_obj, dtype=torch.bool),
    }


def select(batch, i):
    return {k: v[i:i + 1] for k, v in batch.items()}


@pytest.mark.parametrize("contexts", [["image"], ["article"], ["image", "article", "faces"],
                                      ["image", "article", "faces", "objects"], ["faces", "objects"]])
def test_forward_backward_every_context_combination(contexts):
    m = tiny(contexts=contexts)
    out = m(make_batch())
    assert torch.isfinite(out["loss"]) and out["ntokens"].item() == 3 * 8
    out["loss"].backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing


def test_copy_head_trains_and_copies_only_from_input():
    m = tiny(copy=True, **NO_DROPOUT).eval()
    b = make_batch()
    out = m(b)
    out["loss"].backward()
    assert m.copy_head.gate.weight.grad is not None
    lp = m.log_probs(b)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(lp.shape[:2]), atol=1e-4, rtol=0)
    # with no copyable article token the copy model is exactly its vocabulary distribution
    b2 = dict(b, article_ids=torch.full_like(b["article_ids"], -1))
    h_ctx = m.project_contexts(m.encode_contexts(b2))
    h, _ = m.decode(b2["caption"][:, :-1], h_ctx)
    torch.testing.assert_close(m.log_probs(b2), m.softmax.log_probs(h), atol=1e-5, rtol=0)
    # copying raises the probability of article tokens (those ids only)
    ids = b["article_ids"][0]
    contexts = m.project_contexts(m.encode_contexts(select(b, 0)))
    vocab_lp = m.softmax.log_probs(m.decode(b["caption"][:1, :-1], contexts)[0])[0]
    gain = lp[0] - vocab_lp
    in_article = torch.zeros(99, dtype=torch.bool)
    in_article[ids[ids >= 0]] = True
    assert (gain[:, in_article].max() > 0) and (gain[:, ~in_article] <= 1e-6).all()


def test_incremental_decoding_equals_full_forward():
    for copy in (False, True):
        m = tiny(copy=copy, contexts=["image", "article", "faces", "objects"]).eval()
        b = make_batch(T=12)
        full = m.log_probs(b)
        inc = _Incremental(m, m.project_contexts(m.encode_contexts(b)))
        steps = torch.stack([inc.step(b["caption"][:, :t + 1]) for t in range(11)], 1)
        assert (steps - full).abs().max().item() < 1e-5


def test_padding_changes_nothing():
    m = tiny(**NO_DROPOUT).eval()
    b = make_batch(B=2)
    alone = m.log_probs(select(b, 0))
    # pad sample 0's contexts with junk entries marked invalid and its caption with <pad>
    padded = {k: v.clone() for k, v in select(b, 0).items()}
    padded["caption"] = torch.cat([padded["caption"], torch.ones(1, 4, dtype=torch.long)], 1)
    for name in ("image", "faces"):
        junk = torch.randn(1, 3, padded[name].size(-1)) * 100
        padded[name] = torch.cat([padded[name], junk], 1)
        padded[f"{name}_mask"] = torch.cat([padded[f"{name}_mask"], torch.zeros(1, 3, dtype=torch.bool)], 1)
    padded["article"] = torch.cat([padded["article"], torch.randn(1, 3, 4, 24) * 100], 2)
    padded["article_mask"] = torch.cat([padded["article_mask"], torch.zeros(1, 4, dtype=torch.bool)], 1)
    padded["article_ids"] = torch.cat([padded["article_ids"], torch.full((1, 4), 5)], 1)
    got = m.log_probs(padded)[:, : alone.size(1)]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert m(padded)["loss"].item() == pytest.approx(m(select(b, 0))["loss"].item(), abs=1e-5)


def test_empty_face_set():
    m = tiny(**NO_DROPOUT).eval()
    b = make_batch(n_faces=0)
    out = m(b)
    assert torch.isfinite(out["loss"])
    # all faces masked == no faces at all
    b2 = make_batch(n_faces=2)
    b2["faces_mask"][:] = False
    b2 = {**b2, "caption": b["caption"], "image": b["image"], "article": b["article"], "article_ids": b["article_ids"]}
    torch.testing.assert_close(m.log_probs(b2), m.log_probs(b), atol=1e-6, rtol=1e-6)
    gen = m.generate(b, max_len=5)
    assert len(gen["tokens"]) == 3


def test_bad_context_shapes_give_clear_errors():
    m = tiny()
    b = make_batch()
    with pytest.raises(TellkitError, match="image features must be"):
        m(dict(b, image=torch.randn(3, 5, 17)))
    with pytest.raises(TellkitError, match="no 'faces' context"):
        m({k: v for k, v in b.items() if k != "faces"})


def test_overfits_a_handful_of_examples():
    m = tiny(**NO_DROPOUT)
    b = make_batch(B=4, T=8)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        loss = m(b)["loss"]
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    # and greedy generation then reproduces the training captions
    m.eval()
    gen = m.generate(b, max_len=10)
    assert gen["tokens"] == b["caption"][:, 1:-1].tolist()


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_generation_equals_one_by_one(beam):
    m = tiny(copy=(beam == 3)).eval()
    b = make_batch(B=4)
    # ragged contexts: different numbers of valid regions / faces / article tokens per sample
    b["image_mask"][1, 3:] = False
    b["faces_mask"][2, :] = False
    b["article_mask"][3, 2:] = False
    kw = dict(max_len=8, beam_size=beam, no_repeat_ngram_size=2 if beam > 1 else 0)
    batched = m.generate(b, **kw)
    for i in range(4):
        one = m.generate(select(b, i), **kw)
        assert one["tokens"][0] == batched["tokens"][i]
        assert one["scores"][0] == pytest.approx(batched["scores"][i], abs=1e-4)


def test_folded_weights_give_the_same_captions_and_follow_parameter_updates(monkeypatch):
    from tellkit.layers.linear import GehringLinear

    m = tiny(gehring_linear=True).eval()
    lins = [x for x in m.modules() if isinstance(x, GehringLinear) and x.weight_norm]
    assert lins
    with torch.no_grad():  # magnitudes away from ||v||, so the folded weight differs from v
        for lin in lins:
            lin.weight_g.mul_(torch.rand_like(lin.weight_g) + 0.5)
    b = make_batch(B=3)
    kw = dict(max_len=8, beam_size=2)
    folded = m.generate(b, **kw)
    assert all(lin._folded is not None for lin in lins)
    with torch.no_grad():
        lp_folded = m.log_probs(b)
    # the unfolded path: recompute g * v / ||v|| at every call (as before folding existed)
    with monkeypatch.context() as mp:
        mp.setattr(GehringLinear, "_fold_is_current", staticmethod(lambda *a: False))
        unfolded = m.generate(b, **kw)
        with torch.no_grad():
            lp_unfolded = m.log_probs(b)
    assert folded["tokens"] == unfolded["tokens"] and folded["scores"] == unfolded["scores"]
    torch.testing.assert_close(lp_folded, lp_unfolded, atol=0, rtol=0)
    # a parameter update after folding (an optimiser step on the eval-mode model) is used at once
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    m(b)["loss"].backward()  # eval mode, autograd on: the weights are computed fresh, gradients flow
    assert all(lin.weight_v.grad is not None and lin.weight_g.grad is not None for lin in lins)
    opt.step()
    with torch.no_grad():
        lp_after = m.log_probs(b)
        assert not torch.equal(lp_after, lp_folded)
        with monkeypatch.context() as mp:
            mp.setattr(GehringLinear, "_fold_is_current", staticmethod(lambda *a: False))
            torch.testing.assert_close(lp_after, m.log_probs(b), atol=0, rtol=0)


def test_beam_search_n_best_and_length_penalty():
    m = tiny().eval()
    out = m.generate(make_batch(B=2), max_len=6, beam_size=4, n_best=3, length_penalty=0.5)
    assert all(len(n) == 3 for n in out["n_best"])
    s = [x[1] for x in out["n_best"][0]]
    assert s == sorted(s, reverse=True)


def test_generate_returns_attention_per_token():
    m = tiny().eval()
    b = make_batch(B=2)
    b["faces_mask"][1, :] = False
    out = m.generate(b, max_len=6, return_attention=True)
    att = out["attention"]
    assert len(att[0]) == len(out["tokens"][0]) + 1
    first = att[0][0]
    assert len(first["image"]) == 5 and len(first["article"]) == 7 and len(first["faces"]) == 2
    assert att[1][0]["faces"] == []  # no valid faces: nothing to show
    assert 0 < sum(first["image"]) <= 1.0 + 1e-5


def test_save_load_round_trip(tmp_path):
    m = tiny(copy=True).eval()
    b = make_batch()
    m.save_pretrained(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "model.safetensors"]
    loaded = tellkit.load_model(tmp_path / "ckpt").eval()
    assert isinstance(loaded, TransformAndTell)
    torch.testing.assert_close(loaded.log_probs(b), m.log_probs(b), atol=0, rtol=0)
    assert loaded.generate(b, max_len=6)["tokens"] == m.generate(b, max_len=6)["tokens"]
    # tied weights stored once: the adaptive softmax owns no copy of the embeddings
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith("softmax.") and "embeddings" in k for k in keys)
    # a half-precision copy loads back as float32 and stays close
    m.save_pretrained(tmp_path / "half", dtype=torch.float16)
    half = TransformAndTell.from_pretrained(tmp_path / "half").eval()
    assert half.embed.embeddings[0].weight.dtype == torch.float32
    assert (half.log_probs(b) - m.log_probs(b)).abs().max() < 0.05


def test_loading_refuses_bad_checkpoints(tmp_path):
    import pickle

    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"family": "transform_and_tell", "config": {"d_model": 32}}))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (d / "model.safetensors").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(TellkitError):
        tellkit.load_model(d)
    assert not marker.exists()  # the pickle was never executed
    with pytest.raises(TellkitError, match="not found"):
        tellkit.load_model(tmp_path / "nope")
    (d / "config.json").write_text(json.dumps({"family": "no_such_model", "config": {}}))
    with pytest.raises(TellkitError, match="unknown model family"):
        tellkit.load_model(d)
    # weights from another config
    m = tiny()
    m.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    cfg["config"]["ffn_dim"] = 128
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TellkitError, match="shape"):
        tellkit.load_model(tmp_path / "ok")


def test_config_validation():
    with pytest.raises(TellkitError, match="kernel_sizes"):
        tellkit.create_model("tat/tiny", kernel_sizes=[3])
    with pytest.raises(TellkitError, match="unknown key"):
        tellkit.create_model("tat/tiny", not_a_field=1)
    with pytest.raises(TellkitError, match="contexts"):
        tellkit.create_model("tat/tiny", contexts=["image", "video"])
    cfg = TransformAndTellConfig(d_model=64, num_heads=4, ffn_dim=64, kernel_sizes=(3, 3, 3, 3), **TINY)
    assert isinstance(tellkit.create_model(cfg), TransformAndTell)
    assert tellkit.create_model("transform_and_tell", **TINY, d_model=32, num_heads=4, ffn_dim=32).config.d_model == 32


@pytest.mark.parametrize("config,expected", [("configs/tat/nytimes_faces.yaml", 171_068_441),
                                             ("configs/tat/nytimes_full.yaml", 200_461_337)])
def test_model_info_matches_reference_parameter_counts(config, expected):
    res = subprocess.run([sys.executable, "-m", "tellkit", "model-info", config],
                         capture_output=True, text=True, check=True)
    info = json.loads(res.stdout)
    assert info["trainable_params"] == expected  # exactly what the reference code counts
    assert info["total_params"] >= info["trainable_params"]
    b = info["breakdown"]
    assert abs(b["adaptive_input"] - 54.6e6) < 0.05e6 and abs(b["adaptive_softmax_own"] - 2.1e6) < 0.05e6
    assert b["article_layer_mix"] == 25


def test_model_info_bad_input_is_one_line():
    res = subprocess.run([sys.executable, "-m", "tellkit", "model-info", "configs/tat/nope.yaml"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
