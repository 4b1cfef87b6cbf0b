"""Length bucketing with a token cap per batch (as the reference's AllenNLP bucket iterator:
batches of similar length, at most ``batch_size`` samples and ``max_tokens`` padded tokens).

    batches = bucket_batches(lengths, batch_size=16, max_tokens=16384, shuffle=True, seed=1, epoch=0)

``lengths[i]`` is sample i's cost (e.g. context tokens + caption tokens). Samples are sorted by
length (with +-10% multiplicative noise when shuffling, so batches differ between epochs), cut
greedily into batches whose padded size ``len(batch) * max(length)`` stays within
``max_tokens``, and the batch order is shuffled. A sample longer than ``max_tokens`` on its own
gets a batch of one. Deterministic given (seed, epoch).
"""
from __future__ import annotations

import random
from collections.abc import Sequence


def bucket_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None, *, shuffle: bool = True,
                   seed: int = 0, epoch: int = 0, noise: float = 0.1) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + epoch)
    keys = [(L * (1.0 + rng.uniform(-noise, noise)) if shuffle else L, i) for i, L in enumerate(lengths)]
    order = [i for _, i in sorted(keys)]
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        L = max(1, int(lengths[i]))
        new_max = max(cur_max, L)
        if cur and (len(cur) >= batch_size or (max_tokens is not None and new_max * (len(cur) + 1) > max_tokens)):
            batches.append(cur)
            cur, new_max = [], L
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    if shuffle:
        rng.shuffle(batches)
    return batches
