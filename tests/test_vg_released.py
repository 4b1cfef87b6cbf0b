"""The VG-GPLMs paper's How2 numbers regenerated from the authors' released test outputs
(``how2/released_outputs`` in the shared data): ROUGE rows of the table within 0.1, and the
evaluation script's Content F1 from the released METEOR alignment files, including the two files
that were aligned against another system's output instead of the references."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from tellkit.cli import main as cli_main
from tellkit.metrics.content_f1 import content_f1_from_alignments, mismatched_pairs, read_alignment_file
from tellkit.metrics.rouge import rouge_reference

# the paper's Table (How2 test, R-1 / R-2 / R-L) and the released file of each row
PAPER_ROUGE = {
    "Bart_text_only.txt": (64.0, 46.4, 58.9),
    "Bart_dot_product.txt": (66.1, 49.3, 61.2),
    "Bart_multi_head.txt": (66.3, 49.4, 61.4),
    "Bart_multi_head_forget_gate.txt": (67.3, 50.7, 62.4),
    "Bart_img_TF.txt": (67.3, 50.9, 62.6),
    "Bart_forget_gate_img_TF.txt": (68.0, 51.4, 63.3),
}
ALIGNMENTS = {
    "Bart_text_only.txt": "Bart_text_only.txt-align.out",
    "Bart_dot_product.txt": "Bart_dot_product.txt-align.out",
    "Bart_multi_head.txt": "Bart_multi_head.txt-align.out",
    "Bart_forget_gate_img_TF.txt": "Bart_forget_gate_img_TF.txt-align.out",
    "T5_text_only.txt": "T5_text_only_align.txt-align.out",
    "T5_dot_product.txt": "T5_dot_product.txt-align.out",
    "T5_multi_head.txt": "T5_multi_head.txt-align.out",
}
# aligned with Bart_dot_product.txt as METEOR's test side and the named system as its reference
MISALIGNED = {"Bart_img_TF.txt": "Bart_img_TF.txt-align.out",
              "Bart_multi_head_forget_gate.txt": "Bart_multi_head_forget_gate.txt-align.out"}


def _lines(path):
    lines = path.read_text(encoding="utf-8").split("\n")
    return lines[:-1] if lines[-1] == "" else lines


@pytest.fixture(scope="module")
def released(shared_data):
    d = shared_data / "how2" / "released_outputs"
    if not d.is_dir():
        pytest.fail(f"{d} is missing from the shared data")
    return d


@pytest.mark.data
@pytest.mark.parametrize("name", sorted(PAPER_ROUGE))
def test_paper_rouge_rows(released, name):
    refs = _lines(released / "test.tgt")
    preds = _lines(released / name)
    assert len(preds) == len(refs) == 2127
    got = rouge_reference(preds, refs)
    for key, paper in zip(("rouge1", "rouge2", "rougeL"), PAPER_ROUGE[name]):
        assert abs(got[key] - paper) <= 0.1, (name, key, got[key], paper)


@pytest.mark.data
def test_reference_content_f1_from_released_alignments(released):
    refs = _lines(released / "test.tgt")
    scores = {}
    for name, align in ALIGNMENTS.items():
        pairs = read_alignment_file(released / align)
        assert mismatched_pairs(pairs, _lines(released / name), refs) == []  # these belong to the table row
        scores[name] = content_f1_from_alignments(pairs)
    # the paper's Content F1 of its best row (dot-product + forget gate + visual transformer)
    assert abs(scores["Bart_forget_gate_img_TF.txt"]["reference"] - 69.7) <= 0.1
    # the script's definition reads 7.7 to 8.8 points above tellkit's on every BART row
    for name, s in scores.items():
        gap = s["reference"] - s["tellkit"]
        assert (7.6 <= gap <= 8.9) if name.startswith("Bart") else (6.5 <= gap <= 7.5), (name, gap)


@pytest.mark.data
def test_two_alignment_files_belong_to_other_pairs(released):
    refs = _lines(released / "test.tgt")
    dot = _lines(released / "Bart_dot_product.txt")
    for name, align in MISALIGNED.items():
        pairs = read_alignment_file(released / align)
        system = _lines(released / name)
        assert len(mismatched_pairs(pairs, system, refs)) > 2000
        assert mismatched_pairs(pairs, dot, system) == []  # Bart_dot_product.txt scored against this system


@pytest.mark.data
def test_tellkit_score_on_the_best_row(released):
    out = io.StringIO()
    name = "Bart_forget_gate_img_TF.txt"
    with contextlib.redirect_stdout(out):
        rc = cli_main(["score", "--predictions", str(released / name), "--references", str(released / "test.tgt"),
                       "--alignments", str(released / ALIGNMENTS[name])])
    assert rc == 0
    res = json.loads(out.getvalue())
    assert [round(res[k], 1) for k in ("rouge1", "rouge2", "rougeL")] == [68.0, 51.4, 63.3]
    assert round(res["content_f1"]["reference"], 1) == 69.7
    # Google's rouge-score package reads lower on the same file (the spec: about 1.3 points)
    assert 0.5 < res["rouge1"] - res["rouge_score"]["rouge1"] < 2.0
