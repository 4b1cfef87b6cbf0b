"""Runaway outputs (tellkit.decoding.runaway): the check itself, and BTTR's joint search ending a
runaway search early only where a caller turned the check on."""
from __future__ import annotations

import pytest
import torch

from tellkit.decoding.runaway import RunawayStop, active, stopping_runaways

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


def test_the_check_is_scoped_to_the_block():
    assert active() is None
    with stopping_runaways(RunawayStop(floor=-2.0)) as p:
        assert active() is p
    assert active() is None


def test_the_joint_search_stops_runaways_only_inside_the_block():
    from tellkit.registry import create_model

    torch.manual_seed(0)
    model = create_model("bttr/tiny").eval()
    image = torch.rand(2, 1, 64, 96)
    free = model.generate(image, beam_size=3, max_len=40)
    assert model.generate(image, beam_size=3, max_len=40) == free  # deterministic
    with stopping_runaways(RunawayStop(floor=-1e-3, after=3)):
        cut = model.generate(image, beam_size=3, max_len=40)
    assert max(len(t) for t in free["tokens"]) > 3  # a random model runs on
    assert all(len(t) <= 3 for t in cut["tokens"]), cut["tokens"]
    assert model.generate(image, beam_size=3, max_len=40) == free  # and the block leaves nothing behind
