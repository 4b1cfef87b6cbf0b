"""BTTR training throughput on CROHME InkML renders: images/s and optimizer micro-steps/s of the
full training step (forward, bidirectional loss, backward, AdamW), for the reference's way of
batching and for tellkit's.

Variants (each on the same expressions, same model size, fresh weights, same thread count):
* ``reference``: batches of up to 8 sorted by pixel count under the 320,000-padded-pixel cap
  (the reference's data iterator), channels-first convolutions (the reference's layout).
* ``area_sorted``: the same batches with channels-last convolutions (tellkit before its
  shape-sorted batches).
* ``shape_sorted``: batches sorted by height, then width, under the same cap (tellkit's
  default): less padding.
* ``shape_sorted_cap_640k``: the same with twice the pixel cap (bigger batches per step).
Each reports the padding waste (padded pixels / real pixels - 1) as well.

The expressions come from ``$TELLKIT_SHARED_DATA/crohme_inkml/train`` (a seeded sample),
rendered with the recipe's renderer (``configs/bttr/crohme_cpu.yaml`` by default).
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from tellkit.errors import TellkitError


def _data_root() -> Path:
    env = os.environ.get("TELLKIT_SHARED_DATA", "").strip()
    root = Path(env).expanduser() / "crohme_inkml" if env else None
    if root is None or not (root / "train").is_dir():
        raise TellkitError("bench bttr_train needs the CROHME InkML data: set TELLKIT_SHARED_DATA to the folder "
                           "holding crohme_inkml/ (make bench does)")
    return root


def _variant(model_fn, samples, batches, channels_last: bool, steps: int, warmup: int) -> dict[str, float]:
    import torch

    from tellkit.data.crohme import collate

    model = model_fn()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model.encoder.densenet.to(memory_format=fmt)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), 2e-4)
    n_img = real = padded = 0
    t0 = None
    for i, idx in enumerate(batches[: warmup + steps]):
        b = collate([samples[j] for j in idx])
        img = b["image"].contiguous(memory_format=fmt)
        if i == warmup:
            t0 = time.perf_counter()
        out = model({**b, "image": img})
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            n_img += len(idx)
            real += int(b["image_mask"].sum())
            padded += b["image_mask"].numel()
    dt = time.perf_counter() - t0
    return {"images_per_s": n_img / dt, "steps_per_s": steps / dt, "images": n_img,
            "padding_waste": padded / max(real, 1) - 1.0, "seconds": dt}


def bench_train(recipe: str = "bttr/crohme_cpu", n_expressions: int = 96, steps: int = 8, warmup: int = 2,
                threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    import torch

    from tellkit.config import load_yaml
    from tellkit.data.crohme import load_split, size_batches
    from tellkit.data.latex import Vocab
    from tellkit.registry import create_model
    from tellkit.tasks.recognition import data_section, make_renderer

    if threads:
        torch.set_num_threads(threads)
    r = load_yaml(recipe)
    data = data_section({**r.get("data", {}), "cache": None})
    root = _data_root()
    exprs = load_split(root, "train", "inkml")
    exprs = random.Random(seed).sample(exprs, min(n_expressions, len(exprs)))
    render = make_renderer(data, root)
    vocab = Vocab()
    samples = [{"id": e.id, "image": render(e), "tokens": e.tokens,
                "labels": [vocab.stoi.get(t, -1) for t in e.tokens]} for e in exprs]
    sizes = [tuple(s["image"].shape[-2:]) for s in samples]
    bs = int(r.get("train", {}).get("batch_size", 8))
    cap = int(data.max_batch_pixels)

    def batches(sort: str, cap: int):
        return size_batches(sizes, bs, cap, shuffle=True, seed=seed, sort=sort)

    def model_fn():
        torch.manual_seed(seed)
        return create_model(r)

    results = {
        "reference": _variant(model_fn, samples, batches("area", cap), False, steps, warmup),
        "area_sorted": _variant(model_fn, samples, batches("area", cap), True, steps, warmup),
        "shape_sorted": _variant(model_fn, samples, batches("shape", cap), True, steps, warmup),
        "shape_sorted_cap_640k": _variant(model_fn, samples, batches("shape", 2 * cap), True, steps, warmup),
    }
    base = results["reference"]["images_per_s"]
    return {
        "model": "bttr",
        "recipe": recipe,
        "render": data.render_config().__dict__,
        "threads": torch.get_num_threads(),
        "expressions": len(samples),
        "mean_pixels": sum(h * w for h, w in sizes) / len(sizes),
        "batch_size": bs,
        "max_batch_pixels": cap,
        "timed_micro_steps": steps,
        "variants": results,
        "speedup_images_per_s": {k: v["images_per_s"] / base for k, v in results.items()},
    }


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """``tellkit bench bttr_train``."""
    if device != "cpu":
        raise TellkitError("bench bttr_train measures CPU training only")
    return bench_train(n_expressions=32 if quick else 96, steps=3 if quick else 8, warmup=1 if quick else 2)
