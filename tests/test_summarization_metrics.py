"""Summary metrics: Content F1 (by hand from alignments, METEOR's output format, and through
Java on pairs whose alignment is unambiguous), and the score_summaries JSON."""
from __future__ import annotations

import json

import pytest

from tellkit.errors import TellkitError
from tellkit.metrics.content_f1 import SUMMARY_STOPWORDS, content_f1, content_f1_pair, function_words, parse_alignments
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
    assert content_f1_pair("play the guitar".split(), "learn to play a violin".split(), [(1, 3, 0, 2)], stop) == pytest.approx(0.5)
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
    s = score_summaries({"b": "the cat sat on the mat", "a": "x"}, {"a": "y", "b": "the cat is on the mat"}, metrics=["rouge"])
    json.dumps(s)  # JSON-able
    assert s["n"] == 2
    assert s["rouge_reference"]["rouge1"] == pytest.approx(100 * (0 + 5 / 6) / 2)
    assert s["rouge_reference"]["rouge2"] == pytest.approx(100 * (0 + 3 / 5) / 2)
    assert set(s["rouge_score"]) == {"rouge1", "rouge2", "rougeL"}
    assert "rouge_reference" in s["implementations"] and "rouge_score" in s["implementations"]
    flat = flatten_scores(s)
    assert flat["rouge2"] == s["rouge_reference"]["rouge2"] and flat["rouge_score.rougeL"] == s["rouge_score"]["rougeL"]
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
    assert {"bleu1", "bleu2", "bleu3", "bleu4", "meteor", "cider", "content_f1", "rouge_reference", "rouge_score"} <= set(s)
    # corpus BLEU-1: clipped unigram matches 3 + 5 of 4 + 6 predicted, lengths equal (no brevity penalty)
    assert s["bleu1"] == pytest.approx(100 * 8 / 10, rel=1e-6)
    assert 0 < s["meteor"] <= 100 and s["cider"] > 0
    # Content F1: v1 all content, a/b/c aligned -> P = R = 3/4; v2 content {cut|chop, onion,
    # small, pieces}: onion/small/pieces align exactly, cut/chop only if METEOR's synonyms do
    assert s["content_f1"] >= 100 * (3 / 4 + 3 / 4) / 2 - 1e-9
