"""Transform and Tell as the reference built it: positions, weight-normalised linears, layer-mix
init, the reference's adaptive loss as an option (tiny configs, made-up features)."""
import pytest
import torch

import tellkit
from tellkit.layers.linear import GehringLinear
from tellkit.layers.positional import sinusoidal_table

TINY = dict(vocab_size=99, adaptive_cutoffs=[20, 50])
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, input_dropout=0.0, weight_dropout=0.0)


def test_paper_recipe_uses_reference_layers():
    with torch.device("meta"):
        m = tellkit.create_model("tat/nytimes_full")
    cfg = m.config
    assert cfg.gehring_linear and cfg.position_start == 2 and cfg.reference_embedding_padding
    block = m.layers[0]
    for lin in (block.conv.linear1, block.conv.linear2, block.context_proj, block.fc1, block.fc2):
        assert isinstance(lin, GehringLinear) and lin.weight_norm
    assert not isinstance(block.conv.conv.weight_linear, GehringLinear)  # plain, as fairseq's


def test_positions_start_at_two_and_padding_gets_zero_encoding():
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", **TINY, **NO_DROPOUT).eval()
    assert m.config.position_start == 2
    tokens = torch.tensor([[0, 5, 7, 2, 1, 1]])  # <s> w w </s> <pad> <pad>
    x = m.embed_tokens(tokens)
    table = sinusoidal_table(16, m.config.d_model)
    words = m.embed(tokens) * m.embed_scale
    torch.testing.assert_close(x[0, :4], words[0, :4] + table[2:6])  # first token at position 2
    torch.testing.assert_close(x[0, 4:], words[0, 4:])  # padding: zero position encoding
    # one incremental step at caption position 3 sees the encoding of row 5
    torch.testing.assert_close(m.embed_tokens(tokens[:, 3:4], start=3)[0, 0], words[0, 3] + table[5])
    m0 = tellkit.create_model("tat/tiny", **TINY, position_start=0)
    torch.testing.assert_close(m0.embed_tokens(tokens)[0] - m0.embed(tokens)[0] * m0.embed_scale, table[:6])


def test_reference_adaptive_loss_option_changes_only_relative_pad_targets():
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", **TINY, **NO_DROPOUT).eval()
    ref = tellkit.create_model("tat/tiny", **TINY, **NO_DROPOUT, reference_adaptive_loss=True).eval()
    ref.load_state_dict(m.state_dict())
    g = torch.Generator().manual_seed(0)
    B, T = 2, 8
    b = {"caption": torch.randint(3, 99, (B, T), generator=g),
         "image": torch.randn(B, 5, 16, generator=g), "article": torch.randn(B, 3, 7, 24, generator=g),
         "faces": torch.randn(B, 2, 8, generator=g)}
    b["caption"][:, 0], b["caption"][:, -1] = 0, 2
    b["caption"][:, 1:-1] = 30  # no target at 21 / 51: the two losses agree
    assert torch.allclose(m(b)["loss"], ref(b)["loss"])
    b["caption"][:, 3] = 21  # 20 + 1: relative id 1 in the first tail
    assert ref(b)["loss"] < m(b)["loss"]  # the in-cluster term is dropped


def test_bad_position_start():
    with pytest.raises(tellkit.TellkitError, match="position_start"):
        tellkit.create_model("tat/tiny", **TINY, position_start=-1)


@pytest.mark.parametrize("name", ["tat/nytimes_faces", "tat/nytimes_full", "tat/goodnews"])
def test_paper_recipes_decode_greedily_for_100_steps(name):
    """The reference runs 100 greedy steps, any of which may be a word; tellkit's max_len counts
    the EOS it forces at the last step, so 101 gives the same 100 free steps."""
    from tellkit.config import load_yaml
    from tellkit.tasks.captioning import CaptioningTask

    r = load_yaml(name)
    assert r["eval"]["beam_size"] == 1 and r["eval"]["max_len"] == 101
    assert r["data"]["max_article_tokens"] == 512  # 510 BPE tokens + <s> </s>
    assert r["data"]["max_caption_tokens"] == 510
    assert r["data"]["context"] == ("first_tokens" if name == "tat/goodnews" else "location_aware")
    gen = CaptioningTask(r).eval.generation
    if name != "tat/nytimes_faces":  # the others inherit its eval section: decode once
        return
    torch.manual_seed(0)
    m = tellkit.create_model("tat/tiny", **TINY, **NO_DROPOUT).eval()
    plain = m.next_log_probs
    m.next_log_probs = lambda h, ctx: plain(h, ctx).index_fill(-1, torch.tensor([m.config.eos_id]), -1e4)
    cfg = m.config
    batch = {"image": torch.randn(1, 3, cfg.image_dim), "faces": torch.randn(1, 1, cfg.face_dim),
             "article": torch.randn(1, cfg.article_layers, 4, cfg.article_dim)}
    out = m.generate(batch, **gen.kwargs())
    assert [len(t) for t in out["tokens"]] == [100]  # a caption that never ends: 100 words, as the reference
