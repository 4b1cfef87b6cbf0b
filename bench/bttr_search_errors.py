"""Search error or model error? For every wrong answer of a `tellkit evaluate` run, the model's
joint score of the TRUE expression ((left-to-right + right-to-left log-probability) / length,
the search's own final criterion) against that of its answer: a truth that scores higher is
one the search missed; otherwise the model prefers its wrong answer. By length of the truth
(docs/bttr.md, "Why long expressions fail"). Prints JSON.

    tellkit evaluate MODEL --data /data/crohme_inkml "data.limit={}" --out ev
    python bench/bttr_search_errors.py MODEL /data/crohme_inkml ev/predictions_test.jsonl [TEST_SPLIT]
"""
import json
import sys
from collections import Counter

import torch

from tellkit.checkpoint import load_model, read_checkpoint_config
from tellkit.data.crohme import collate
from tellkit.data.latex import EOS_ID, SOS_ID
from tellkit.tasks import make_task

BUCKETS = ("0-9", "10-19", "20-29", "30-39", "40+")


def main(ckpt: str, data: str, predictions: str, split: str | None = None) -> None:
    meta = read_checkpoint_config(ckpt)
    recipe = {k: v for k, v in meta.items() if k in ("task", "model", "data", "eval", "train")}
    recipe["data"] = {**recipe["data"], "root": data, "limit": {}, "augment": {}, **({"test": split} if split else {})}
    dataset = make_task(recipe).build_dataset("test")
    model = load_model(ckpt).float().eval()
    preds = {p["id"]: p for p in map(json.loads, open(predictions, encoding="utf-8"))}
    c = {k: Counter() for k in ("wrong", "search_error", "model_error")}
    with torch.no_grad():
        for i in range(len(dataset)):
            item = dataset[i]
            p, y = preds[item["id"]], item["labels"]
            if p["correct"] or any(t < 0 for t in y):  # right, or a truth the vocabulary cannot write
                continue
            b = BUCKETS[min(len(y) // 10, 4)]
            c["wrong"][b] += 1
            batch = collate([item])
            mem, mask = model.encode(batch["image"], batch["image_mask"])
            inp = torch.tensor([[SOS_ID, *y], [EOS_ID, *y[::-1]]])
            tgt = torch.tensor([[*y, EOS_ID], [*y[::-1], SOS_ID]])
            lp = model.sequence_logprob(inp, tgt, mem.repeat(2, 1, 1), mask.repeat(2, *([1] * (mask.dim() - 1))))
            truth = float(lp.sum()) / max(len(y), 1)
            c["search_error" if p["score"] is not None and truth > p["score"] else "model_error"][b] += 1
    print(json.dumps({b: {k: v[b] for k, v in c.items()} for b in BUCKETS}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:5])
