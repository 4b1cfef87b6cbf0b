"""`tellkit demo` (what `make demo` runs): the packaged samples through the packaged default
models, captions and handwritten math."""
import json

from tellkit.cli import main


def test_demo_captions_the_samples_and_reads_the_formula(capsys):
    assert main(["demo", "--json"]) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    captions = [r for r in lines if "caption" in r]
    assert sorted(r["image"] for r in captions) == ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]
    assert all(len(r["caption"].split()) >= 3 for r in captions)
    (math,) = [r for r in lines if "latex" in r]
    assert math["image"] == "bttr_x2_plus_1.png" and math["truth"] == "x ^ { 2 } + 1"
    assert math["tokens"] and math["latex"] == " ".join(math["tokens"])


def test_demo_without_math(capsys):
    assert main(["demo", "--no-math"]) == 0
    out = capsys.readouterr().out
    assert "handwritten math" not in out and out.count(".jpg") >= 4
