"""The baselines on tiny configs (made-up context features, no weights): Show and Tell,
Show-Attend-and-Tell, the LSTM captioner of Transform and Tell's ablation rows, the Bahdanau
seq2seq, and the static word vectors."""
from __future__ import annotations

import pytest
import torch

from tellkit.errors import TellkitError
from tellkit.registry import create_model

V = 99
NO_DROP = dict(dropout=0.0)
TINY = {
    "show_tell": dict(vocab_size=V, image_dim=16, embed_dim=12, hidden_dim=12),
    "show_tell_adaptive": dict(vocab_size=V, image_dim=16, embed_dim=16, hidden_dim=16, adaptive_cutoffs=[20, 50],
                               adaptive_factor=2.0),
    "show_attend_tell": dict(vocab_size=V, image_dim=16, embed_dim=12, hidden_dim=14, attention_dim=10),
    "show_attend_tell_adaptive": dict(vocab_size=V, image_dim=16, embed_dim=16, hidden_dim=14, attention_dim=10,
                                      adaptive_cutoffs=[20, 50], adaptive_factor=2.0, adaptive_input=True),
    # the authors' code's choices (arctic-captions): tanh deep output, zero first input, batch-normalised penalty
    "show_attend_tell_code": dict(vocab_size=V, image_dim=16, embed_dim=16, hidden_dim=14, attention_dim=10,
                                  adaptive_cutoffs=[20, 50], adaptive_factor=2.0, adaptive_input=True,
                                  deep_output_tanh=True, first_input="zeros", doubly_stochastic_norm="batch"),
    "lstm_captioner": dict(vocab_size=V, image_dim=16, article_dim=24, article_layers=3, face_dim=8, object_dim=12,
                           embed_dim=16, hidden_dim=20, num_layers=2, adaptive_cutoffs=[20, 50],
                           contexts=["image", "article", "faces"]),
}


def tiny(key: str, **kw):
    torch.manual_seed(0)
    family = key.removesuffix("_adaptive").removesuffix("_code")
    return create_model(family, **{**TINY[key], **kw})


def make_batch(B=3, T=9, seed=0, n_img=5, n_art=7):
    g = torch.Generator().manual_seed(seed)
    cap = torch.randint(3, V, (B, T), generator=g)
    cap[:, 0] = 0
    cap[:, -1] = 2
    cap[1, -3:] = 1  # a shorter caption: EOS then padding
    cap[1, -4] = 2
    return {
        "caption": cap,
        "image": torch.randn(B, n_img, 16, generator=g), "image_mask": torch.ones(B, n_img, dtype=torch.bool),
        "article": torch.randn(B, 3, n_art, 24, generator=g),
        "article_mask": torch.tensor([[1] * n_art, [1] * 4 + [0] * (n_art - 4), [1] * n_art]).bool(),
        "faces": torch.randn(B, 2, 8, generator=g), "faces_mask": torch.tensor([[1, 1], [0, 0], [1, 0]]).bool(),
        "objects": torch.randn(B, 3, 12, generator=g), "objects_mask": torch.ones(B, 3, dtype=torch.bool),
    }


def select(batch, i):
    return {k: v[i:i + 1] for k, v in batch.items()}


def seq_log_prob(model, batch, tokens):
    """log p(tokens + EOS) under teacher forcing, through the model's own loss."""
    cap = torch.tensor([[0, *tokens, 2]])
    out = model({**batch, "caption": cap})
    return -float(out["loss"]) * int(out["ntokens"]) if "attention_reg" not in out else None


CAPTIONERS = ["show_tell", "show_tell_adaptive", "show_attend_tell", "show_attend_tell_adaptive",
              "show_attend_tell_code", "lstm_captioner"]


def test_show_attend_tell_adaptive_input_is_banded_and_smaller():
    """``adaptive_input``: the embedding in the softmax's bands (16, 8, 4 wide here), projected
    to embed_dim; far fewer numbers than one dense table at RoBERTa's vocabulary size."""
    from tellkit.layers.adaptive import AdaptiveInput

    m = tiny("show_attend_tell_adaptive")
    assert isinstance(m.embed, AdaptiveInput)
    assert [e.embedding_dim for e in m.embed.embeddings] == [16, 8, 4]
    assert float(m.embed(torch.tensor([1])).detach().abs().max()) == 0.0  # padding embeds to zero
    big = dict(vocab_size=50265, image_dim=1280, embed_dim=512, hidden_dim=512, attention_dim=512,
               adaptive_cutoffs=[5000, 20000], adaptive_factor=4.0)
    dense = sum(p.numel() for p in create_model("show_attend_tell", **big).embed.parameters())
    banded = sum(p.numel() for p in create_model("show_attend_tell", **big, adaptive_input=True).embed.parameters())
    assert dense == 50265 * 512 and banded < dense // 4


@pytest.mark.parametrize("key", CAPTIONERS)
def test_forward_backward_reaches_every_parameter(key):
    m = tiny(key)
    out = m(make_batch())
    assert torch.isfinite(out["loss"]) and int(out["ntokens"]) == 3 * 8 - 3
    out["loss"].backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("key", CAPTIONERS)
def test_greedy_scores_equal_teacher_forced_log_probs(key):
    """Incremental decoding (with rows dropped as they finish) = full recomputation."""
    kw = {"doubly_stochastic": 0.0} if key.startswith("show_attend_tell") else {}
    m = tiny(key, **NO_DROP, **kw).eval()
    b = make_batch()
    with torch.no_grad():
        out = m.generate(b, max_len=7)
        assert len(out["tokens"]) == 3
        for i, (toks, score) in enumerate(zip(out["tokens"], out["scores"])):
            # also at max_len: the forced last EOS is scored with the model's own log p(EOS)
            lp = seq_log_prob(m, select(b, i), toks)
            assert score == pytest.approx(lp / (len(toks) + 1), abs=1e-4)


@pytest.mark.parametrize("key", CAPTIONERS)
def test_beam_search_finds_at_least_the_greedy_log_prob(key):
    m = tiny(key, **NO_DROP).eval()
    b = make_batch()
    g = m.generate(b, max_len=6)
    k = m.generate(b, max_len=6, beam_size=4, length_penalty=0.0, n_best=2)
    for gs, gt, ks in zip(g["scores"], g["tokens"], k["scores"]):
        assert ks >= gs * (len(gt) + 1) - 1e-4  # length_penalty 0: raw sum of log-probs
    assert all(len(n) == 2 for n in k["n_best"])


def favour_eos(m):
    """Make EOS likely after odd tokens, so that rows finish at different steps and the search
    drops / reorders rows of the incremental state (the boost depends on the history only)."""
    step = m._search_step

    def boosted(last, state):
        lp, state = step(last, state)
        lp = lp.clone()
        lp[:, 2] += 8.0 * (last % 2 == 1).float()
        return torch.log_softmax(lp, dim=-1), state

    m._search_step = boosted
    return m


@pytest.mark.parametrize("key", CAPTIONERS)
@pytest.mark.parametrize("beam", [1, 3])
def test_batched_generation_equals_one_by_one(key, beam):
    m = favour_eos(tiny(key, **NO_DROP).eval())
    b = make_batch(B=3)
    b["image"] = b["image"] * 30  # untrained models barely look at the inputs: make them differ
    together = m.generate(b, max_len=8, beam_size=beam)
    lengths = {len(t) for t in together["tokens"]}
    for i in range(3):
        alone = m.generate(select(b, i), max_len=8, beam_size=beam)
        assert alone["tokens"][0] == together["tokens"][i]
        assert alone["scores"][0] == pytest.approx(together["scores"][i], abs=1e-5)
    assert len(lengths) > 1 or beam > 1  # greedy rows really ended at different steps


@pytest.mark.parametrize("key", CAPTIONERS)
def test_save_load_round_trip(tmp_path, key):
    m = tiny(key).eval()
    m.save_pretrained(tmp_path / key)
    m2 = type(m).from_pretrained(tmp_path / key).eval()
    b = make_batch()
    assert torch.equal(m(b)["loss"], m2(b)["loss"])
    assert m.generate(b, max_len=5)["tokens"] == m2.generate(b, max_len=5)["tokens"]


@pytest.mark.parametrize("key", ["show_tell", "show_attend_tell", "lstm_captioner"])
def test_padded_context_entries_are_ignored(key):
    m = tiny(key, **NO_DROP).eval()
    b = make_batch()
    b["image_mask"][0, 3:] = False
    noisy = {k: v.clone() for k, v in b.items()}
    noisy["image"][0, 3:] = 1e3
    noisy["article"][1, :, 4:] = -1e3  # padding of sample 1's article
    assert torch.allclose(m(b)["loss"], m(noisy)["loss"], atol=1e-5)


def test_show_attend_tell_doubly_stochastic_regulariser_by_hand():
    m = tiny("show_attend_tell", **NO_DROP).eval()
    b = make_batch()
    b["image_mask"][2, 4:] = False
    with torch.no_grad():
        plain = m.__class__(m.config.__class__(**{**m.config.__dict__, "doubly_stochastic": 0.0}))
        plain.load_state_dict(m.state_dict())
        inp, target = b["caption"][:, :-1], b["caption"][:, 1:]
        _, alpha, valid = m.teacher_forced(b, inp)
        mask = target != 1
        total = (alpha * mask[..., None]).sum(1)
        reg = (((1 - total) ** 2) * valid).sum()
        n = mask.sum()
        assert float(m(b)["loss"]) == pytest.approx(float(plain(b)["loss"]) + float(reg) / float(n), rel=1e-5)
        assert float(m(b)["attention_reg"]) == pytest.approx(float(reg) / float(n), rel=1e-5)
        # attention is a distribution over the real grid cells, zero on padding
        assert torch.allclose(alpha.sum(-1), torch.ones_like(alpha.sum(-1)), atol=1e-5)
        assert float(alpha[2, :, 4:].abs().max()) == 0.0


def test_show_attend_tell_attention_for_visualisation():
    m = tiny("show_attend_tell", **NO_DROP).eval()
    b = make_batch()
    b["image_mask"][1, 2:] = False
    out = m.generate(b, max_len=5, return_attention=True)
    for toks, att in zip(out["tokens"], out["attention"]):
        assert len(att) == len(toks) + 1
    assert all(len(step["image"]) == 2 for step in out["attention"][1])
    assert sum(out["attention"][0][0]["image"]) == pytest.approx(1.0, abs=1e-5)


def test_lstm_captioner_last_layer_vs_weighted_mix_and_empty_faces():
    b = make_batch()
    last = tiny("lstm_captioner", article_layers=1, **NO_DROP).eval()
    changed = {k: v.clone() for k, v in b.items()}
    changed["article"][:, :2] += 5.0  # lower layers: invisible to a last-layer reader
    assert torch.equal(last(b)["loss"], last(changed)["loss"])
    mixed = tiny("lstm_captioner", **NO_DROP).eval()
    assert not torch.allclose(mixed(b)["loss"], mixed(changed)["loss"])
    # static vectors come as [B, L, C]: the same as a one-layer stack
    flat = {**b, "article": b["article"][:, -1]}
    assert torch.equal(last(b)["loss"], last(flat)["loss"])
    # sample 1 has no faces at all: finite loss, and attention over faces is empty
    out = last.generate(b, max_len=4, return_attention=True)
    assert all(step["faces"] == [] for step in out["attention"][1])
    assert torch.isfinite(last(b)["loss"])


def test_lstm_captioner_reads_only_its_contexts_and_rejects_bad_shapes():
    m = tiny("lstm_captioner", contexts=["image", "objects"])
    b = make_batch()
    del b["article"], b["faces"]
    assert torch.isfinite(m(b)["loss"])
    with pytest.raises(TellkitError, match="objects"):
        m({**b, "objects": torch.randn(3, 3, 5)})
    with pytest.raises(TellkitError, match="no 'objects'"):
        m({k: v for k, v in b.items() if k != "objects"})


def test_configs_validate():
    with pytest.raises(TellkitError):
        create_model("show_tell", contexts=["image", "article"])
    with pytest.raises(TellkitError):
        create_model("lstm_captioner", contexts=["image", "video"])
    with pytest.raises(TellkitError):
        create_model("show_tell", tie_embeddings=True, embed_dim=8, hidden_dim=16)


def test_show_tell_learns_a_fixed_caption():
    """A few optimizer steps drive the loss down and greedy decoding then writes the caption."""
    torch.manual_seed(0)
    m = tiny("show_tell", **NO_DROP)
    b = make_batch()
    b["caption"] = torch.tensor([[0, 5, 6, 7, 2]] * 3)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        opt.zero_grad()
        loss = m(b)["loss"]
        first = first if first is not None else float(loss.detach())
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05 * first
    assert m.eval().generate(b, max_len=8)["tokens"] == [[5, 6, 7]] * 3


# --- seq2seq (Bahdanau) --------------------------------------------------------------------
def s2s(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, pad_id=1, bos_id=0, eos_id=2, embed_dim=8, hidden_dim=10, attention_dim=6, maxout_dim=4,
               dropout=0.0, backbone="unused")
    return create_model("seq2seq", **{**cfg, **kw})


def s2s_batch():
    ids = torch.tensor([[0, 5, 6, 7, 8, 2], [0, 9, 10, 2, 1, 1]])
    labels = torch.tensor([[0, 11, 12, 13, 2], [0, 14, 2, -100, -100]])
    return {"input_ids": ids, "attention_mask": (ids != 1).long(), "labels": labels}


def test_seq2seq_loss_generation_and_padding_invariance():
    m = s2s().eval()
    b = s2s_batch()
    out = m(b)
    assert int(out["ntokens"]) == 4 + 2  # leading BOS dropped from the targets, -100 ignored
    out["loss"].backward()
    assert not [n for n, p in m.named_parameters() if p.grad is None]
    # more padding on the source changes nothing
    wide = {"input_ids": torch.cat([b["input_ids"], torch.ones(2, 3, dtype=torch.long)], 1)}
    wide["attention_mask"] = (wide["input_ids"] != 1).long()
    wide["labels"] = b["labels"]
    assert torch.allclose(m(b)["loss"], m(wide)["loss"], atol=1e-6)
    g = m.generate(b, max_len=5)
    for i, (toks, score) in enumerate(zip(g["tokens"], g["scores"])):
        sub = {k: v[i:i + 1] for k, v in b.items()}
        sub["labels"] = torch.tensor([[0, *toks, 2]])
        o = m(sub)
        assert score == pytest.approx(-float(o["loss"].detach()), abs=1e-4)
    assert m.generate(b, max_len=5, beam_size=3)["tokens"][0] is not None


def test_seq2seq_takes_vocabulary_from_the_tokenizer(tmp_path):
    from tellkit.encoders.tokenizer import CaptionTokenizer

    folder = CaptionTokenizer.load().save_pretrained(tmp_path / "tok")
    with torch.device("meta"):
        m = create_model("seq2seq", backbone=str(folder), embed_dim=4, hidden_dim=4, attention_dim=4, maxout_dim=2)
    assert (m.config.vocab_size, m.config.pad_id, m.config.bos_id, m.config.eos_id) == (50265, 1, 0, 2)
    assert list(m.new_parameters()) == []


# --- static word vectors -----------------------------------------------------------------------
def test_glove_reader_lowercases_drops_unknown_words_and_skips_header(tmp_path):
    from tellkit.encoders.static_vectors import StaticVectors, load_article_vectors

    f = tmp_path / "glove.txt"
    f.write_text("4 3\nthe 0.1 0.2 0.3\nObama 1 2 3\nobama 9 9 9\n, 0 0 1\nsaid -1 -2 -3\n", encoding="utf-8")
    v = StaticVectors.from_glove(f)
    assert len(v) == 4 and v.dim == 3 and v.words == ["the", "obama", ",", "said"]
    out = v.encode(["Obama, the Zyxw senator, said", "nothing known here"])
    assert out["hidden"].shape == (2, 1, 5, 3)
    assert out["tokens"][0] == ["obama", ",", "the", ",", "said"]  # 'Zyxw' and 'senator' dropped
    assert out["tokens"][1] == [] and not out["mask"][1].any()
    assert torch.equal(out["hidden"][0, 0, 0], torch.tensor([1.0, 2.0, 3.0]))  # the first 'obama' line wins
    assert out["offsets"][0][0] == (0, 5)
    assert v.count_tokens("The cat said") == 2
    assert load_article_vectors(f"glove:{f}").words == v.words
    assert len(StaticVectors.from_glove(f, vocabulary=["said"])) == 1
    with pytest.raises(TellkitError):
        load_article_vectors("word2vec:x")
    bad = tmp_path / "bad.txt"
    bad.write_text("the 0.1 x\n", encoding="utf-8")
    with pytest.raises(TellkitError):
        StaticVectors.from_glove(bad)


def test_offline_static_table_is_the_text_encoders_input_embeddings():
    from safetensors import safe_open

    from tellkit.encoders import weights as W
    from tellkit.encoders.static_vectors import StaticVectors

    v = StaticVectors.from_text_encoder()
    assert v.dim == 384 and 20_000 < len(v) < 30_522 and v.lowercase
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(W.minilm_dir()))
    with safe_open(str(W.minilm_dir() / "model.safetensors"), "pt") as f:
        table = f.get_tensor("embeddings.word_embeddings.weight")
    out = v.encode(["The mayor of Qwzxv said"])
    assert out["tokens"][0] == ["the", "mayor", "of", "said"]  # the unknown word is dropped, not split
    for j, w in enumerate(out["tokens"][0]):
        assert torch.equal(out["hidden"][0, 0, j], table[tok.convert_tokens_to_ids(w)])
    ids = v.caption_ids(["The mayor of Qwzxv said"], out["offsets"])
    from tellkit.encoders.tokenizer import CaptionTokenizer

    ct = CaptionTokenizer.load()
    assert ids[0, 1].item() == ct.encode(" mayor")[0]


def test_captioning_task_reads_the_contexts_of_the_model_family():
    """A recipe that does not list `model.contexts` gets its family's default, so Show and Tell
    is not fed articles and faces it cannot read."""
    from tellkit.tasks.captioning import CaptioningTask

    assert CaptioningTask({"task": "caption", "model": {"name": "show_tell"}}).contexts == ("image",)
    assert CaptioningTask({"task": "caption", "model": {"name": "lstm_captioner"}}).contexts == ("image", "article")
    tat = {"task": "caption", "model": {"name": "transform_and_tell"}}
    assert CaptioningTask(tat).contexts == ("image", "article", "faces")
    tat_article = {"task": "caption", "model": {"name": "transform_and_tell", "contexts": ["article"]}}
    assert CaptioningTask(tat_article).contexts == ("article",)


# --- Show, Attend and Tell: hard (stochastic) attention ----------------------------------------
def test_hard_attention_reads_one_location_and_the_estimator_by_hand():
    """Every image draws (expected_context_prob 0): each step reads one grid vector; the loss is
    the NLL plus -lambda_r (log p(y|s) - b) sum_t log p(s_t) - lambda_e sum_t H_t, per token."""
    m = tiny("show_attend_tell", attention="hard", expected_context_prob=0.0, entropy_weight=0.1, **NO_DROP).train()
    b = make_batch()
    inp, target = b["caption"][:, :-1], b["caption"][:, 1:]
    mask = target != 1
    seen = []
    real_bmm = torch.bmm

    def spy(x, y):  # the weights each step multiplies the grid with
        if x.dim() == 3 and x.size(1) == 1 and y.size(1) == 5:
            seen.append(x.detach().squeeze(1))
        return real_bmm(x, y)

    torch.manual_seed(5)
    hard = {}
    try:
        torch.bmm = spy
        deep, alpha, _ = m.teacher_forced(b, inp, hard)
    finally:
        torch.bmm = real_bmm
    assert seen and all(bool(((w == 0) | (w == 1)).all()) and bool((w.sum(-1) == 1).all()) for w in seen)
    assert hard["draws"].all() and hard["logp"].shape == mask.shape
    # the same draws again (same seed): the forward's loss equals the estimator written out
    torch.manual_seed(5)
    m.reward_baseline.fill_(-3.0)
    m.baseline_started.fill_(True)
    out = m(b)
    lp = torch.zeros(mask.shape)
    lp[mask] = m.out.target_log_probs(deep[mask], target[mask]).detach()
    reward = lp.sum(1)
    surrogate = (-1.0 * ((reward + 3.0) * (hard["logp"] * mask).sum(1)).sum()
                 - 0.1 * (hard["entropy"] * mask).sum())
    n = mask.sum()
    assert float(out["loss"].detach()) == pytest.approx(float(((-lp.sum() + surrogate) / n).detach()), rel=1e-4)
    # the baseline moved toward the mean reward: b = 0.9 * (-3) + 0.1 * mean(log p(y|s))
    assert float(m.reward_baseline) == pytest.approx(0.9 * -3.0 + 0.1 * float(reward.mean()), rel=1e-4)


def test_hard_attention_gradient_reaches_the_attention_through_reinforce():
    """Every image draws and there is no entropy term: the one-hot reads carry no gradient to the
    attention scores, so their gradient is the REINFORCE term's alone."""
    m = tiny("show_attend_tell", attention="hard", expected_context_prob=0.0, entropy_weight=0.0, **NO_DROP).train()
    m(make_batch())["loss"].backward()
    assert float(m.att_score.weight.grad.abs().sum()) > 0  # no path but the REINFORCE term
    soft = tiny("show_attend_tell", **NO_DROP).train()
    assert "reward_baseline" not in soft.state_dict()  # soft checkpoints are unchanged


def test_hard_attention_half_the_images_read_the_expected_context_and_search_is_deterministic():
    m = tiny("show_attend_tell", attention="hard", **NO_DROP).train()
    torch.manual_seed(0)
    b = make_batch(B=64)
    hard = {}
    m.teacher_forced(b, b["caption"][:, :-1], hard)
    assert 16 < int(hard["draws"].sum()) < 48  # about half draw, the rest read alpha
    m.eval()
    one, two = m.generate(b, max_len=5), m.generate(b, max_len=5)
    assert one["tokens"] == two["tokens"]  # generation reads the expected context
    with pytest.raises(Exception, match="attention must be"):
        tiny("show_attend_tell", attention="sharp")
