"""`tellkit demo` (what `make demo` runs): the packaged samples through the packaged default
models, captions and handwritten math."""
import json
from pathlib import Path

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
