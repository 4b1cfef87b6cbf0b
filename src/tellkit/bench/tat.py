"""Transform and Tell speed: greedy generation with incremental state against full
recomputation at every step (the cost without cached conv histories and context keys/values),
at batch 1 and 32 for the paper-size decoder, and training tokens/s for the small and
paper-size configs. Weights are random (speed does not depend on them); contexts have the
paper's sizes (49 image regions, 512 article tokens x all encoder layers, 4 faces).

The incremental float32 generation runs in two ways, alternated (with the bf16 row) over three
rounds and the fastest of each kept: on oneDNN-packed weights (``incremental``, what
``TransformAndTell.generate`` does on a CPU) and on the plain ``F.linear`` products
(``incremental_plain_weights``), with the speed-up and how many outputs the two share. Each of
these rows also has its FLOPs (counted once, untimed, by
``torch.utils.flop_counter.FlopCounterMode``: the whole run, the context encoding and the decoding
steps) and the fraction of the float32 FLOP bound it reaches: GFLOP/s reached over
``fp32_peak_gflops.peak``, the better of a 2048 x 2048 float32 product through ``torch.mm`` and
through a packed oneDNN weight at the bench's thread count, measured before and after the
generation rows and the higher kept (``measured`` lists both; equivalently, tokens/s reached over
the tokens/s that peak would give for those FLOPs). Element-wise work is not counted, so the bound
is optimistic. A bf16 autocast row (packed bfloat16 copies) sits beside each, run in the same
alternation, its outputs compared with float32's."""
from __future__ import annotations

from typing import Any

import torch

import tellkit
from tellkit.bench import timed
from tellkit.decoding.search import greedy_search
from tellkit.layers import rows
from tellkit.models.transform_and_tell import _Incremental
from tellkit.utils.precision import Precision, bf16_support, resolve


def fake_batch(cfg, batch_size: int, caption_len: int = 0, n_image: int = 49, n_article: int = 512,
               n_faces: int = 4, n_objects: int = 64, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = batch_size
    sizes = {"image": (n_image, cfg.image_dim), "faces": (n_faces, cfg.face_dim),
             "objects": (n_objects, cfg.object_dim)}
    batch: dict[str, torch.Tensor] = {}
    for name in cfg.contexts:
        if name == "article":
            if cfg.article_layers > 1:
                shape = (B, cfg.article_layers, n_article, cfg.article_dim)
            else:
                shape = (B, n_article, cfg.article_dim)
            batch["article"] = torch.randn(*shape, generator=g)
            batch["article_mask"] = torch.ones(B, n_article, dtype=torch.bool)
            batch["article_ids"] = torch.randint(3, cfg.vocab_size, (B, n_article), generator=g)
        else:
            n, dim = sizes[name]
            batch[name] = torch.randn(B, n, dim, generator=g)
            batch[f"{name}_mask"] = torch.ones(B, n, dtype=torch.bool)
    if caption_len:
        cap = torch.randint(3, cfg.vocab_size, (B, caption_len), generator=g)
        cap[:, 0], cap[:, -1] = cfg.bos_id, cfg.eos_id
        batch["caption"] = cap
    return {k: v.to(device) for k, v in batch.items()}


class _Recompute:
    """Decoder without incremental state: every step re-encodes the contexts and re-runs the
    whole prefix (what generation costs when nothing is cached)."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch

    def step(self, tokens):
        ctx = self.model.project_contexts(self.model.encode_contexts(self.batch))
        h, _ = self.model.decode(tokens, ctx)
        return self.model.next_log_probs(h[:, -1:], ctx)[:, -1]

    def reorder(self, index):
        self.batch = {k: v.index_select(0, index) for k, v in self.batch.items()}


def generation(model, batch_size: int, tokens: int, device: str, recompute: bool,
               precision: Precision | None = None, prepack: bool = True) -> dict[str, Any]:
    """Greedy generation of ``tokens`` tokens per sample; ``precision``: an autocast (bf16) to run
    under (the result then names it); ``prepack``: products on oneDNN-packed weights, float32 or
    (under bf16 autocast) bfloat16 copies (:func:`tellkit.layers.rows.prepacked`, as
    ``TransformAndTell.generate`` runs on a CPU)."""
    cfg = model.config
    batch = fake_batch(cfg, batch_size, device=device)
    precision = precision or Precision(torch.device(device).type, None)

    def run():
        with torch.no_grad(), precision.autocast(), rows.prepacked(prepack):
            if recompute:
                dec = _Recompute(model, batch)
            else:
                dec = _Incremental(model, model.project_contexts(model.encode_contexts(batch)))
            # min_len = max_len: every sample generates exactly `tokens` tokens
            return greedy_search(dec, batch_size, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
                                 max_len=tokens, min_len=tokens, device=device)

    # incremental runs are short: take the best of 3 (the first also warms up allocations)
    secs, hyps = timed(run, device, repeat=1 if recompute else 3)
    n = sum(len(h.tokens) + 1 for h in hyps)
    out = {"batch_size": batch_size, "generated_tokens": n, "seconds": round(secs, 3),
           "tokens_per_s": round(n / secs, 2), "mode": "full recomputation" if recompute else "incremental",
           "dtype": precision.name, "outputs": [list(map(int, h.tokens)) for h in hyps]}
    if precision.dtype is None:
        out["prepacked_weights"] = prepack and torch.device(device).type == "cpu"
    if not recompute:  # how much of it is the once-per-input context encoding (layer mix + K/V)
        with torch.no_grad(), precision.autocast(), rows.prepacked(prepack):
            ctx_secs, _ = timed(lambda: model.project_contexts(model.encode_contexts(batch)), device, repeat=3)
        out["context_encoding_seconds"] = round(ctx_secs, 3)
        out["decoding_tokens_per_s"] = round(n / max(secs - ctx_secs, 1e-9), 2)
    return out


def generation_flops(model, batch_size: int, tokens: int, device: str) -> dict[str, float]:
    """GFLOP of one incremental float32 generation as :func:`generation` runs it, counted by
    ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and attention, not element-wise
    work): the whole run and the context encoding; the decoding steps are the difference. It
    counts the plain products: the counter does not know the packed oneDNN call, which does the
    same multiply-adds."""
    from torch.utils.flop_counter import FlopCounterMode  # heavy: loaded only to count

    cfg = model.config
    batch = fake_batch(cfg, batch_size, device=device)
    with torch.no_grad(), rows.prepacked(False):
        with FlopCounterMode(display=False) as whole:
            dec = _Incremental(model, model.project_contexts(model.encode_contexts(batch)))
            greedy_search(dec, batch_size, bos_id=cfg.bos_id, eos_id=cfg.eos_id, pad_id=cfg.pad_id,
                          max_len=tokens, min_len=tokens, device=device)
        with FlopCounterMode(display=False) as ctx:
            model.project_contexts(model.encode_contexts(batch))
    total, context = whole.get_total_flops() / 1e9, ctx.get_total_flops() / 1e9
    return {"whole_run_gflop": round(total, 3), "context_encoding_gflop": round(context, 3),
            "decoding_gflop": round(total - context, 3)}


def _sig(x: float) -> float:
    """``x`` to three significant figures (a small product's GFLOP/s, or a tiny model's fraction
    of the bound, can be far below what a fixed count of decimals keeps)."""
    return float(f"{x:.3g}")


def fp32_peak_gflops(size: int = 2048, repeat: int = 3) -> dict[str, Any]:
    """Float32 GFLOP/s of one ``size`` x ``size`` matrix product at this thread count, through
    ``torch.mm`` and through a oneDNN pre-packed weight (best of ``repeat`` each); ``peak`` is
    the better of the two."""
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    flop = 2 * size**3
    with torch.no_grad():
        torch.mm(a, w)  # warm-up
        mm_secs, _ = timed(lambda: torch.mm(a, w), repeat=repeat)
        out = {"size": size, "torch_threads": torch.get_num_threads(), "torch_mm": _sig(flop / mm_secs / 1e9)}
        if torch.backends.mkldnn.is_available():
            with rows.prepacked():
                rows.dense(a, w)  # packs the weight
                pk_secs, _ = timed(lambda: rows.dense(a, w), repeat=repeat)
            out["onednn_prepacked"] = _sig(flop / pk_secs / 1e9)
    out["peak"] = max(out["torch_mm"], out.get("onednn_prepacked", 0.0))
    return out


def _bound(row: dict[str, Any], flops: dict[str, float], peak: float) -> None:
    """Add the FLOPs and the fractions of the float32 FLOP bound to an incremental float32 row:
    the tokens/s reached over those ``peak`` GFLOP/s would give, i.e. GFLOP/s reached / ``peak``."""
    secs, ctx_secs = row["seconds"], row["context_encoding_seconds"]
    row["gflop"] = flops
    row["gflops_per_s"] = round(flops["whole_run_gflop"] / secs, 1)
    row["decoding_gflops_per_s"] = round(flops["decoding_gflop"] / max(secs - ctx_secs, 1e-9), 1)
    row["fraction_of_fp32_flop_bound"] = _sig(flops["whole_run_gflop"] / secs / peak)
    row["decoding_fraction_of_fp32_flop_bound"] = _sig(flops["decoding_gflop"] / max(secs - ctx_secs, 1e-9) / peak)


def _alternated(model, bs: int, tokens: int, device: str, rounds: int,
                precision: Precision | None) -> dict[str, dict]:
    """The incremental generation on packed float32 weights (``packed``), on the plain products
    (``plain``) and, given a ``precision``, under it (``low``: bf16 autocast, packed bfloat16
    copies), alternated for ``rounds`` rounds (each run a best of 3), the fastest of each kept:
    other work on the same cores then slows all of them alike, and their ratios hold."""
    variants: dict[str, dict] = {"packed": {"prepack": True}, "plain": {"prepack": False}}
    if precision is not None:
        variants["low"] = {"precision": precision}
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, kwargs in variants.items():
            r = generation(model, bs, tokens, device, recompute=False, **kwargs)
            if name not in best or r["seconds"] < best[name]["seconds"]:
                best[name] = r
    return best


def training(config: str, batch_size: int, caption_len: int, steps: int, device: str) -> dict[str, Any]:

    torch.manual_seed(0)
    model = tellkit.create_model(config).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=1e-5)
    batch = fake_batch(model.config, batch_size, caption_len=caption_len, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(batch)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        return int(out["ntokens"])

    step()  # warm-up (allocations, optimizer state)
    secs, _ = timed(lambda: [step() for _ in range(steps)], device, repeat=2)
    ntok = steps * batch_size * (caption_len - 1)
    return {"config": config, "trainable_params": model.num_parameters(True), "batch_size": batch_size,
            "caption_tokens": caption_len, "steps": steps, "seconds": round(secs, 3),
            "target_tokens_per_s": round(ntok / secs, 2), "samples_per_s": round(steps * batch_size / secs, 3)}


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:

    paper = "tat/nytimes_faces"
    torch.manual_seed(0)
    model = tellkit.create_model(paper).to(device).eval()
    tokens = 8 if quick else 16
    cpu = torch.device(device).type == "cpu"
    repeat = 2 if quick else 5
    peak = fp32_peak_gflops(repeat=repeat) if cpu else None
    gen, bounded = {}, []
    for bs in ((1, 4) if quick else (1, 32)):
        bf16 = resolve(device, "bfloat16")
        runs = _alternated(model, bs, tokens, device, 1 if quick else 3, bf16 if bf16.dtype else None)
        inc, plain = runs["packed"], runs["plain"]
        full = generation(model, bs, tokens, device, recompute=True)
        if cpu:
            flops = generation_flops(model, bs, tokens, device)
            bounded += [(inc, flops), (plain, flops)]
        same = sum(a == b for a, b in zip(inc["outputs"], plain["outputs"]))
        gen[f"batch_{bs}"] = {
            "incremental": inc, "incremental_plain_weights": plain,
            "prepacked_speedup": round(inc["tokens_per_s"] / plain["tokens_per_s"], 2),
            "prepacked_decoding_speedup": round(inc["decoding_tokens_per_s"] / plain["decoding_tokens_per_s"], 2),
            "outputs_equal_prepacked_vs_plain": f"{same} of {len(inc['outputs'])}",
            "full_recomputation": full, "speedup": round(inc["tokens_per_s"] / full["tokens_per_s"], 2)}
        if bf16.dtype is None:
            gen[f"batch_{bs}"]["bf16"] = {"skipped": bf16.note}
        else:  # the same incremental generation under bf16 autocast, its outputs against float32's
            low = runs["low"]
            same = sum(a == b for a, b in zip(low["outputs"], inc["outputs"]))
            low.update(packed_bf16_products=bf16_support().packed if cpu else None,
                       speedup_vs_fp32=round(low["tokens_per_s"] / inc["tokens_per_s"], 2),
                       speedup_vs_fp32_plain=round(low["tokens_per_s"] / plain["tokens_per_s"], 2),
                       outputs_equal_to_fp32=f"{same} of {len(inc['outputs'])}")
            gen[f"batch_{bs}"]["bf16"] = low
    if cpu:  # the peak measured again after the generation rows, the better one kept: a peak
        # measured low (another load at that moment) would overstate every fraction of it
        again = fp32_peak_gflops(repeat=repeat)
        peak = {**max(peak, again, key=lambda p: p["peak"]), "measured": [peak["peak"], again["peak"]]}
        for row, flops in bounded:
            _bound(row, flops, peak["peak"])
    for row in gen.values():  # the token lists served the comparison; the file keeps the counts
        for r in row.values():
            if isinstance(r, dict):
                r.pop("outputs", None)
    del model
    rows.clear_prepacked()  # the packed copies of the paper-size weights (as much memory as the weights)
    train = {
        "small": training("tat/small", 8 if quick else 32, 24, 2 if quick else 5, device),
        "paper": training(paper, 2 if quick else 4, 24, 1 if quick else 3, device),
    }
    return {"model": paper, "cpu_bf16": bf16_support().as_dict() if cpu else None, "fp32_peak_gflops": peak,
            "generation_greedy": gen,
            "generated_tokens_per_sample": tokens, "context_sizes": {"image": 49, "article_tokens": 512, "faces": 4},
            "training": train}
