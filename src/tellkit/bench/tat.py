"""Transform and Tell speed: greedy generation with incremental state against full
recomputation at every step (the cost without cached conv histories and context keys/values),
at batch 1 and 32 for the paper-size decoder, and training tokens/s for the small and
paper-size configs. Weights are random (speed does not depend on them); contexts have the
paper's sizes (49 image regions, 512 article tokens x all encoder layers, 4 faces)."""
from __future__ import annotations

from typing import Any

import torch

import tellkit
from tellkit.bench import timed
from tellkit.decoding.search import greedy_search
from tellkit.models.transform_and_tell import _Incremental
from tellkit.utils.precision import Precision, resolve


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
               precision: Precision | None = None) -> dict[str, Any]:
    """Greedy generation of ``tokens`` tokens per sample; ``precision``: an autocast (bf16) to run
    under (the result then names it)."""
    cfg = model.config
    batch = fake_batch(cfg, batch_size, device=device)
    precision = precision or Precision(torch.device(device).type, None)

    def run():
        with torch.no_grad(), precision.autocast():
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
    if not recompute:  # how much of it is the once-per-input context encoding (layer mix + K/V)
        with torch.no_grad(), precision.autocast():
            ctx_secs, _ = timed(lambda: model.project_contexts(model.encode_contexts(batch)), device, repeat=2)
        out["context_encoding_seconds"] = round(ctx_secs, 3)
        out["decoding_tokens_per_s"] = round(n / max(secs - ctx_secs, 1e-9), 2)
    return out


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
    gen = {}
    for bs in ((1, 4) if quick else (1, 32)):
        inc = generation(model, bs, tokens, device, recompute=False)
        full = generation(model, bs, tokens, device, recompute=True)
        gen[f"batch_{bs}"] = {"incremental": inc, "full_recomputation": full,
                              "speedup": round(inc["tokens_per_s"] / full["tokens_per_s"], 2)}
        bf16 = resolve(device, "bfloat16")
        if bf16.dtype is None:
            gen[f"batch_{bs}"]["bf16"] = {"skipped": bf16.note}
        else:  # the same incremental generation under bf16 autocast, its outputs against float32's
            low = generation(model, bs, tokens, device, recompute=False, precision=bf16)
            same = sum(a == b for a, b in zip(low["outputs"], inc["outputs"]))
            low.update(speedup_vs_fp32=round(low["tokens_per_s"] / inc["tokens_per_s"], 2),
                       outputs_equal_to_fp32=f"{same} of {len(inc['outputs'])}")
            gen[f"batch_{bs}"]["bf16"] = low
    for row in gen.values():  # the token lists served the comparison; the file keeps the counts
        for r in row.values():
            if isinstance(r, dict):
                r.pop("outputs", None)
    del model
    train = {
        "small": training("tat/small", 8 if quick else 32, 24, 2 if quick else 5, device),
        "paper": training(paper, 2 if quick else 4, 24, 1 if quick else 3, device),
    }
    return {"model": paper, "generation_greedy": gen, "generated_tokens_per_sample": tokens,
            "context_sizes": {"image": 49, "article_tokens": 512, "faces": 4}, "training": train}
