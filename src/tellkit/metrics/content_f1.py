"""Content F1 for How2 summaries (Palaskar et al., ACL 2019; reported by VG-GPLMs), in two
labelled definitions over the same METEOR 1.5 alignments.

METEOR 1.5 (the jar shipped in ``pycocoevalcap``, needs Java) aligns each prediction with its
reference (exact, stem, synonym and paraphrase modules). Alignment files are METEOR's
``-writeAlignments`` output: per pair a header line, the prediction ("Line1"), the reference
("Line2"), a column header, then one ``ref_start:len  pred_start:len  module  score`` span per line.

``tellkit`` definition (:func:`content_f1_pair`): only *content* tokens count, i.e. tokens that are
neither METEOR's English function words nor the How2 summary stop-words (words that open most
How2 summaries: "learn", "how", "video", "free", "tips", "expert", ...). Per pair, precision =
aligned content tokens of the prediction / its content tokens, recall = the same on the
reference side, F1 of the two; the score is the mean over pairs, in percent. A pair with no
content token on either side scores 0.

``reference`` definition (:func:`content_f1_reference_pair`, what the VG-GPLMs evaluation script
computes and the paper reports): drop every one-word span whose reference word is a summary
stop-word (function words stay); numerators = summed span lengths of the remaining spans on each
side (tokens); denominators = distinct words of each line minus the words of the dropped spans
(word types); F1 of the two ratios, mean over pairs. Where the script would divide by zero (no
remaining span, or an empty line) the pair scores 0 here. On the authors' released How2 outputs
the two definitions differ by several points (``docs/vg_gplm.md``).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

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
        raise MissingExtraError(
            "Content F1 needs Java (METEOR 1.5): install a Java runtime, e.g. `apt-get install default-jre`"
        )
    return java


@lru_cache(maxsize=1)
def function_words() -> frozenset[str]:
    """METEOR 1.5's English function-word list (read from the jar)."""
    with zipfile.ZipFile(meteor_jar()) as z:
        text = z.read("function/english.words").decode("utf-8")
    return frozenset(w for w in text.split() if w)


def stop_words() -> frozenset[str]:
    return function_words() | SUMMARY_STOPWORDS


@dataclass(frozen=True)
class AlignedPair:
    """One block of a METEOR alignment file: the two token lines and the aligned spans."""

    prediction: tuple[str, ...]  # METEOR's "Line1" (the test side)
    reference: tuple[str, ...]  # "Line2"
    spans: tuple[Alignment, ...]


def read_alignments(text: str) -> list[AlignedPair]:
    """Parse METEOR's ``-writeAlignments`` output: one :class:`AlignedPair` per block, in order."""
    out: list[AlignedPair] = []
    for n, block in enumerate(text.split("\n\n")):
        lines = [ln for ln in block.split("\n") if ln.strip()]
        if not lines:
            continue
        if not lines[0].startswith("Alignment") or len(lines) < 4:
            raise TellkitError(f"alignment file: block {n + 1} is not a METEOR alignment (starts {lines[0][:40]!r})")
        spans: list[Alignment] = []
        for ln in lines[4:]:  # header, prediction, reference, column names, then spans
            cols = ln.split()
            try:
                (rs, rl), (ps, pl) = (map(int, cols[0].split(":")), map(int, cols[1].split(":")))
            except (IndexError, ValueError) as exc:
                raise TellkitError(f"alignment file: block {n + 1}: bad span line {ln[:60]!r}") from exc
            spans.append((rs, rl, ps, pl))
        out.append(AlignedPair(tuple(lines[1].split()), tuple(lines[2].split()), tuple(spans)))
    return out


def read_alignment_file(path: str | Path) -> list[AlignedPair]:
    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"alignment file not found: {p}")
    try:
        return read_alignments(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise TellkitError(f"{p}: not UTF-8 text") from exc


def parse_alignments(text: str) -> list[list[Alignment]]:
    """The spans of every block of METEOR's ``-writeAlignments`` output, in input order."""
    return [list(p.spans) for p in read_alignments(text)]


def mismatched_pairs(
    pairs: Sequence[AlignedPair], predictions: Sequence[str], references: Sequence[str]
) -> list[int]:
    """Indices of alignment blocks whose two lines are not the given prediction / reference
    (whitespace tokens compared), e.g. a file aligned against another system's output."""
    if len(pairs) != len(predictions) or len(pairs) != len(references):
        raise TellkitError(
            f"alignment file has {len(pairs)} pairs for {len(predictions)} predictions / {len(references)} references"
        )
    return [
        i for i, (a, p, r) in enumerate(zip(pairs, predictions, references))
        if a.prediction != tuple(p.split()) or a.reference != tuple(r.split())
    ]


def meteor_alignments(
    predictions: Sequence[str], references: Sequence[str], memory: str = "2G"
) -> list[list[Alignment]]:
    """Run METEOR 1.5 once over all pairs (whitespace tokens, as given) and return the alignments."""
    if len(predictions) != len(references):
        raise TellkitError(f"{len(predictions)} predictions but {len(references)} references")
    java, jar = _java(), meteor_jar()
    with tempfile.TemporaryDirectory(prefix="tellkit-meteor-") as tmp:
        t = Path(tmp)
        (t / "pred.txt").write_text("".join(" ".join(p.split()) + "\n" for p in predictions), encoding="utf-8")
        (t / "ref.txt").write_text("".join(" ".join(r.split()) + "\n" for r in references), encoding="utf-8")
        cmd = [java, f"-Xmx{memory}", "-jar", str(jar), "pred.txt", "ref.txt", "-l", "en",
               "-writeAlignments", "-f", "run"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0:
            raise TellkitError(f"METEOR failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        found = parse_alignments((t / "run-align.out").read_text(encoding="utf-8"))
    if len(found) != len(predictions):
        raise TellkitError(f"METEOR returned {len(found)} alignments for {len(predictions)} pairs")
    return found


def content_f1_pair(pred: Sequence[str], ref: Sequence[str], spans: Sequence[Alignment], stop: frozenset[str]) -> float:
    """tellkit's Content F1 (0-1) of one token pair given its alignment spans."""
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


def content_f1_reference_pair(pair: AlignedPair, summary_stopwords: frozenset[str] = SUMMARY_STOPWORDS) -> float:
    """The VG-GPLMs evaluation script's Content F1 (0-1) of one alignment block."""
    pred, ref = pair.prediction, pair.reference
    dropped_ref: set[str] = set()
    dropped_pred: set[str] = set()
    kept: list[Alignment] = []
    for rs, rl, ps, pl in pair.spans:
        if rl == 1 and ref[rs] in summary_stopwords:
            dropped_ref.add(ref[rs])
            dropped_pred.add(pred[ps])
        else:
            kept.append((rs, rl, ps, pl))
    ref_types = {w for w in ref if w not in dropped_ref}
    pred_types = {w for w in pred if w not in dropped_pred}
    if not ref_types or not pred_types:
        return 0.0
    ref_ratio = sum(rl for _, rl, _, _ in kept) / len(ref_types)
    pred_ratio = sum(pl for _, _, _, pl in kept) / len(pred_types)
    if ref_ratio + pred_ratio == 0:
        return 0.0
    return 2 * ref_ratio * pred_ratio / (ref_ratio + pred_ratio)


def content_f1_from_alignments(pairs: Sequence[AlignedPair], stop: frozenset[str] | None = None) -> dict[str, float]:
    """Both definitions, in percent, from already computed METEOR alignments:
    ``{"tellkit": ..., "reference": ...}`` (``stop`` defaults to :func:`stop_words`, which reads
    METEOR's function-word list from its jar)."""
    if not pairs:
        raise TellkitError("Content F1: no aligned pairs")
    stop = stop_words() if stop is None else stop
    n = len(pairs)
    return {
        "tellkit": 100.0 * sum(content_f1_pair(p.prediction, p.reference, p.spans, stop) for p in pairs) / n,
        "reference": 100.0 * sum(content_f1_reference_pair(p) for p in pairs) / n,
    }


def content_f1_both(
    predictions: Sequence[str], references: Sequence[str], lowercase: bool = True
) -> dict[str, float]:
    """Both definitions, in percent, running METEOR 1.5 over the pairs (needs Java). Tokens are
    whitespace tokens (lower-cased by default); an empty line on either side scores 0."""
    if len(predictions) != len(references):
        raise TellkitError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise TellkitError("Content F1: nothing to score")
    norm = (lambda t: t.lower()) if lowercase else (lambda t: t)
    preds = [norm(p).split() for p in predictions]
    refs = [norm(r).split() for r in references]
    keep = [i for i in range(len(preds)) if preds[i] and refs[i]]  # METEOR cannot align empty lines
    spans = meteor_alignments([" ".join(preds[i]) for i in keep], [" ".join(refs[i]) for i in keep]) if keep else []
    pairs = [AlignedPair(tuple(preds[i]), tuple(refs[i]), tuple(s)) for i, s in zip(keep, spans)]
    stop = stop_words()
    n = len(preds)
    return {
        "tellkit": 100.0 * sum(content_f1_pair(p.prediction, p.reference, p.spans, stop) for p in pairs) / n,
        "reference": 100.0 * sum(content_f1_reference_pair(p) for p in pairs) / n,
    }


def content_f1(predictions: Sequence[str], references: Sequence[str]) -> float:
    """tellkit's mean Content F1 over pairs, in percent (lower-cased, whitespace tokens). Needs Java."""
    return content_f1_both(predictions, references)["tellkit"]
