"""BTTR's training-side pieces: the bidirectional targets (built without host reads) against a
plain re-statement of the reference's per-row construction."""
from __future__ import annotations

import torch

from tellkit.models.bttr import EOS, PAD, SOS, bidirectional_targets


def _per_row(labels: torch.Tensor, lengths: torch.Tensor):
    """The reference's construction, one expression at a time."""
    b, t = labels.shape
    inp = torch.full((2 * b, t + 1), PAD, dtype=torch.long)
    tgt = torch.full((2 * b, t + 1), PAD, dtype=torch.long)
    for i in range(b):
        n = int(lengths[i])
        y = labels[i, :n]
        inp[i, 0], inp[i, 1 : n + 1], tgt[i, :n], tgt[i, n] = SOS, y, y, EOS
        r = y.flip(0)
        inp[b + i, 0], inp[b + i, 1 : n + 1], tgt[b + i, :n], tgt[b + i, n] = EOS, r, r, SOS
    return inp, tgt


def test_bidirectional_targets_equal_the_per_row_construction():
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        b, t = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        lengths = torch.randint(1, t + 1, (b,), generator=g)
        lengths[0] = t  # the longest row fills the batch
        labels = torch.randint(3, 110, (b, t), generator=g)
        for i in range(b):
            labels[i, lengths[i]:] = PAD
        want, got = _per_row(labels, lengths), bidirectional_targets(labels, lengths)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
