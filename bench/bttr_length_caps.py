"""What BTTR's training drops or shrinks, by length of the true LaTeX (docs/bttr.md, "Why long
expressions fail"): for every expression of an InkML split rendered as a recipe renders it
(median stroke STROKE_SIZE px, pen 2 px, at most 320,000 pixels), the labels over 200 tokens
(dropped), the symbols outside the vocabulary (dropped), the renders shrunk to fit the pixel cap,
those dropped because their padded size still exceeds it, and those shrunk at the top of CoMER's
scale augmentation (k = 1.4). Prints JSON.

    python bench/bttr_length_caps.py /data/crohme_inkml train 22
"""
import json
import sys
from collections import Counter

from tellkit.data.crohme import load_split
from tellkit.data.inkml import RenderConfig, _as_arrays, _layout, rendered_shape
from tellkit.data.latex import Vocab

CAP = 320_000
BUCKETS = ("0-9", "10-19", "20-29", "30-39", "40+")


def bucket(n: int) -> str:
    return BUCKETS[min(n // 10, 4)]


def main(root: str, split: str, size: float) -> None:
    exprs = load_split(root, split, "inkml", {})
    vocab = Vocab()

    def config(s, cap):
        return RenderConfig(stroke_size=s, line_width=2.0, margin=4, supersample=4, max_pixels=cap)

    capped, free, big = config(size, CAP), config(size, 0), config(size * 1.4, CAP)
    c = {k: Counter() for k in ("n", "over_200_tokens", "unknown_symbol", "dropped_padded_over_cap",
                                "shrunk_to_fit", "shrunk_at_k1.4")}
    for e in exprs:
        b = bucket(len(e.tokens))
        c["n"][b] += 1
        c["over_200_tokens"][b] += len(e.tokens) > 200
        c["unknown_symbol"][b] += any(t not in vocab.stoi for t in e.tokens)
        arrs = _as_arrays(e.ink.strokes)
        f_free, f_cap, f_big = (_layout(arrs, cfg)[1] for cfg in (free, capped, big))
        h, w = rendered_shape(e.ink.strokes, capped)
        c["dropped_padded_over_cap"][b] += h * w > CAP
        c["shrunk_to_fit"][b] += f_cap < f_free * 0.999
        c["shrunk_at_k1.4"][b] += f_big < f_free * 1.4 * 0.999
    print(json.dumps({"split": split, "stroke_size": size, "n": len(exprs),
                      "by_length": {b: {k: v[b] for k, v in c.items()} for b in BUCKETS}}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
