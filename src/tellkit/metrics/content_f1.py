"""Content F1 for How2 summaries (Palaskar et al., ACL 2019; reported by VG-GPLMs).

METEOR 1.5 (the jar shipped in ``pycocoevalcap``, needs Java) aligns each prediction with its
reference (exact, stem, synonym and paraphrase modules). Content F1 keeps only *content* words:
tokens that are neither METEOR's English function words nor the How2 summary stop-words (words
that open most How2 summaries: "learn", "how", "video", "free", "tips", "expert", ...). Per pair,
precision = aligned content tokens of the prediction / its content tokens, recall = aligned
content tokens of the reference / its content tokens, F1 of the two; the score is the mean over
pairs, in percent. A pair with no content token on either side scores 0.

Difference from the reference evaluation script: that script drops only alignments whose
reference word is a summary stop-word and counts word types in the denominators; here both
sides drop function words and stop-words and count tokens, as the metric's description says.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from tellkit.errors import MissingExtraError, TellkitError
from tellkit.utils.optional import require

# The summary stop-words of the How2 Content F1 evaluation (as listed by the VG-GPLMs evaluation).
SUMMARY_STOPWORDS = frozenset(
    "in a this to free the video and learn from on with how tips for of expert an".split()
)

Alignment = tuple[int, int, int, int]  # (ref_start, ref_len, pred_start, pred_len), 0-based


def meteor_jar() -> Path:
    mod = require("pycocoevalcap.meteor.meteor", "metrics", "METEOR alignments (Content F1)")
    jar = Path(mod.__file__).with_name("meteor-1.5.jar")
    if not jar.is_file():
        raise MissingExtraError(f"METEOR jar not found at {jar}: reinstall `pip install 'tellkit[metrics]'`")
    return jar


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise MissingExtraError("Content F1 needs Java (METEOR 1.5): install a Java runtime, e.g. `apt-get install default-jre`")
    return java


@lru_cache(maxsize=1)
def function_words() -> frozenset[str]:
    """METEOR 1.5's English function-word list (read from the jar)."""
    with zipfile.ZipFile(meteor_jar()) as z:
        text = z.read("function/english.words").decode("utf-8")
    return frozenset(w for w in text.split() if w)


def stop_words() -> frozenset[str]:
    return function_words() | SUMMARY_STOPWORDS


def parse_alignments(text: str) -> list[list[Alignment]]:
    """Parse METEOR's ``-writeAlignments`` output: one block per pair, in input order."""
    out: list[list[Alignment]] = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines or not lines[0].startswith("Alignment"):
            continue
        spans: list[Alignment] = []
        for ln in lines[4:]:  # header, prediction, reference, column names, then spans
            cols = ln.split()
            (rs, rl), (ps, pl) = (map(int, cols[0].split(":")), map(int, cols[1].split(":")))
            spans.append((rs, rl, ps, pl))
        out.append(spans)
    return out


def meteor_alignments(predictions: Sequence[str], references: Sequence[str], memory: str = "2G") -> list[list[Alignment]]:
    """Run METEOR 1.5 once over all pairs (whitespace tokens, as given) and return the alignments."""
    if len(predictions) != len(references):
        raise TellkitError(f"{len(predictions)} predictions but {len(references)} references")
    java, jar = _java(), meteor_jar()
    with tempfile.TemporaryDirectory(prefix="tellkit-meteor-") as tmp:
        t = Path(tmp)
        (t / "pred.txt").write_text("".join(" ".join(p.split()) + "\n" for p in predictions), encoding="utf-8")
        (t / "ref.txt").write_text("".join(" ".join(r.split()) + "\n" for r in references), encoding="utf-8")
        cmd = [java, f"-Xmx{memory}", "-jar", str(jar), "pred.txt", "ref.txt", "-l", "en", "-writeAlignments", "-f", "run"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TellkitError(f"METEOR failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        found = parse_alignments((t / "run-align.out").read_text(encoding="utf-8"))
    if len(found) != len(predictions):
        raise TellkitError(f"METEOR returned {len(found)} alignments for {len(predictions)} pairs")
    return found


def content_f1_pair(pred: Sequence[str], ref: Sequence[str], spans: Sequence[Alignment], stop: frozenset[str]) -> float:
    """Content F1 (0-1) of one token pair given its alignment spans."""
    aligned_p: set[int] = set()
    aligned_r: set[int] = set()
    for rs, rl, ps, pl in spans:
        aligned_r.update(range(rs, rs + rl))
        aligned_p.update(range(ps, ps + pl))
    content_p = [i for i, w in enumerate(pred) if w not in stop]
    content_r = [i for i, w in enumerate(ref) if w not in stop]
    if not content_p or not content_r:
        return 0.0
    p = sum(i in aligned_p for i in content_p) / len(content_p)
    r = sum(i in aligned_r for i in content_r) / len(content_r)
    return 0.0 if p + r == 0 else 2 * p * r / (p + r)


def content_f1(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean Content F1 over pairs, in percent (lower-cased, whitespace tokens). Needs Java."""
    if len(predictions) != len(references):
        raise TellkitError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise TellkitError("Content F1: nothing to score")
    preds = [p.lower().split() for p in predictions]
    refs = [r.lower().split() for r in references]
    stop = stop_words()
    keep = [i for i in range(len(preds)) if preds[i] and refs[i]]  # METEOR cannot align empty lines
    spans = meteor_alignments([" ".join(preds[i]) for i in keep], [" ".join(refs[i]) for i in keep]) if keep else []
    total = sum(content_f1_pair(preds[i], refs[i], s, stop) for i, s in zip(keep, spans))
    return 100.0 * total / len(preds)
