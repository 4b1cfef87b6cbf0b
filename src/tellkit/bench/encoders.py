"""Per-image latency of the frozen encoders (batch 1, best of several runs), at 1 and 2 CPU
threads (or on the given device): pre-processing, the MobileNetV2, EfficientNet-Lite0/1/2 (each
at its own input size: 224, 240, 260) and ResNet-152 grids (pre-processing included), MTCNN on a
portrait and on a photo without faces, FaceNet per face, the article encoder on 512 tokens
(packaged MiniLM; RoBERTa-large with random weights, same cost as the real one, unless quick),
and the caption tokenizer. Real photos come from scikit-image's bundled samples."""
from __future__ import annotations

import os
from typing import Any

import torch

from tellkit.bench import timed
from tellkit.encoders.faces import FaceEncoder
from tellkit.encoders.image import build_image_encoder
from tellkit.encoders.preprocess import ImageNetTransform, load_image
from tellkit.encoders.text import ArticleEncoder
from tellkit.encoders.tokenizer import CaptionTokenizer


def _photo_path(name: str) -> str:
    import skimage.data  # optional

    return os.path.join(skimage.data.data_dir, name)


def _cases(quick: bool, device: str) -> dict[str, Any]:
    """name -> zero-argument callable doing one image's (or one article's) work."""

    path = _photo_path("astronaut.png")
    portrait, no_face = load_image(path), load_image(_photo_path("coffee.png"))
    transform = ImageNetTransform()
    mobilenet = build_image_encoder("mobilenet_v2").to(device)
    lites = {v: build_image_encoder(f"efficientnet_{v}").to(device) for v in ("lite0", "lite1", "lite2")}
    faces = FaceEncoder().to(device) if device == "cpu" else None
    crop = torch.randint(0, 255, (1, 160, 160, 3), dtype=torch.uint8).numpy()
    article = ArticleEncoder().to(device)
    text = " ".join(["The mayor of Springfield said on Tuesday that the budget would pass."] * 60)
    tok = CaptionTokenizer.load()
    caption = "Senator Jane Doe, left, with Gov. John Smith in Albany on Tuesday, March 3, 2020."

    cases = {
        "load_image_512px": lambda: load_image(path),
        "preprocess_224": lambda: transform(portrait),
        "mobilenet_v2_grid": lambda: mobilenet.encode([portrait]),
        **{f"efficientnet_{v}_grid": (lambda enc=enc: enc.encode([portrait])) for v, enc in lites.items()},
        "minilm_512_tokens": lambda: article.encode([text], max_tokens=512),
        "caption_tokenizer_encode": lambda: tok.encode(caption),
    }
    if faces is not None:
        cases["mtcnn_portrait_512px"] = lambda: faces.detector.detect(portrait)
        cases["mtcnn_no_face_600x400"] = lambda: faces.detector.detect(no_face)
        cases["facenet_one_face"] = lambda: faces.embed_crops(crop)
        cases["faces_detect_and_embed_portrait"] = lambda: faces.detect_and_embed(portrait)
    if not quick:
        with torch.device(device):
            resnet = build_image_encoder("resnet152", weights="random")
        cases["resnet152_grid"] = lambda: resnet.encode([portrait])
        from transformers import RobertaConfig, RobertaModel  # heavy

        cfg = RobertaConfig(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, max_position_embeddings=514, type_vocab_size=1)
        roberta = RobertaModel(cfg).eval().to(device)
        ids = torch.randint(3, 50265, (1, 512), device=device)

        @torch.no_grad()
        def roberta_large():
            return roberta(input_ids=ids, output_hidden_states=True)

        cases["roberta_large_512_tokens_random_weights"] = roberta_large
    return cases


def run(quick: bool = False, device: str = "cpu") -> dict[str, Any]:
    cases = _cases(quick, device)
    threads = [1, 2] if device == "cpu" else [torch.get_num_threads()]
    before = torch.get_num_threads()
    results: dict[str, Any] = {"unit": "milliseconds per image (per article / caption for text), batch 1, best of runs"}
    try:
        for n in threads:
            torch.set_num_threads(n)
            row = {}
            for name, fn in cases.items():
                fn()  # warm-up
                repeat = 2 if quick else (3 if "roberta" in name or "resnet" in name else 5)
                seconds, _ = timed(fn, device, repeat=repeat)
                row[name] = round(seconds * 1000, 2)
            results[f"threads_{n}"] = row
    finally:
        torch.set_num_threads(before)
    return results
