"""Summary metrics: Content F1 (by hand from alignments, METEOR's output format, and through
Java on pairs whose alignment is unambiguous), and the score_summaries JSON."""
from __future__ import annotations

import json

import pytest

from tellkit.errors import TellkitError
from tellkit.metrics.content_f1 import (
    SUMMARY_STOPWORDS,
    AlignedPair,
    content_f1,
    content_f1_from_alignments,
    content_f1_pair,
    content_f1_reference_pair,
    function_words,
    mismatched_pairs,
    parse_alignments,
    read_alignments,
)
from tellkit.metrics.summarization import flatten_scores, score_summaries

# METEOR 1.5 `-writeAlignments` output, as written by the jar for the two pairs below
ALIGN_OUT = (
    "Alignment\t1\t0.67\t0.6\t0.52\t0.29\n"
    "onion soup guitar\n"
    "onion soup with carrots\n"
    "Line2Start:Length\tLine1Start:Length\tModule\t\tScore\n"
    "0:1\t\t\t0:1\t\t\t0\t\t1.0\n"
    "1:1\t\t\t1:1\t\t\t0\t\t1.0\n"
    "\n"
    "Alignment\t2\t0.34\t0.27\t0.49\t0.14\n"
    "play the guitar\n"
    "learn to play a violin\n"
    "Line2Start:Length\tLine1Start:Length\tModule\t\tScore\n"
    "1:3\t\t\t0:2\t\t\t3\t\t1.0\n"
    "\n"
)


def test_parse_alignments():
    assert parse_alignments(ALIGN_OUT) == [[(0, 1, 0, 1), (1, 1, 1, 1)], [(1, 3, 0, 2)]]


def test_content_f1_pair_by_hand():
    stop = frozenset({"the", "to", "a", "learn"})
    # pred "play the guitar": content play, guitar; the phrase alignment covers pred 0..1 -> play
    # ref "learn to play a violin": content play, violin; alignment covers ref 1..3 -> play
    # P = 1/2, R = 1/2 -> F1 = 1/2
    pred, ref = "play the guitar".split(), "learn to play a violin".split()
    assert content_f1_pair(pred, ref, [(1, 3, 0, 2)], stop) == pytest.approx(0.5)
    # nothing aligned -> 0; only stop-words on one side -> 0
    assert content_f1_pair(["guitar"], ["violin"], [], stop) == 0.0
    assert content_f1_pair(["the"], ["the"], [(0, 1, 0, 1)], stop) == 0.0
    # P = 1 (both content tokens aligned), R = 2/4 -> F1 = 2/3
    assert content_f1_pair("onion soup".split(), "onion soup with carrots".split(), [(0, 1, 0, 1), (1, 1, 1, 1)],
                           frozenset()) == pytest.approx(2 / 3)


@pytest.mark.java
def test_function_words_from_meteor_jar():
    fw = function_words()
    assert {"the", "of", "and", "into"} <= fw and "onion" not in fw
    assert {"learn", "video", "free", "tips", "expert"} <= SUMMARY_STOPWORDS


@pytest.mark.java
def test_content_f1_through_meteor():
    preds = ["onion soup guitar", "Learn how to cut hair in this free video", ""]
    refs = ["onion soup with carrots", "learn how to style hair", "anything"]
    # pair 1: content pred {onion, soup, guitar}, ref {onion, soup, carrots} ("with" is a
    #   function word); METEOR aligns onion and soup exactly -> P = R = 2/3 -> F1 = 2/3
    # pair 2 (lower-cased): content pred {cut, hair}, ref {style, hair}; only "hair" aligns
    #   among them -> P = R = 1/2 -> F1 = 1/2
    # pair 3: empty prediction -> 0
    assert content_f1(preds, refs) == pytest.approx(100 * (2 / 3 + 1 / 2 + 0) / 3)


def test_score_summaries_rouge_json():
    s = score_summaries({"b": "the cat sat on the mat", "a": "x"}, {"a": "y", "b": "the cat is on the mat"},
                        metrics=["rouge"])
    json.dumps(s)  # JSON-able
    assert s["n"] == 2
    assert s["rouge_reference"]["rouge1"] == pytest.approx(100 * (0 + 5 / 6) / 2)
    assert s["rouge_reference"]["rouge2"] == pytest.approx(100 * (0 + 3 / 5) / 2)
    assert set(s["rouge_score"]) == {"rouge1", "rouge2", "rougeL"}
    assert "rouge_reference" in s["implementations"] and "rouge_score" in s["implementations"]
    flat = flatten_scores(s)
    assert flat["rouge2"] == s["rouge_reference"]["rouge2"]
    assert flat["rouge_score.rougeL"] == s["rouge_score"]["rougeL"]
    with pytest.raises(TellkitError):
        score_summaries({"a": "x"}, {"b": "x"}, metrics=["rouge"])
    with pytest.raises(TellkitError):
        score_summaries(["x"], ["x"], metrics=["bleurt"])


@pytest.mark.java
@pytest.mark.slow
def test_score_summaries_full_json():
    preds = {"v1": "a b c d", "v2": "cut the onion into small pieces"}
    refs = {"v1": "a b c e", "v2": "chop the onion into small pieces"}
    s = score_summaries(preds, refs)
    json.dumps(s)
    assert {"bleu1", "bleu2", "bleu3", "bleu4", "meteor", "cider", "content_f1", "rouge_reference",
            "rouge_score"} <= set(s)
    # corpus BLEU-1: clipped unigram matches 3 + 5 of 4 + 6 predicted, lengths equal (no brevity penalty)
    assert s["bleu1"] == pytest.approx(100 * 8 / 10, rel=1e-6)
    assert 0 < s["meteor"] <= 100 and s["cider"] > 0
    # Content F1: v1 all content, a/b/c aligned -> P = R = 3/4; v2 content {cut|chop, onion,
    # small, pieces}: onion/small/pieces align exactly, cut/chop only if METEOR's synonyms do
    assert s["content_f1"]["tellkit"] >= 100 * (3 / 4 + 3 / 4) / 2 - 1e-9
    assert set(s["content_f1"]) == {"tellkit", "reference"}


# A hand-made METEOR alignment file (columns: reference "Line2" span, prediction "Line1" span)
# exercising each rule of the reference script's Content F1.
HAND_ALIGN = """Alignment\t1\t0.5\t0.5\t0.5\t0.5
learn how to chop onions for soup
learn to chop an onion for the soup
Line2Start:Length\tLine1Start:Length\tModule\t\tScore
0:1\t\t\t0:1\t\t\t0\t\t1.0
1:1\t\t\t2:1\t\t\t0\t\t1.0
2:1\t\t\t3:1\t\t\t0\t\t1.0
4:1\t\t\t4:1\t\t\t1\t\t1.0
5:1\t\t\t5:1\t\t\t0\t\t1.0
7:1\t\t\t6:1\t\t\t0\t\t1.0

Alignment\t2\t0.5\t0.5\t0.5\t0.5
the the cat sat on a mat
a cat sat on the mat
Line2Start:Length\tLine1Start:Length\tModule\t\tScore
1:2\t\t\t2:2\t\t\t3\t\t0.8
3:1\t\t\t4:1\t\t\t0\t\t1.0
4:1\t\t\t0:1\t\t\t0\t\t1.0
5:1\t\t\t6:1\t\t\t0\t\t1.0
0:1\t\t\t5:1\t\t\t0\t\t1.0

Alignment\t3\t0.5\t0.5\t0.5\t0.5
free video
in this video
Line2Start:Length\tLine1Start:Length\tModule\t\tScore
2:1\t\t\t1:1\t\t\t0\t\t1.0

Alignment\t4\t0.5\t0.5\t0.5\t0.5
onion onion soup
onion onion soup
Line2Start:Length\tLine1Start:Length\tModule\t\tScore
0:1\t\t\t0:1\t\t\t0\t\t1.0
1:1\t\t\t1:1\t\t\t0\t\t1.0
2:1\t\t\t2:1\t\t\t0\t\t1.0

"""


def test_reference_content_f1_on_hand_made_alignments():
    pairs = read_alignments(HAND_ALIGN)
    assert [len(p.spans) for p in pairs] == [6, 5, 1, 3]
    assert pairs[1].prediction[:2] == ("the", "the") and pairs[1].spans[0] == (1, 2, 2, 2)
    got = [content_f1_reference_pair(p) for p in pairs]
    # 1: spans on reference "learn", "to", "for" (one-word summary stop-words) are dropped, and those
    #    words leave both bags: reference types {chop, an, onion, the, soup} = 5, prediction types
    #    {how, chop, onions, soup} = 4; kept spans chop, onion(s), soup: 3/5 and 3/4 -> F1 2/3
    # 2: the two-word span counts 2 tokens; "on", "the", "a" dropped: 3/3 and 3/3 -> 1
    # 3: nothing kept (the script would divide by zero) -> 0
    # 4: aligned tokens over distinct words: 3/2 on both sides -> 1.5 (above 1, as in the script)
    assert got == pytest.approx([2 / 3, 1.0, 0.0, 1.5])
    both = content_f1_from_alignments(pairs, stop=SUMMARY_STOPWORDS)
    assert both["reference"] == pytest.approx(100 * (2 / 3 + 1 + 0 + 1.5) / 4)
    # tellkit's definition on the same spans (stop-words = the summary list only here):
    # 1: every stop-word leaves both sides, aligned or not ("how", "an", "the" too): content pred
    #    {chop, onions, soup}, ref {chop, onion, soup}, all aligned -> 1 (the reference: 2/3)
    # 2: pred {cat, sat, mat} all aligned, ref {cat, sat, mat} all aligned -> 1
    # 3: pred has no content token -> 0;  4: tokens, not types: all aligned -> 1 (the reference: 1.5)
    assert both["tellkit"] == pytest.approx(100 * (1 + 1 + 0 + 1) / 4)


def test_alignments_must_belong_to_the_pairs():
    pairs = read_alignments(HAND_ALIGN)
    preds = [" ".join(p.prediction) for p in pairs]
    refs = [" ".join(p.reference) for p in pairs]
    assert mismatched_pairs(pairs, preds, refs) == []
    assert mismatched_pairs(pairs, preds, [*refs[:3], "another system's summary"]) == [3]
    s = score_summaries(preds, refs, ["content_f1"], alignments=pairs)
    assert s["content_f1"]["reference"] == pytest.approx(100 * (2 / 3 + 1 + 0 + 1.5) / 4)
    with pytest.raises(TellkitError, match="do not belong"):
        score_summaries(preds, [*refs[:3], "x y"], ["content_f1"], alignments=pairs)
    with pytest.raises(TellkitError, match="not a METEOR alignment"):
        read_alignments("hello\nworld\n")
    assert isinstance(pairs[0], AlignedPair)
