"""`tellkit demo` (what `make demo` runs): the packaged samples through the packaged default
models, captions and handwritten math."""
import json
from pathlib import Path

import pytest

from tellkit.cli import main

DEMO = Path(__file__).resolve().parents[1] / "src" / "tellkit" / "assets" / "demo_caption"


def test_demo_captions_the_samples_and_reads_the_formula(capsys):
    assert main(["demo", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    captions = [r for r in lines if r["image"].endswith(".jpg")]
    assert sorted(r["image"] for r in captions) == sorted(p.name for p in DEMO.glob("*.jpg"))
    assert all(len(r["text"].split()) >= 3 and r["tokens"] for r in captions)
    (math,) = [r for r in lines if "truth" in r]
    assert math["image"] == "bttr_x2_plus_1.png" and math["truth"] == "x ^ { 2 } + 1"
    assert math["tokens"] and math["text"] == " ".join(math["tokens"])


def test_demo_without_math(capsys):
    assert main(["demo", "--no-math"]) == 0
    out = capsys.readouterr().out
    assert "handwritten math" not in out and out.count(".jpg") >= 4


def test_every_demo_photo_is_marked_and_sourced():
    """The photos show what the captioner is for and what it is not for; each has its origin and
    terms in SOURCES.md; together they stay small."""
    from tellkit.server.samples import CAPTION_SAMPLES, caption_samples

    photos = sorted(p.name for p in DEMO.glob("*.jpg"))
    assert sorted(CAPTION_SAMPLES) == photos
    domains = [s["domain"] for s in caption_samples()]
    assert "outside" in domains and domains.count("inside") >= 3
    assert domains == sorted(domains, key=["inside", "outside"].index)  # the model's own kind of photo first
    sources = (DEMO / "SOURCES.md").read_text(encoding="utf-8")
    for name in photos:
        row = next(ln for ln in sources.splitlines() if ln.startswith(f"| {name} |"))
        assert any(t in row for t in ("CC0", "CC BY 4.0", "public domain")), row
    assert sum(p.stat().st_size for p in DEMO.iterdir()) < 300_000


@pytest.mark.slow
def test_the_packaged_model_reads_every_sample_formula(capsys):
    from tellkit.server.samples import MATH_DIR, MATH_SAMPLES, math_samples

    assert [m["name"] for m in math_samples()] == list(MATH_SAMPLES) and len(MATH_SAMPLES) >= 4
    assert main(["recognize", *(str(MATH_DIR / n) for n in MATH_SAMPLES), "--json"]) == 0
    read = {Path(r["input"]).name: r["text"] for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert read == MATH_SAMPLES
