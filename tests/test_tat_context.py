"""The reference's article context (location-aware for NYTimes800k, title + article for
GoodNews), checked against token sequences worked out by hand from the reference rules.

Toy tokenizer: one token per space-separated word, so budgets are easy to follow by hand.
Paragraph i is "a<i> b<i> c<i>" (3 tokens); the title "T0 T1" has 2."""
import pytest

from tellkit.encoders.context import build_context, split_parsed_section

count = lambda text: len(text.split())  # noqa: E731
words = str.split
TITLE = "T0 T1"


def para(i):
    return f"a{i} b{i} c{i}"


def ctx(paras, image_index, max_tokens, **kw):
    return build_context(TITLE, paras, image_index, count_tokens=count, max_tokens=max_tokens, tokenize=words, **kw)


def test_long_article_image_in_the_middle():
    # title 2; first paragraph free; round 1: p3 (5), p4 (8); 8 < 10 so round 2: p2 (11), p5 (14): stop.
    # text in document order: title, p0, p2, p3, p4, p5; the encoder keeps its first 10 tokens
    c = ctx([para(i) for i in range(8)], 4, 10)
    assert c.text == "\n".join([TITLE, para(0), para(2), para(3), para(4), para(5)])
    assert c.paragraphs == [0, 2, 3, 4, 5] and c.truncated and c.n_tokens == 10
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0", "a2", "b2", "c2", "a3", "b3"]


def test_short_article_fits_whole():
    # round 1: nothing above (p0 is the first paragraph), p1 below; round 2: p2; both sides done
    c = ctx([para(i) for i in range(3)], 1, 510)
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    assert c.paragraphs == [0, 1, 2] and not c.truncated and c.n_tokens == 11


def test_image_first():
    # image above every paragraph: step 1 lands on p0 (already taken) and takes nothing,
    # then p1 (5), p2 (8 >= 8): stop
    c = ctx([para(i) for i in range(6)], 0, 8)
    assert c.paragraphs == [0, 1, 2]
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0", "a1", "b1", "c1"]
    assert c.truncated  # p3..p5 never reached


def test_image_last():
    # nothing below: p5 (5), p4 (8 >= 8): stop; document order puts p4 before p5
    c = ctx([para(i) for i in range(6)], 6, 8)
    assert c.text == "\n".join([TITLE, para(0), para(4), para(5)])
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0", "a4", "b4", "c4"]


def test_first_paragraph_is_not_counted():
    # budget 5 = title (2) + one paragraph (3): p0 comes free, so round 1 still takes p1 and p2
    c = ctx([para(i) for i in range(4)], 2, 5)
    assert c.paragraphs == [0, 1, 2]
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0"]  # ... and the hard cut keeps 5 tokens


def test_other_captions_take_a_step_as_in_the_reference():
    # parsed_section: p0, caption A, p1, p2, caption B (our image), caption C, p3, p4
    sections = [{"type": "paragraph", "text": para(0)}, {"type": "caption", "text": "cap A", "hash": "a"},
                {"type": "paragraph", "text": para(1)}, {"type": "paragraph", "text": para(2)},
                {"type": "caption", "text": "cap B", "hash": "b"}, {"type": "caption", "text": "cap C", "hash": "c"},
                {"type": "paragraph", "text": para(3)}, {"type": "paragraph", "text": para(4)}]
    texts, where = split_parsed_section(sections, 4)
    assert (texts, where) == ([para(0), "", para(1), para(2), "", para(3), para(4)], 4)
    # round 1: p2 above (5), caption C below (a step, nothing taken); round 2: p1 (8), p3 (11): stop
    c = ctx(texts, where, 8)
    assert c.text == "\n".join([TITLE, para(0), para(1), para(2), para(3)])
    assert c.tokens == ["T0", "T1", "a0", "b0", "c0", "a1", "b1", "c1"]


def test_no_title_no_paragraphs():
    c = build_context("", [], 0, count_tokens=count, max_tokens=10, tokenize=words)
    assert c.text == "" and c.tokens == [] and c.paragraphs == []
    c = build_context("", ["", ""], 1, count_tokens=count, max_tokens=10)
    assert c.text == ""


def test_goodnews_title_blank_line_article_first_words():
    paras = [para(0), para(1), para(2)]
    c = build_context(TITLE, paras, None, count_tokens=count, max_tokens=510, tokenize=words)
    assert c.text == "T0 T1\n\na0 b0 c0\n\na1 b1 c1\n\na2 b2 c2" and not c.truncated
    # the first 500 space-separated words (the title's words included), then the token cut
    long = [" ".join(f"w{i}" for i in range(300)), " ".join(f"v{i}" for i in range(300))]
    c = build_context("Head", long, None, count_tokens=count, max_tokens=510, tokenize=words)
    assert len(c.text.split(" ")) == 500 and c.truncated
    # words: "Head\n\nw0", w1..w298, "w299\n\nv0", v1..v200 (500); the two joined words are 2 tokens each
    assert c.tokens[:2] == ["Head", "w0"] and len(c.tokens) == 502 and c.tokens[-1] == "v200"
    c = build_context("Head", long, None, count_tokens=count, max_tokens=100, tokenize=words)
    assert c.n_tokens == 100 and c.tokens[-1] == "w98"


def test_real_bpe_cut_at_510_tokens():
    from tellkit.encoders.tokenizer import CaptionTokenizer

    tok = CaptionTokenizer.load()
    paras = [f"Paragraph {i} says that Senator Jane Doe visited Springfield on day {i}. " * 6 for i in range(40)]
    c = build_context("Jane Doe Visits Springfield", paras, 20, tokenize=tok.encode)
    assert len(c.tokens) == c.n_tokens == 510 and c.tokens == tok.encode(c.text)[:510]
    # title (uncounted first paragraph), then rounds (19, 20), (18, 21), (17, 22): the third round
    # passes 510, so the walk stops there; the hard cut then drops the end of paragraph 22
    n = [len(tok.encode(p)) for p in paras]
    title = len(tok.encode("Jane Doe Visits Springfield"))
    assert title + n[19] + n[20] + n[18] + n[21] < 510 <= title + sum(n[17:23])
    assert c.paragraphs == [0, 17, 18, 19, 20, 21, 22] and c.truncated


def test_unknown_policy():
    with pytest.raises(ValueError):
        build_context("t", ["p"], 0, count_tokens=count, policy="nope")
