"""Answers say how sure they are: the calibrated confidence (monotone, in 0..1), the 'unsure'
flag (always for runaway outputs), the fallback of a checkpoint without calibration, the stored
calibration's round trip through `tellkit calibrate`, and the fields in every interface (the
pipelines, the command line, the server)."""
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tellkit.checkpoint import read_checkpoint_config, save_model
from tellkit.cli import main
from tellkit.decoding import confidence as C
from tellkit.decoding import runaway
from tellkit.errors import TellkitError
from tellkit.pipelines.recognition import RecognitionPipeline
from tellkit.registry import create_model
from tellkit.tasks.recognition import RecognitionProcessor

CAL = C.Calibration((3.0, -0.5), 2.0, 0.3, right="exact match", fitted_on="made up", n=100, auroc=0.8)


def _expression(path):
    im = Image.new("L", (160, 64), 255)
    d = ImageDraw.Draw(im)
    d.line((20, 32, 70, 32), fill=0, width=4)
    d.line((45, 10, 45, 54), fill=0, width=4)
    d.ellipse((95, 15, 135, 50), outline=0, width=4)
    im.save(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_reader(tmp_path_factory):
    """A tiny random BTTR checkpoint (no calibration) and an expression image."""
    d = tmp_path_factory.mktemp("conf")
    torch.manual_seed(0)
    save_model(create_model("bttr/tiny"), d / "bttr", extra={"task": "recognize",
                                                            "eval": {"beam_size": 2, "max_len": 8}})
    return d / "bttr", _expression(d / "e.png")


# --- the mapping --------------------------------------------------------------------------------
def test_confidence_is_in_0_1_and_never_falls_as_the_score_rises():
    for weights, bias in [((3.0, -0.5), 2.0), ((0.0, 1.0), -1.0), ((40.0, 2.0), 30.0)]:
        cal = C.Calibration(weights, bias, 0.5)
        for n in (0, 1, 7, 200):
            values = [cal.confidence(s, n) for s in np.linspace(-60.0, 0.0, 241)]
            assert all(0.0 <= v <= 1.0 for v in values)
            assert all(b >= a for a, b in zip(values, values[1:]))
    assert CAL.confidence(-0.1, 5) > CAL.confidence(-1.0, 5) > CAL.confidence(-3.0, 5)
    for bad in [((-1.0, 0.0), 0.0, 0.5), ((1.0,), 0.0, 0.5), ((1.0, 0.0), 0.0, 1.5), ((float("nan"), 0.0), 0.0, 0.5)]:
        with pytest.raises(TellkitError, match="confidence calibration"):
            C.Calibration(*bad)


def test_auroc_is_the_share_of_right_wrong_pairs_in_order():
    rng = random.Random(3)
    values = [rng.choice([0.1, 0.2, 0.2, 0.5, 0.7]) for _ in range(60)]  # many ties
    right = [rng.random() < v for v in values]
    pos = [v for v, r in zip(values, right) if r]
    neg = [v for v, r in zip(values, right) if not r]
    pairs = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    assert C.auroc(values, right) == pytest.approx(pairs)
    assert C.auroc([1, 2, 3, 4], [False, False, True, True]) == 1.0
    assert C.auroc([1, 2, 3, 4], [True, True, False, False]) == 0.0
    assert C.auroc([1, 2], [True, True]) is None


def test_fit_finds_the_curve_and_leaves_the_asked_share_unsure():
    rng = np.random.RandomState(0)
    n = 600
    scores, lengths = rng.normal(-0.6, 0.5, n), rng.randint(1, 30, n)
    right = rng.rand(n) < 1 / (1 + np.exp(-(4.0 * scores + 2.0)))  # the length says nothing
    cal = C.fit(scores.tolist(), lengths.tolist(), right.tolist(), unsure_share=0.2, right_means="r", fitted_on="f")
    assert 3.0 < cal.weights[0] < 5.5 and abs(cal.weights[1]) < 0.5 and 1.0 < cal.bias < 3.5
    confs = [cal.confidence(s, k) for s, k in zip(scores, lengths)]
    assert abs(np.mean([c < cal.threshold for c in confs]) - 0.2) <= 1 / n
    assert cal.auroc == pytest.approx(C.auroc(confs, right.tolist()), abs=1e-4) and cal.auroc > 0.7
    assert (cal.n, cal.right, cal.fitted_on) == (n, "r", "f")
    # a score that goes the wrong way is not used (confidence must not fall as the score rises)
    upside_down = C.fit(scores.tolist(), lengths.tolist(), (scores < -0.6).tolist())
    assert upside_down.weights[0] == 0.0
    with pytest.raises(TellkitError, match="all right or all wrong"):
        C.fit(scores.tolist(), lengths.tolist(), [True] * n)
    with pytest.raises(TellkitError, match="at least 10"):
        C.fit([-0.1] * 5, [3] * 5, [True, False] * 2 + [True])


# --- runaway and empty answers ----------------------------------------------------------------------
def test_runaway_answers_are_unsure_whatever_their_score():
    assert C.runaway(["|"] * 40) and C.runaway(["(", "|", ")", "|"] * 10)
    assert not C.runaway("x ^ { 2 } + 1".split()) and not C.runaway(list("abcdefghijklmnopqrstuvwxyz0123456789"))
    assert C.runaway(list("abcdefgh"), max_len=8) and not C.runaway(list("abcdefgh"), max_len=9)
    good = C.assess(CAL, -0.01, ["x"])
    assert good["unsure"] is False and good["confidence"] > CAL.threshold
    bad = C.assess(CAL, -0.01, ["|"] * 40)
    assert bad["unsure"] is True and bad["confidence"] <= CAL.threshold
    assert C.assess(CAL, None, ["x"]) == {"confidence": 0.0, "unsure": True}
    assert C.assess(CAL, -0.01, [])["unsure"] is True
    # through the recognition processor's decoding, as every interface gets it
    proc = RecognitionProcessor(calibration=CAL)
    bar, x = proc.vocab.encode(["|"])[0], proc.vocab.encode(["x"])[0]
    out = proc.decode({"tokens": [[bar] * 40, [x]], "scores": [-0.01, -0.01]}, {}, max_len=200)
    assert [r["unsure"] for r in out] == [True, False] and out[0]["text"] == " ".join(["|"] * 40)


def test_recognition_pipeline_stops_runaway_searches(tiny_reader, monkeypatch):
    """The stored generation setting (default: on) gives the search the recognition policy,
    judged on the best live hypothesis; ``stop_runaways=False`` runs the reference search."""
    path, image = tiny_reader
    seen = []
    pipe = RecognitionPipeline.load(path)
    real = pipe.model.generate

    def spy(*a, **k):
        seen.append(k.get("stop"))
        return real(*a, **k)

    monkeypatch.setattr(pipe.model, "generate", spy)
    pipe(image)
    assert isinstance(seen[-1], runaway.RunawayStop) and seen[-1].best_only
    off = RecognitionPipeline.load(path, stop_runaways=False)
    monkeypatch.setattr(off.model, "generate", spy)
    off(image)
    assert seen[-1] is None


# --- a checkpoint without calibration ------------------------------------------------------------------
def test_a_checkpoint_without_calibration_gives_no_number(tiny_reader):
    path, image = tiny_reader
    assert C.from_meta(read_checkpoint_config(path)) is None
    pipe = RecognitionPipeline.load(path)
    res = pipe(image)
    assert res["confidence"] is None and res["unsure"] is C.runaway(res["tokens"], 8)
    assert C.assess(None, -0.01, ["|"] * 40) == {"confidence": None, "unsure": True}
    assert C.assess(None, -0.01, ["x"]) == {"confidence": None, "unsure": False}
    assert C.describe({"confidence": None, "unsure": False}) == ""
    assert C.describe({"confidence": None, "unsure": True}) == C.UNSURE_NOTE


# --- the stored calibration ----------------------------------------------------------------------------
def _predictions(path, n=80, seed=1):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        score = -abs(rng.gauss(0.4, 0.5))
        ok = bool(rng.random() < 1 / (1 + np.exp(-(4 * score + 2))))
        rows.append({"id": str(i), "prediction": " ".join(["x"] * rng.randint(1, 9)), "reference": "x",
                     "score": score, "distance": 0, "correct": ok})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return rows


def _calibrated(path, tmp_path, preds_name, out_name):
    """``tellkit calibrate`` of the checkpoint at ``path`` on written predictions -> (predictions, copy)."""
    preds, out = tmp_path / preds_name, tmp_path / out_name
    _predictions(preds)
    assert main(["calibrate", str(path), "--predictions", str(preds), "--out", str(out)]) == 0
    return preds, out


def test_calibrate_writes_a_copy_that_loads_and_round_trips(tiny_reader, tmp_path, capsys):
    path, image = tiny_reader
    preds, out = _calibrated(path, tmp_path, "predictions_val.jsonl", "calibrated")
    printed = json.loads(capsys.readouterr().out)
    cal = C.from_meta(read_checkpoint_config(out))
    assert cal == C.Calibration.from_dict(printed) == C.Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert cal.n == 80 and cal.right.startswith("exact match") and cal.weights[0] > 0
    assert "confidence" not in read_checkpoint_config(path)  # the original is untouched
    pipe = RecognitionPipeline.load(out)
    assert pipe.processor.calibration == cal
    res = pipe(image)
    expected = cal.confidence(res["score"], len(res["tokens"]))
    if C.runaway(res["tokens"], 8):
        expected = min(expected, cal.threshold)
    assert res["confidence"] == pytest.approx(expected, abs=1e-4)
    assert res["unsure"] is (C.runaway(res["tokens"], 8) or expected < cal.threshold)
    # refusals: one line, no traceback
    assert main(["calibrate", str(path), "--predictions", str(preds), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "text": "x"}\n', encoding="utf-8")
    assert main(["calibrate", str(path), "--predictions", str(bad), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(TellkitError, match="logistic"):
        C.Calibration.from_dict({**cal.to_dict(), "method": "isotonic"})


def test_the_packaged_models_carry_their_calibration():
    from tellkit.recipes import PACKAGED_DEFAULTS

    for task, right in [("recognize", "exact match"), ("caption", "caption CIDEr-D")]:
        cal = C.from_meta(read_checkpoint_config(PACKAGED_DEFAULTS[task]))
        assert cal is not None and cal.right.startswith(right) and cal.n >= 300 and cal.auroc > 0.6
        assert (cal.input is not None) == (task == "caption")  # the captioner also checks its photos


# --- every interface ------------------------------------------------------------------------------------
def test_command_line_json_and_plain_output(tiny_reader, tmp_path, capsys):
    path, image = tiny_reader
    _, out = _calibrated(path, tmp_path, "p.jsonl", "cal")
    capsys.readouterr()
    assert main(["recognize", image, "--model", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert 0.0 <= res["confidence"] <= 1.0 and isinstance(res["unsure"], bool)
    assert main(["recognize", image, "--model", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == res["text"]  # the answer alone on stdout
    assert cap.err.strip() == C.describe(res) and f"confidence {res['confidence']:.2f}" in cap.err
    assert main(["recognize", image, image, "--model", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    column = f"{res['confidence']:.2f}" + (" unsure" if res["unsure"] else "")
    assert lines == [f"{image}\t{res['text']}\t{column}"] * 2


@pytest.fixture(scope="module")
def captioner():
    from tellkit.pipelines.captioning import CaptioningPipeline

    return CaptioningPipeline.load()


def test_caption_pipeline_and_command_line(captioner, capsys):
    from tellkit.recipes import ASSETS

    photo = str(ASSETS / "demo_caption" / "dogs.jpg")
    res = captioner(photo)
    cal = captioner.processor.calibration
    assert cal is not None and 0.0 <= res["confidence"] <= 1.0 and isinstance(res["unsure"], bool)
    assert res["confidence"] == pytest.approx(cal.confidence(res["score"], len(res["tokens"])), abs=1e-4)
    brief = captioner(photo, details=False)
    assert set(brief) == {"text", "score", "confidence", "unsure"} and brief["confidence"] == res["confidence"]
    assert main(["caption", photo, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["confidence"] == res["confidence"] and row["unsure"] == res["unsure"]


def test_server_answers_carry_confidence_and_unsure(captioner, tiny_reader):
    pytest.importorskip("fastapi")
    pytest.importorskip("python_multipart")
    from fastapi.testclient import TestClient

    from tellkit.server.app import create_app
    from tellkit.server.limits import Limits

    path, image = tiny_reader
    reader = RecognitionPipeline.load(path)
    reader.processor.calibration = CAL
    app = create_app({"caption": captioner, "recognize": reader},
                     Limits(max_upload_bytes=300_000, max_image_pixels=400_000))
    with TestClient(app) as client:
        with open(image, "rb") as f:
            r = client.post("/api/recognize", files={"image": ("e.png", f.read(), "image/png")})
        assert r.status_code == 200, r.text
        res = r.json()
        assert 0.0 <= res["confidence"] <= 1.0 and isinstance(res["unsure"], bool)
        assert res["confidence"] == C.assess(CAL, res["score"], res["tokens"], 8)["confidence"]
        from tellkit.recipes import ASSETS

        photo = (ASSETS / "demo_caption" / "dogs.jpg").read_bytes()
        r = client.post("/api/caption", files={"image": ("dogs.jpg", photo, "image/jpeg")})
        assert r.status_code == 200, r.text
        res = r.json()
        assert 0.0 <= res["confidence"] <= 1.0 and isinstance(res["unsure"], bool)



def test_the_input_check_flags_inputs_far_from_the_typical_ones():
    rng = np.random.RandomState(0)
    direction = rng.rand(64) + 0.5
    typical = direction[None] * (1 + 0.1 * rng.randn(200, 64))  # all near one direction
    check = C.fit_input_check(torch.tensor(typical), share=0.05, fitted_on="t")
    assert C.InputCheck.from_dict(json.loads(json.dumps(check.to_dict()))) == check
    far = np.sum(np.array([check.distance(v) > check.limit for v in typical[1::2]]))
    assert far <= int(np.ceil(0.05 * 100))  # the asked share of held-out typical inputs, at most
    odd = rng.rand(64) * (rng.rand(64) < 0.2)  # another direction
    assert check.distance(odd) > check.limit and check.distance(direction * 3) < 1e-3
    cal = C.Calibration(CAL.weights, CAL.bias, CAL.threshold, input=check)
    assert C.Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    sure = C.assess(cal, -0.01, ["a", "dog"], 30, torch.tensor(direction))
    unlike = C.assess(cal, -0.01, ["a", "dog"], 30, torch.tensor(odd))
    assert sure["unsure"] is False and unlike["unsure"] is True and unlike["confidence"] <= cal.threshold
    assert C.assess(cal, -0.01, ["a", "dog"], 30, None) == sure  # no features: the curve alone
    with pytest.raises(TellkitError, match="at least 20"):
        C.fit_input_check(torch.tensor(typical[:10]))
    with pytest.raises(TellkitError, match="measures 64"):
        check.distance(np.zeros(3))


def test_calibrate_a_captioner_with_its_typical_photos(tmp_path, capsys):
    """Caption predictions (CIDEr-D per caption) and typical photos: the copy's calibration holds
    the curve and an input check measured with the captioner's own image encoder."""
    from tellkit.pipelines.captioning import CaptioningPipeline
    from tellkit.recipes import PACKAGED_DEFAULTS

    rng = random.Random(2)
    rows = []
    for i in range(60):
        score = -abs(rng.gauss(0.5, 0.4))
        cider = max(0.0, 60 + 80 * (score + 0.5) + rng.gauss(0, 30))
        rows.append({"id": f"{i}.jpg#0", "image_id": f"{i}.jpg", "prediction": "a dog runs", "references": ["a dog"],
                     "score": score, "length": rng.randint(5, 15), "scores": {"cider": cider}})
    preds = tmp_path / "predictions_val.jsonl"
    preds.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    photos = tmp_path / "typical"
    photos.mkdir()
    for i in range(24):  # outdoor-like scenes: sky over grass, a figure
        im = Image.new("RGB", (96, 96), (100 + 4 * i, 150, 230))
        d = ImageDraw.Draw(im)
        d.rectangle((0, 55 + i % 10, 96, 96), fill=(40, 120 + 3 * i, 40))
        d.ellipse((30 + i, 30, 50 + i, 70), fill=(120, 70, 40))
        im.save(photos / f"p{i:02d}.png")
    out = tmp_path / "cap"
    assert main(["calibrate", str(PACKAGED_DEFAULTS["caption"]), "--predictions", str(preds), "--out", str(out),
                 "--cider-at-least", "60", "--typical", str(photos), "--typical-share", "0.1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    cal = C.from_meta(read_checkpoint_config(out))
    assert cal.right.endswith(">= 60 against the image's references") and cal.n == 60
    assert cal.input is not None and len(cal.input.mean) == 1280 and printed["input"]["mean"] == "<1280 numbers>"
    assert cal.input.fitted_on == "24 typical photos"
    pipe = CaptioningPipeline.load(out)
    near = pipe(str(photos / "p03.png"), details=False)
    screen = Image.new("RGB", (96, 96), "white")
    ImageDraw.Draw(screen).text((5, 40), "File Edit View", fill="black")
    far = pipe(screen, details=False)
    feats = [pipe.processor.encode([pipe.processor.prepare(x)])[0]["image"].mean(0)
             for x in (str(photos / "p03.png"), screen)]
    assert [cal.input.distance(f) > cal.input.limit for f in feats] == [False, True]
    assert far["unsure"] is True and far["confidence"] <= cal.threshold
    tokens = len(pipe(str(photos / "p03.png"))["tokens"])
    assert near["confidence"] == pytest.approx(cal.confidence(near["score"], tokens), abs=1e-4)
    # an input check is for captioners; a recognition checkpoint refuses it in one line
    assert main(["calibrate", str(PACKAGED_DEFAULTS["recognize"]), "--predictions", str(preds), "--out",
                 str(tmp_path / "r"), "--typical", str(photos)]) == 2
    assert "line 1" in capsys.readouterr().err  # caption rows are not recognition predictions


def test_best_only_stops_when_the_best_hypothesis_cycles():
    """``RunawayStop(best_only=True)``: a search stops once its best live hypothesis repeats or
    cycles, even while a weaker one does not; the default waits for every live hypothesis."""
    cycling = torch.tensor([1, 2] * 20)
    varied = torch.arange(40) % 13
    tokens = torch.stack([cycling, varied]).view(1, 2, 40)
    best_cycles, best_varied = torch.tensor([[-1.0, -5.0]]), torch.tensor([[-5.0, -1.0]])
    assert not bool(runaway.RunawayStop(floor=-1e9).stopped(tokens, best_cycles)[0])
    assert bool(runaway.RunawayStop(floor=-1e9, best_only=True).stopped(tokens, best_cycles)[0])
    assert not bool(runaway.RunawayStop(floor=-1e9, best_only=True).stopped(tokens, best_varied)[0])
    dead = torch.tensor([[-1.0, float("-inf")]])  # a dead slot is never the best
    assert bool(runaway.RunawayStop(floor=-1e9, best_only=True).stopped(tokens, dead)[0])


def test_the_packaged_reader_flags_noise_and_stops_early(capsys, tmp_path):
    """A picture that is no formula: a short answer, flagged, exit 0 (as the page and API say)."""
    noise = tmp_path / "noise.png"
    Image.fromarray((np.random.RandomState(0).rand(120, 160) * 255).astype("uint8")).save(noise)
    assert main(["recognize", str(noise), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    # stopped early: well under half of the search's 200-token limit
    assert res["unsure"] is True and res["confidence"] < 0.05 and len(res["tokens"]) < 100
