"""Runaway outputs (tellkit.decoding.runaway): the check itself, and BTTR's joint search ending a
runaway search early only when it is given a policy (``stop=``), which the recognition
generation config's ``stop_runaways`` turns on for every entry point."""
from __future__ import annotations

import pytest
import torch

from tellkit.decoding.runaway import RunawayStop

NEG = float("-inf")


def test_the_floor_is_per_generated_token_of_the_best_live_beam():
    stop = RunawayStop(floor=-1.0, after=4, max_repeat=50)
    tokens = torch.arange(2 * 3 * 5).view(2, 3, 5)
    scores = torch.tensor([[-6.0, -4.9, NEG], [-5.1, NEG, NEG]])  # best per token: -0.98, -1.02
    assert stop.stopped(tokens, scores).tolist() == [False, True]
    assert not stop.stopped(tokens[:, :, :3], scores * 3 / 5).any()  # before `after` tokens: never


def test_repeats_count_only_when_every_live_beam_repeats():
    stop = RunawayStop(floor=-100.0, after=1, max_repeat=4)
    rep = torch.tensor([1, 2, 7, 7, 7, 7])
    other = torch.tensor([7, 7, 7, 7, 7, 3])
    tokens = torch.stack([torch.stack([rep, rep]), torch.stack([rep, other])])
    assert stop.stopped(tokens, torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])).tolist() == [True, False]
    assert stop.stopped(tokens, torch.tensor([[-1.0, -2.0], [-1.0, NEG]])).tolist() == [True, True]  # dead: ignored


@pytest.mark.parametrize("kw", [{"floor": float("nan")}, {"floor": 0.5}, {"after": 0}, {"max_repeat": 1}])
def test_bad_policies_are_refused(kw):
    with pytest.raises(ValueError):
        RunawayStop(**kw)


def test_the_joint_search_stops_runaways_only_when_given_a_policy():
    from tellkit.registry import create_model

    torch.manual_seed(0)
    model = create_model("bttr/tiny").eval()
    image = torch.rand(2, 1, 32, 48)
    free = model.generate(image, beam_size=3, max_len=16)
    assert model.generate(image, beam_size=3, max_len=16) == free  # deterministic
    cut = model.generate(image, beam_size=3, max_len=16, stop=RunawayStop(floor=-1e-3, after=3))
    assert max(len(t) for t in free["tokens"]) > 3  # a random model runs on
    assert all(len(t) <= 3 for t in cut["tokens"]), cut["tokens"]
    assert model.generate(image, beam_size=3, max_len=16) == free  # the policy is per call


def test_the_generation_setting_gives_the_search_its_policy(monkeypatch):
    """``stop_runaways`` (default on) reaches the search as the recognition policy; off, the
    search gets none; a value that is not a boolean is a one-line error."""
    from tellkit.errors import TellkitError
    from tellkit.tasks.recognition import RecognitionEvalConfig, RecognitionGeneration, RecognitionProcessor

    proc, seen = RecognitionProcessor(), []

    class Model:
        def generate(self, image, mask, **kw):
            seen.append(kw)
            return {"tokens": [[]], "scores": [0.0]}

    batch = {"image": torch.zeros(1, 1, 8, 8), "image_mask": torch.ones(1, 8, 8, dtype=torch.bool)}
    proc.generate(Model(), batch, RecognitionGeneration())
    proc.generate(Model(), batch, RecognitionGeneration(stop_runaways=False))
    on, off = seen
    assert isinstance(on["stop"], RunawayStop) and on["stop"].best_only and on["stop"].max_depth
    assert off["stop"] is None and "stop_runaways" not in on
    assert RecognitionEvalConfig.from_section({"stop_runaways": False}).stop_runaways is False
    with pytest.raises(TellkitError, match="stop_runaways"):
        RecognitionGeneration(stop_runaways="yes")


def test_a_cycle_of_few_tokens_is_a_runaway_but_crohme_like_text_is_not():
    stop = RunawayStop(floor=-100.0, after=1, max_repeat=100, window=8, max_distinct=3, max_share=0.5)
    cycle = torch.tensor([9, 1, 5, 1, 6, 1, 5, 1, 6])          # "| ) | ( ..." : 1 is half of the last 8
    few = torch.tensor([9, 2, 3, 4, 2, 3, 4, 2, 3])            # 3 different tokens in the last 8
    text = torch.tensor([9, 10, 11, 12, 13, 11, 14, 15, 16])   # 7 different, none twice in 4
    tokens = torch.stack([torch.stack([cycle]), torch.stack([few]), torch.stack([text])])
    assert stop.stopped(tokens, torch.full((3, 1), -1.0)).tolist() == [True, True, False]
    assert not stop.stopped(tokens[:, :, :7], torch.full((3, 1), -1.0)).any()  # shorter than the window


def test_groups_nested_deeper_than_the_limit_are_a_runaway_in_either_direction():
    """``max_depth``: open groups counted along each hypothesis (``{`` = 1, ``}`` = 2 here); a
    right-to-left hypothesis meets its closers first. Off without openers/closers."""
    stop = RunawayStop(floor=-100.0, after=1, max_repeat=100, window=100, max_depth=3, openers=(1,), closers=(2,))
    deep = torch.tensor([5, 1, 6, 1, 7, 1, 8, 1, 9, 2])      # 4 open at once
    r2l = torch.tensor([5, 2, 6, 2, 7, 2, 8, 2, 9, 1])       # the same read backwards
    flat = torch.tensor([1, 5, 2, 1, 6, 2, 1, 1, 2, 2])      # never more than 2 open
    tokens = torch.stack([torch.stack([deep]), torch.stack([r2l]), torch.stack([flat])])
    assert stop.stopped(tokens, torch.full((3, 1), -1.0)).tolist() == [True, True, False]
    best_only = RunawayStop(floor=-100.0, max_depth=3, openers=(1,), closers=(2,), best_only=True)
    pair = torch.stack([deep, flat]).view(1, 2, -1)
    assert best_only.stopped(pair, torch.tensor([[-1.0, -2.0]])).tolist() == [True]
    assert best_only.stopped(pair, torch.tensor([[-2.0, -1.0]])).tolist() == [False]
    with pytest.raises(ValueError):
        RunawayStop(max_depth=3)


def test_the_latex_policy_reads_the_vocabulary_and_flags_deep_answers():
    from tellkit.data.latex import Vocab
    from tellkit.decoding.confidence import runaway
    from tellkit.decoding.runaway import LATEX_MAX_DEPTH, latex_policy

    vocab = Vocab()
    policy = latex_policy(vocab.stoi, best_only=True)
    assert {vocab.itos[i] for i in policy.openers} == {"{", "[", "("} and policy.best_only
    deep = ["\\sqrt", "{", "x"] * (LATEX_MAX_DEPTH + 1)
    assert runaway(deep) and not runaway([t for c in "abcdefghij" for t in ("\\sqrt", "{", c, "}", "+")])
    assert not runaway(["\\frac", "{", "\\sqrt", "{", "(", "a", "+", "b", ")", "}", "}", "{", "2", "}"])
