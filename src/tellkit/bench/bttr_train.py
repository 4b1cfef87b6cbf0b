"""BTTR training throughput on CROHME InkML renders: images/s and optimizer micro-steps/s of the
full training step (forward, bidirectional loss, backward, AdamW), for the reference's way of
batching and for tellkit's.

Variants (each trains on the same expressions, one timed pass over all of them, same model
size, fresh weights, same thread count):
* ``reference``: batches of up to 8 sorted by pixel count under the 320,000-padded-pixel cap
  (the reference's data iterator), channels-first convolutions (the reference's layout).
* ``area_sorted_channels_last``: the same batches, channels-last convolution weights and inputs.
* ``shape_sorted``: batches sorted by height, then width, under the same cap: less padding;
  channels-first.
* ``shape_sorted_channels_last``: the same, channels-last.
* ``shape_sorted_cap_640k``: shape-sorted with twice the pixel cap (bigger batches per step).
* ``shape_sorted_channels_last_fast_dropout``: shape-sorted, channels-last, and the DenseNet's
  dropout masks drawn by ``tellkit.layers.dropout`` (15-bit words from 64-bit draws) instead of
  one ``bernoulli_`` sample per element. Every other variant uses ``F.dropout``, as the reference.
* ``shape_sorted_channels_last_fast_dropout_bf16``: the same under bfloat16 autocast (CPUs with
  native bf16 only; weights and AdamW state float32).
Each reports the padding waste (padded pixels / real pixels - 1) as well.

Run-to-run noise on a shared CPU is about as large as some of these differences, so the dropout
change and bfloat16 are also measured as paired comparisons (``dropout_paired``, ``bf16_paired``):
one model, the same shape-sorted batches, each batch timed in both settings back to back
(alternating which goes first); the figure is the median over batches of the per-batch time ratio.

The expressions come from ``$TELLKIT_SHARED_DATA/crohme_inkml/train`` (a seeded sample),
rendered with the recipe's renderer (``configs/bttr/crohme_cpu.yaml`` by default).
"""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from tellkit.config import load_yaml
from tellkit.data.crohme import collate, load_split, size_batches
from tellkit.data.latex import Vocab
from tellkit.data.recognition import RecognitionDataConfig, make_renderer, render_config
from tellkit.errors import TellkitError
from tellkit.layers.dropout import FastDropout
from tellkit.recipes import section
from tellkit.registry import create_model
from tellkit.utils import precision


def _data_root() -> Path:
    env = os.environ.get("TELLKIT_SHARED_DATA", "").strip()
    root = Path(env).expanduser() / "crohme_inkml" if env else None
    if root is None or not (root / "train").is_dir():
        raise TellkitError("bench bttr_train needs the CROHME InkML data: set TELLKIT_SHARED_DATA to the folder "
                           "holding crohme_inkml/ (make bench does)")
    return root


def _rendered(recipe: str, split: str, n_expressions: int, seed: int):
    """The recipe, its data section, a seeded sample of ``split`` rendered as training items,
    their sizes, and the render rate (items/s of one process, no augmentation)."""
    r = load_yaml(recipe)
    data = section({"data": {**r.get("data", {}), "cache": None}}, "data", RecognitionDataConfig)
    root = _data_root()
    exprs = load_split(root, split, "inkml")
    exprs = random.Random(seed).sample(exprs, min(n_expressions, len(exprs)))
    render = make_renderer(data, root)
    vocab = Vocab()
    t0 = time.perf_counter()
    samples = [{"id": e.id, "image": render(e), "tokens": e.tokens,
                "labels": [vocab.stoi.get(t, -1) for t in e.tokens]} for e in exprs]
    rate = len(samples) / (time.perf_counter() - t0)
    return r, data, samples, [tuple(x["image"].shape[-2:]) for x in samples], rate


def _variant(model_fn, samples, batches, channels_last: bool, warmup: int,
             fast_dropout: bool = False, device: str = "cpu", amp: str | None = None) -> dict[str, float]:
    """One warm-up step on the first batch (not timed), then one timed pass over ALL batches, so
    every variant trains on exactly the same images. ``amp``: "bf16" runs the forward pass under
    bfloat16 autocast (CUDA, or a CPU with native bf16)."""
    import torch  # heavy

    model = model_fn().to(device)
    for m in model.modules():
        if isinstance(m, FastDropout):
            m.fast = fast_dropout
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model.encoder.densenet.to(memory_format=fmt)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), 2e-4)

    cuda = device.startswith("cuda")

    def autocast():
        return precision.resolve(device, "bfloat16" if amp == "bf16" else None).autocast()

    def step(b):
        b = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in b.items()}
        with autocast():
            out = model({**b, "image": b["image"].contiguous(memory_format=fmt)})
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # batches are collated before the clock starts on CUDA (the loader's workers do that in
    # training, beside the GPU); on the CPU collation is part of the step, as it was measured before
    pre = {i: collate([samples[j] for j in idx]) for i, idx in enumerate(batches)} if cuda else None
    for _ in range(warmup):
        step(pre[0] if cuda else collate([samples[j] for j in batches[0]]))
    n_img = real = padded = 0
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, idx in enumerate(batches):
        b = pre[i] if cuda else collate([samples[j] for j in idx])
        step(b)
        n_img += len(idx)
        real += int(b["image_mask"].sum())
        padded += b["image_mask"].numel()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"images_per_s": n_img / dt, "steps_per_s": len(batches) / dt, "images": n_img,
            "micro_steps": len(batches), "real_megapixels_per_s": real / dt / 1e6,
            "padding_waste": padded / max(real, 1) - 1.0, "seconds": dt}


def _paired(model_fn, samples, batches, configure, rounds: int = 1) -> dict[str, Any]:
    """One model, the same batches, each timed in setting A and in setting B back to back
    (alternating which goes first): the median over batches of time(B) / time(A) is the speed-up
    of A over B, robust to a machine whose load changes. ``configure(a: bool)`` switches the
    model to a setting and returns the context the step runs in."""
    import torch  # heavy

    model = model_fn()
    model.encoder.densenet.to(memory_format=torch.channels_last)
    model.train()

    def timed(b, a: bool) -> float:
        with configure(model, a):
            t0 = time.perf_counter()
            model({**b, "image": b["image"].contiguous(memory_format=torch.channels_last)})["loss"].backward()
            dt = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        return dt

    timed(collate([samples[j] for j in batches[0]]), True)  # warm-up, both settings
    timed(collate([samples[j] for j in batches[0]]), False)
    ratios, seconds_a, seconds_b = [], 0.0, 0.0
    for r in range(rounds):
        for i, idx in enumerate(batches):
            b = collate([samples[j] for j in idx])
            a_first = (i + r) % 2 == 0
            t1 = timed(b, a_first)
            t2 = timed(b, not a_first)
            ta, tb = (t1, t2) if a_first else (t2, t1)
            ratios.append(tb / ta)
            seconds_a, seconds_b = seconds_a + ta, seconds_b + tb
    return {"pairs": len(ratios), "median_speedup": statistics.median(ratios),
            "min_speedup": min(ratios), "max_speedup": max(ratios), "seconds_a": seconds_a, "seconds_b": seconds_b}


def _dropout_setting(model, fast: bool):
    for m in model.modules():
        if isinstance(m, FastDropout):
            m.fast = fast
    return contextlib.nullcontext()


def _bf16_setting(model, bf16: bool):
    """A: bfloat16 autocast (where the CPU has it), B: float32; FastDropout on in both."""
    _dropout_setting(model, True)
    return precision.resolve("cpu", "bfloat16" if bf16 else None).autocast()


def bench_train(recipe: str = "bttr/crohme_cpu", n_expressions: int = 96, warmup: int = 1,
                threads: int | None = None, seed: int = 0, paired_batches: int = 12) -> dict[str, Any]:
    import torch  # heavy

    if threads:
        torch.set_num_threads(threads)
    r, data, samples, sizes, _ = _rendered(recipe, "train", n_expressions, seed)
    bs = int(r.get("train", {}).get("batch_size", 8))
    cap = int(data.max_batch_pixels)

    def batches(sort: str, cap: int):
        return size_batches(sizes, bs, cap, shuffle=True, seed=seed, sort=sort)

    def model_fn():
        torch.manual_seed(seed)
        return create_model(r)

    results = {
        "reference": _variant(model_fn, samples, batches("area", cap), False, warmup),
        "area_sorted_channels_last": _variant(model_fn, samples, batches("area", cap), True, warmup),
        "shape_sorted": _variant(model_fn, samples, batches("shape", cap), False, warmup),
        "shape_sorted_channels_last": _variant(model_fn, samples, batches("shape", cap), True, warmup),
        "shape_sorted_cap_640k": _variant(model_fn, samples, batches("shape", 2 * cap), False, warmup),
        "shape_sorted_channels_last_fast_dropout": _variant(model_fn, samples, batches("shape", cap), True, warmup,
                                                            fast_dropout=True),
    }
    shape = batches("shape", cap)
    paired = _paired(model_fn, samples, shape[:paired_batches], _dropout_setting)
    paired["seconds_f_dropout"], paired["seconds_fast_dropout"] = paired.pop("seconds_b"), paired.pop("seconds_a")
    amp = precision.resolve("cpu", "bfloat16")
    bf16 = None
    if amp.dtype:
        results["shape_sorted_channels_last_fast_dropout_bf16"] = _variant(
            model_fn, samples, shape, True, warmup, fast_dropout=True, amp="bf16")
        bf16 = _paired(model_fn, samples, shape[:paired_batches], _bf16_setting)
        bf16["seconds_bf16"], bf16["seconds_fp32"] = bf16.pop("seconds_a"), bf16.pop("seconds_b")
    base = results["reference"]["images_per_s"]
    return {
        "model": "bttr",
        "recipe": recipe,
        "render": render_config(data).__dict__,
        "threads": torch.get_num_threads(),
        "expressions": len(samples),
        "mean_pixels": sum(h * w for h, w in sizes) / len(sizes),
        "batch_size": bs,
        "max_batch_pixels": cap,
        "variants": results,
        "speedup_images_per_s": {k: v["images_per_s"] / base for k, v in results.items()},
        "dropout_paired": paired,
        # forward + backward under bfloat16 autocast against float32, batch by batch (None where
        # the CPU has no native bfloat16: ``bf16_note`` says so)
        "bf16_paired": bf16,
        "bf16_note": amp.note,
    }


def bench_train_cuda(recipe: str = "bttr/crohme_cpu", n_expressions: int = 512, seed: int = 0,
                     device: str = "cuda", split: str = "2014") -> dict[str, Any]:
    """The training step on a GPU: the reference's batching (8, 320k-pixel cap) in float32 and
    in bfloat16, and batches of 32 under a 1.28M-pixel cap in bfloat16 (channels-first and
    -last). Batches are collated before the clock starts, so the figures are the GPU's step
    alone; ``render_images_per_s_one_worker`` says how fast one loader worker renders the
    InkML (without augmentation), i.e. how many workers keep the GPU fed. The expressions come
    from ``split`` (2014 test by default: a tenth of the files of train to read, and the images
    only feed a timing)."""
    import torch  # heavy

    r, data, samples, sizes, render_rate = _rendered(recipe, split, n_expressions, seed)
    cap = int(data.max_batch_pixels)

    def batches(bs: int, cap: int):
        return size_batches(sizes, bs, cap, shuffle=True, seed=seed, sort="shape")

    def model_fn():
        torch.manual_seed(seed)
        return create_model(r)

    runs = {
        "bs8_cap320k_fp32": (8, cap, False, None),
        "bs8_cap320k_bf16": (8, cap, False, "bf16"),
        "bs32_cap1280k_bf16": (32, 4 * cap, False, "bf16"),
        "bs32_cap1280k_bf16_channels_last": (32, 4 * cap, True, "bf16"),
    }
    results = {}
    for name, (bs, c, cl, amp) in runs.items():
        v = _variant(model_fn, samples, batches(bs, c), cl, 3, device=device, amp=amp)
        v["seconds_per_step"] = v["seconds"] / v["micro_steps"]
        results[name] = v
    return {
        "model": "bttr",
        "recipe": recipe,
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
        "render": render_config(data).__dict__,
        "split": split,
        "expressions": len(samples),
        "mean_pixels": sum(h * w for h, w in sizes) / len(sizes),
        "render_images_per_s_one_worker": render_rate,
        "variants": results,
    }


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    """``tellkit bench bttr_train``: the CPU variants, or the GPU's step with ``--device cuda``."""
    if device.startswith("cuda"):
        return bench_train_cuda(n_expressions=128 if quick else 512, device=device)
    if device != "cpu":
        raise TellkitError(f"bench bttr_train: unknown device {device!r} (cpu or cuda)")
    return bench_train(n_expressions=24 if quick else 96)
