"""Article encoder (all hidden states, 512-token limit, masks), caption ids for the copy head,
and the location-aware context builder."""
from __future__ import annotations

import pytest
import torch

from tellkit.encoders.context import build_context, reading_order, split_parsed_section
from tellkit.encoders.text import ArticleEncoder
from tellkit.encoders.tokenizer import CaptionTokenizer
from tellkit.errors import TellkitError

pytest.importorskip("transformers")

ARTICLE = ("Barack Obama met Zoë Kravitz in Tokyo on Jan. 3, 2009.\n"
           "Obama's visit (unannounced) cost $1,234 and the O'Neill family paid.")


@pytest.fixture(scope="module")
def minilm():
    return ArticleEncoder()


@pytest.fixture(scope="module")
def cap():
    return CaptionTokenizer.load()


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory, cap):
    """A randomly initialised 2-layer RoBERTa saved with RoBERTa's tokenizer files, loaded by
    path exactly as a real user's `roberta-large` folder would be."""
    from transformers import RobertaConfig, RobertaModel

    d = tmp_path_factory.mktemp("tiny-roberta")
    cap.save_pretrained(d)
    cfg = RobertaConfig(vocab_size=50265, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=514, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    RobertaModel(cfg).save_pretrained(d)
    return ArticleEncoder(d)


def test_minilm_returns_every_hidden_state(minilm):
    assert (minilm.num_layers, minilm.dim, minilm.max_tokens) == (7, 384, 512)
    out = minilm.encode([ARTICLE, "A short one."])
    B, n_layers, L, D = out["hidden"].shape
    assert (B, n_layers, D) == (2, 7, 384)
    assert out["mask"].shape == (2, L) and out["mask"].dtype == torch.bool
    assert out["mask"][0].all() and out["mask"][1].sum() == len(out["tokens"][1]) < L
    assert out["tokens"][0][0] == "[CLS]" and out["tokens"][0][-1] == "[SEP]"
    assert not out["hidden"].requires_grad
    # layer 0 is the embedding output, the last is the final layer: they differ
    assert not torch.allclose(out["hidden"][0, 0], out["hidden"][0, -1])


def test_padding_does_not_change_the_states(minilm):
    alone = minilm.encode(["A short one."])["hidden"][0]
    padded = minilm.encode([ARTICLE, "A short one."])["hidden"][1, :, : alone.shape[1]]
    assert torch.allclose(alone, padded, atol=1e-4)


def test_512_token_limit(minilm):
    long = " ".join(["word"] * 2000)
    out = minilm.encode([long])
    assert out["hidden"].shape[2] == 512 and out["mask"].all()
    assert minilm.encode([long], max_tokens=100)["hidden"].shape[2] == 100
    assert minilm.caption_ids([long], max_tokens=4096).shape == (1, 512)  # capped at the model's limit


def test_wordpiece_tokens_map_to_cased_bpe_caption_ids(minilm, cap):
    out = minilm.encode([ARTICLE])
    ids = minilm.caption_ids([ARTICLE], out["offsets"])
    assert ids.shape == out["mask"].shape
    pairs = dict(zip(out["tokens"][0], ids[0].tolist()))
    # the uncased WordPiece "obama" copies RoBERTa's cased " Obama", also at a line start
    assert pairs["barack"] == cap.encode(" Barack")[0]
    assert pairs["obama"] == cap.encode(" Obama")[0]
    obama = [i for t, i in zip(out["tokens"][0], ids[0].tolist()) if t == "obama"]
    assert obama == [cap.encode(" Obama")[0]] * 2
    assert pairs["tokyo"] == cap.encode(" Tokyo")[0] and pairs["2009"] == cap.encode(" 2009")[0]
    assert pairs["[CLS]"] == -1 and pairs["[SEP]"] == -1
    # every mapped id is the caption piece starting at the same character of the original text
    for (s, _end), i in zip(out["offsets"][0], ids[0].tolist()):
        if i >= 0:
            assert ARTICLE[s:].startswith(cap.decode([i]).lstrip())
    # computed from the tokenizer alone (no model run) it is the same
    assert torch.equal(minilm.caption_ids([ARTICLE]), ids)


def test_roberta_article_ids_are_the_caption_ids(tiny_roberta, cap):
    assert (tiny_roberta.num_layers, tiny_roberta.dim, tiny_roberta.max_tokens) == (3, 16, 512)
    text = "Barack Obama met Zoë Kravitz in Tokyo on Jan. 3, 2009, and O'Neill paid $1,234."
    out = tiny_roberta.encode([text, "Short."])
    assert out["hidden"].shape[:2] == (2, 3)
    ids = tiny_roberta.caption_ids([text, "Short."], out["offsets"])
    ids0, inp0 = ids[0].tolist(), out["input_ids"][0].tolist()
    assert inp0[0] == 0 and inp0[-1] == 2 and ids0[0] == -1 and ids0[-1] == -1
    # the first word has no leading space in the article's own ids ("Bar" "ack"); the copy head
    # gets the in-caption form " Barack" and nothing for "ack". Every later token is identical.
    assert ids0[1] == cap.encode(" Barack")[0] and ids0[2] == -1 and inp0[1:3] == cap.encode("Barack")
    assert ids0[3:-1] == inp0[3:-1]
    assert (ids[1] == -1).sum() == (~out["mask"][1]).sum() + 2


def test_article_encoder_load_error(tmp_path):
    with pytest.raises(TellkitError, match="cannot load"):
        ArticleEncoder(tmp_path / "no-model")


# --- context builder -----------------------------------------------------------------------

def _article(n=10, words=10):
    return [" ".join(f"p{i}w{j}" for j in range(words)) for i in range(n)]


def test_reading_order_alternates_around_the_image():
    assert reading_order(10, 6) == [0, 5, 6, 4, 7, 3, 8, 2, 9, 1]
    assert reading_order(5, 0) == [0, 1, 2, 3, 4]
    assert reading_order(5, 5) == [0, 4, 3, 2, 1]
    assert reading_order(4, None) == [0, 1, 2, 3]


def test_location_aware_context_with_known_image_position():
    def count(text):  # one token per word: easy budgets
        return len(text.split())

    paras = _article()
    # title (2) + 5 paragraphs of 10 = 52 words: title, p0, then p5 p6 p4 p7 around the image
    ctx = build_context("The Title", paras, image_index=6, count_tokens=count, max_tokens=52, policy="cut")
    assert ctx.paragraphs == [0, 4, 5, 6, 7] and ctx.truncated  # p1-p3, p8, p9 left out
    assert ctx.text.split("\n") == ["The Title", paras[0], paras[4], paras[5], paras[6], paras[7]]
    assert ctx.n_tokens == 52
    # 5 tokens more: the next paragraph above (p3) is cut to 5 words and the walk stops
    ctx = build_context("The Title", paras, image_index=6, count_tokens=count, max_tokens=57, policy="cut")
    assert ctx.paragraphs == [0, 3, 4, 5, 6, 7] and ctx.truncated
    assert ctx.text.split("\n")[2] == "p3w0 p3w1 p3w2 p3w3 p3w4" and ctx.n_tokens == 57
    # GoodNews: no image position, the beginning of the article
    ctx = build_context("The Title", paras, None, count_tokens=count, max_tokens=32, policy="cut")
    assert ctx.paragraphs == [0, 1, 2] and ctx.n_tokens == 32
    # everything fits: nothing left out
    ctx = build_context("The Title", paras, image_index=3, count_tokens=count, max_tokens=1000, policy="cut")
    assert ctx.paragraphs == list(range(10)) and not ctx.truncated and ctx.n_tokens == 102


def test_context_with_real_bpe_budget():
    cap = CaptionTokenizer.load()
    paras = [f"Paragraph {i} says that Senator Jane Doe visited Springfield on day {i}. " * 6 for i in range(40)]
    ctx = build_context("Jane Doe Visits Springfield", paras, image_index=20, policy="cut")
    assert ctx.n_tokens == len(cap.encode(ctx.text)) <= 510
    assert ctx.n_tokens > 480  # the budget is filled
    assert ctx.paragraphs == [0, 17, 18, 19, 20, 21] and ctx.truncated  # 19, 20, 18, 21, then 17 is cut
    assert ctx.text.startswith("Jane Doe Visits Springfield\nParagraph 0 ")


def test_context_feeds_the_article_encoder(minilm):
    paras = [f"Paragraph {i} is about the mayor of Springfield and the budget. " * 8 for i in range(30)]
    ctx = build_context("Budget", paras, image_index=12, count_tokens=minilm.count_tokens,
                        max_tokens=minilm.max_tokens - minilm.num_special)
    out = minilm.encode([ctx.text])
    assert out["mask"].sum() == ctx.n_tokens + 2 <= 512
    assert {0, 11, 12} <= set(ctx.paragraphs)


def test_split_parsed_section():
    sections = [{"type": "paragraph", "text": "a"}, {"type": "caption", "text": "c1", "hash": "h1"},
                {"type": "paragraph", "text": "b"}, {"type": "paragraph", "text": "c"},
                {"type": "caption", "text": "c2", "hash": "h2"}, {"type": "paragraph", "text": "d"}]
    # other captions are empty slots, the image's own caption is left out
    assert split_parsed_section(sections, 1) == (["a", "b", "c", "", "d"], 1)
    assert split_parsed_section(sections, 4) == (["a", "", "b", "c", "d"], 4)
