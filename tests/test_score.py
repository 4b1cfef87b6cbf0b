"""`tellkit score`: ROUGE (reference behaviour) and both Content F1 definitions from files, caption
metrics for captions, one-line errors for bad input."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from tellkit.cli import main as cli_main
from tellkit.metrics.rouge import rouge_reference
from test_summarization_metrics import HAND_ALIGN  # noqa: I001  (tests/ is on the path)


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def _files(tmp_path):
    from tellkit.metrics.content_f1 import read_alignments

    pairs = read_alignments(HAND_ALIGN)
    preds, refs = tmp_path / "pred.txt", tmp_path / "ref.txt"
    preds.write_text("".join(" ".join(p.prediction) + "\n" for p in pairs))
    refs.write_text("".join(" ".join(p.reference) + "\n" for p in pairs))
    align = tmp_path / "align.out"
    align.write_text(HAND_ALIGN)
    return preds, refs, align


def test_score_summaries_with_alignments(tmp_path):
    preds, refs, align = _files(tmp_path)
    rc, out, _ = _cli("score", "--predictions", preds, "--references", refs, "--alignments", align)
    assert rc == 0
    res = json.loads(out)
    expected = rouge_reference(preds.read_text().splitlines(), refs.read_text().splitlines())
    assert {k: res[k] for k in ("rouge1", "rouge2", "rougeL")} == pytest.approx(expected)
    # the first pair by hand: 5 of 7 predicted unigrams in the 8-word reference ("learn", "to", "chop",
    # "for", "soup"), so its ROUGE-1 F1 is 2 * 5/7 * 5/8 / (5/7 + 5/8)
    assert expected["rouge1"] > 0 and 0 < 2 * (5 / 7) * (5 / 8) / (5 / 7 + 5 / 8) < 1
    assert res["content_f1"]["reference"] == pytest.approx(100 * (2 / 3 + 1 + 0 + 1.5) / 4)
    assert "tellkit" in res["content_f1"] and res["n"] == 4
    assert {"rouge1/rouge2/rougeL", "content_f1.tellkit", "content_f1.reference"} <= set(res["implementations"])


def test_score_rejects_bad_input(tmp_path):
    preds, refs, align = _files(tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("one line\n")
    assert _cli("score", "--predictions", preds, "--references", short)[0] == 2
    assert _cli("score", "--predictions", tmp_path / "nope.txt", "--references", refs)[0] == 2
    assert _cli("score", "--predictions", preds, "--references", refs, "--metrics", "bleurt")[0] == 2
    other = tmp_path / "other.txt"
    other.write_text("a\nb\nc\nd\n")
    rc, _, err = _cli("score", "--predictions", preds, "--references", other, "--alignments", align)
    assert rc == 2 and "do not belong" in err and len(err.strip().splitlines()) == 1


@pytest.mark.java
def test_score_captions(tmp_path):
    preds = tmp_path / "p.txt"
    preds.write_text("a dog runs on the grass\na man rides a bike\n")
    r1, r2 = tmp_path / "r1.txt", tmp_path / "r2.txt"
    r1.write_text("a dog runs on grass\na man is riding a bike\n")
    r2.write_text("the dog is running\na person on a bicycle\n")
    rc, out, _ = _cli("score", "--predictions", preds, "--references", r1, r2, "--metrics", "caption")
    assert rc == 0
    res = json.loads(out)
    assert {"bleu1", "bleu4", "meteor", "cider"} <= set(res["caption"]) and res["references_per_prediction"] == 2
    assert 0 < res["caption"]["bleu1"] <= 100
