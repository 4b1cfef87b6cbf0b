"""Model checkpoints: ``config.json`` + ``model.safetensors``; never pickle.

Loading reads JSON and safetensors only, so an untrusted checkpoint cannot execute code.
Tied weights (e.g. adaptive input / adaptive softmax) are stored once and re-tied on load.
Files are written to temporaries and renamed, so a crash never leaves a half-written file
under the final name.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tellkit.config import from_dict, to_dict
from tellkit.errors import TellkitError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with each shared storage kept once (first name wins), contiguous."""
    seen: dict[tuple, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen[key] = name
        out[name] = t.detach().contiguous()
    return out


def save_model(model: nn.Module, directory: str | os.PathLike, extra: dict[str, Any] | None = None,
               dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``. ``dtype`` (e.g. ``torch.float16``) stores
    floating-point weights at lower precision to halve a shipped checkpoint; they are cast
    back to the model's dtype on load."""
    from safetensors.torch import save

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise TellkitError(f"{d}: exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "family": getattr(model, "family"),
        "config": to_dict(model.config),
    }
    from tellkit import __version__

    meta["tellkit_version"] = __version__
    if extra:
        meta.update(extra)
    state = _unique_state(model)
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        meta["weights_dtype"] = str(dtype).replace("torch.", "")
    atomic_write_bytes(d / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
    atomic_write_json(d / CONFIG_NAME, meta)
    return d


def read_checkpoint_config(directory: str | os.PathLike) -> dict[str, Any]:
    d = Path(directory)
    if not d.exists():
        raise TellkitError(f"checkpoint not found: {d}")
    if not d.is_dir():
        raise TellkitError(f"{d}: a checkpoint is a directory with {CONFIG_NAME} and {WEIGHTS_NAME}")
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file() or not (d / WEIGHTS_NAME).is_file():
        raise TellkitError(f"{d}: not a tellkit checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TellkitError(f"{cfg_path}: unreadable config ({exc})") from exc
    if not isinstance(meta, dict) or "family" not in meta or "config" not in meta:
        raise TellkitError(f"{cfg_path}: missing 'family' or 'config'")
    return meta


def resolve_checkpoint(path: str | os.PathLike, follow_links: bool = True) -> Path:
    """A checkpoint folder, or a run folder of ``tellkit train`` -> its best (else last)
    checkpoint. ``follow_links=False`` keeps the ``checkpoints/best`` name (for display)
    instead of the ``step_N`` folder it points to."""
    p = Path(path)
    if not p.exists():
        raise TellkitError(f"checkpoint not found: {p}")
    if (p / "checkpoints").is_dir():
        for name in ("best", "last"):
            if (p / "checkpoints" / name).exists():
                found = p / "checkpoints" / name
                return found.resolve() if follow_links else found
        raise TellkitError(f"{p}: a run folder without checkpoints")
    return p.resolve() if follow_links else p


def load_weights_into(model: nn.Module, directory: str | os.PathLike) -> Path:
    """Copy the weights of a checkpoint (or run folder) into ``model`` (fine-tuning / staged
    training): same family, same tensor names and shapes; the checkpoint's other settings
    (dropout, search) are not taken. Returns the checkpoint folder used."""
    d = resolve_checkpoint(directory)
    src = load_model(d, map_location="cpu")
    family = getattr(model, "family", None)
    if getattr(src, "family", None) != family:
        raise TellkitError(f"{d}: holds a '{getattr(src, 'family', None)}' model, this run trains '{family}'")
    own, theirs = model.state_dict(), src.state_dict()
    bad = sorted(k for k in set(own) | set(theirs) if k not in own or k not in theirs or own[k].shape != theirs[k].shape)
    if bad:
        raise TellkitError(f"{d}: weights do not fit this model's configuration ({len(bad)} tensors differ, e.g. {bad[:3]})")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(theirs[k].to(v.dtype))
    return d


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu", expect: type | None = None):
    """Rebuild a model from ``directory`` (JSON config + safetensors weights)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from tellkit.registry import get_entry

    d = Path(directory)
    meta = read_checkpoint_config(d)
    entry = get_entry(meta["family"])
    if expect is not None and not issubclass(entry.model_cls, expect):
        raise TellkitError(f"{d}: holds a '{meta['family']}' model, not {expect.__name__}")
    cfg = from_dict(entry.config_cls, meta["config"], f"{d / CONFIG_NAME}")
    model = entry.model_cls(cfg)
    try:
        state = load_file(str(d / WEIGHTS_NAME), device=str(map_location))
    except (SafetensorError, OSError) as exc:
        raise TellkitError(f"{d / WEIGHTS_NAME}: corrupt or unreadable weights ({exc})") from exc
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    # names dropped at save time because they shared storage with another tensor
    tied_ok = {k for k in missing if _is_tied_alias(model, k, state)}
    really_missing = [k for k in missing if k not in tied_ok]
    unexpected = [k for k in state if k not in own]
    if really_missing or unexpected:
        raise TellkitError(
            f"{d}: weights do not match the config (missing {really_missing[:5]}, unexpected {unexpected[:5]})"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise TellkitError(f"{d}: tensor {k} has shape {tuple(v.shape)}, config expects {tuple(own[k].shape)}")
    model.load_state_dict(state, strict=False)
    model.to(map_location)
    model.checkpoint_meta = meta
    return model


def _is_tied_alias(model: nn.Module, name: str, state: dict[str, torch.Tensor]) -> bool:
    sd = model.state_dict()
    t = sd[name]
    ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
    for other, o in sd.items():
        if other != name and other in state:
            if (o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape)) == ptr:
                return True
    return False


class PretrainedMixin:
    """Adds ``save_pretrained`` / ``from_pretrained`` to an ``nn.Module`` with a ``config``."""

    family: str
    config_class: type

    def save_pretrained(self, directory: str | os.PathLike, extra: dict[str, Any] | None = None,
                        dtype: torch.dtype | None = None) -> Path:
        return save_model(self, directory, extra, dtype)  # type: ignore[arg-type]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu"):
        return load_model(directory, map_location, expect=cls)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters([self], trainable_only)  # type: ignore[list-item]


def count_parameters(modules, trainable_only: bool = False) -> int:
    """Parameters of ``modules``, each shared (tied) tensor counted once."""
    seen, n = set(), 0
    for m in modules:
        for p in m.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            n += p.numel()
    return n
