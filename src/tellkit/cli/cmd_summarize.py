"""`tellkit summarize --transcript FILE --features FILE.npy --checkpoint DIR`: one How2-style
summary from a transcript and its video features with a trained VG-BART / VG-T5 (or a
text-only baseline, which needs no --features)."""
from __future__ import annotations

NAME = "summarize"
DEFAULT_RUN = "runs/how2_bart"
HELP = "summarize a video transcript (+ video features .npy) with a trained VG-BART / VG-T5 checkpoint"


def add_arguments(p) -> None:
    p.add_argument("--transcript", required=True, help="text file with the transcript (lines are joined)")
    p.add_argument("--features", help="video features .npy, float32 (T, 2048); needed unless the model is text-only")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder or run folder from `tellkit train configs/vg/...` (its best checkpoint); "
                   f"default {DEFAULT_RUN} (where `tellkit train configs/vg/how2_bart.yaml` writes)")
    p.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's eval.beam_size (5)")
    p.add_argument("--max-len", type=int, default=None, help="maximum summary tokens (default: eval.max_len, 64)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the bare summary")


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    import torch

    from tellkit.checkpoint import load_model, read_checkpoint_config
    from tellkit.checkpoint import resolve_checkpoint
    from tellkit.data.how2 import collate_how2, load_features
    from tellkit.errors import TellkitError
    from tellkit.models.vg_gplm import VGGPLM, load_tokenizer

    tpath = Path(args.transcript)
    if not tpath.is_file():
        raise TellkitError(f"--transcript: file not found: {tpath}")
    try:
        transcript = " ".join(tpath.read_text(encoding="utf-8").split())
    except UnicodeDecodeError as exc:
        raise TellkitError(f"--transcript: {tpath} is not UTF-8 text") from exc
    if not transcript:
        raise TellkitError(f"--transcript: {tpath} is empty")
    if args.checkpoint is None and not Path(DEFAULT_RUN).exists():
        raise TellkitError(
            f"no --checkpoint given and no {DEFAULT_RUN}/ here: train one with "
            "`tellkit train configs/vg/how2_bart.yaml` or pass --checkpoint DIR"
        )
    ckpt = resolve_checkpoint(args.checkpoint or DEFAULT_RUN)
    meta = read_checkpoint_config(ckpt)
    if meta["family"] != "vg_gplm":
        raise TellkitError(f"{ckpt}: a '{meta['family']}' checkpoint, not a VG-BART / VG-T5 (vg_gplm) one")
    data = dict(meta.get("data") or {})
    ev = dict(meta.get("eval") or {})
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise TellkitError(f"--device: {exc}") from exc
    model = load_model(ckpt, map_location=device, expect=VGGPLM).eval()
    cfg = model.config
    tok = load_tokenizer(cfg.backbone, ckpt)

    fuses = len(model.encoder_fusion) + len(model.decoder_fusion) > 0
    video = None
    if fuses:
        if not args.features:
            raise TellkitError("this model fuses video: pass --features FILE.npy (float32, shape (T, 2048))")
        video = load_features(args.features, int(data.get("max_frames", cfg.max_frames)), cfg.video_dim)
    elif args.features:
        print("tellkit summarize: note: the model is text-only, --features is ignored", file=sys.stderr)

    enc = tok(str(data.get("source_prefix", "")) + transcript, max_length=int(data.get("max_source_tokens", 512)), truncation=True)
    sample = {"id": tpath.stem, "input_ids": list(enc["input_ids"]), "labels": [tok.pad_token_id], "video": video, "summary": ""}
    batch = collate_how2([sample], tok.pad_token_id, video_dim=cfg.video_dim, frames=None)
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = model.generate(
        batch,
        max_len=args.max_len or int(ev.get("max_len", 64)),
        beam_size=args.beam_size or int(ev.get("beam_size", 5)),
        no_repeat_ngram_size=int(ev.get("no_repeat_ngram_size", 3)),
        length_penalty=float(ev.get("length_penalty", 1.0)),
        min_len=int(ev.get("min_len", 0)),
    )
    summary = tok.decode(out["tokens"][0], skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
    if args.json:
        print(json.dumps({"summary": summary, "checkpoint": str(ckpt), "frames": 0 if video is None else int(video.shape[0])}))
    else:
        print(summary)
    return 0
