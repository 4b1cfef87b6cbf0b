"""Model checkpoints: ``config.json`` + ``model.safetensors``; never pickle.

Loading reads JSON and safetensors only, so an untrusted checkpoint cannot execute code, and it
checks what it reads before trusting it: ``config.json`` is at most ``MAX_CONFIG_BYTES`` and
``MAX_JSON_DEPTH`` levels deep, ``family`` is a name and ``config`` a mapping, no count of
repeated blocks (``*layers``, ``*blocks``, ``*depth``, ``*heads``) exceeds ``MAX_REPEATS``, and
the model is first built on the meta device (no memory) so that its parameter bytes are known
before anything is allocated: past ``max_model_bytes()`` (8 GiB unless ``TELLKIT_MAX_MODEL_BYTES``
says otherwise) the checkpoint is refused. Weights must have the model's names, shapes and kind
of dtype (no integer tensor for a float parameter) and be finite.

Tied weights (e.g. adaptive input / adaptive softmax) are stored once and re-tied on load.
Files are written to temporaries, fsynced and renamed (``tellkit.utils.files.atomic_write_bytes``),
so a crash never leaves a half-written file under the final name.
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tellkit._version import __version__
from tellkit.config import from_dict, to_dict
from tellkit.errors import TellkitError
from tellkit.registry import get_entry
from tellkit.utils.files import atomic_write_bytes, atomic_write_json, read_bytes
from tellkit.utils.parameters import count_parameters, parameter_breakdown
from tellkit.utils.precision import resolve_device

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# 2: a model's layout is named by its family alone. In format 1 a BTTR or CoMER config named it
# with a ``variant`` (read by :func:`upgrade_checkpoint_meta`).
FORMAT_VERSION = 2
# format 1: {family: {variant: the family that holds that layout now}}; a BTTR config without a
# variant was written by tellkit 0.1 (before variants) and holds that release's own layout
FORMER_VARIANTS = {"bttr": {"reference": "bttr", "tellkit-0.1": "bttr_legacy"}, "comer": {"reference": "comer"}}
VARIANT_BEFORE_VARIANTS = {"bttr": "tellkit-0.1"}

MAX_CONFIG_BYTES = 4 << 20  # a config.json is a few KB; 4 MiB leaves room for a large HF config
MAX_JSON_DEPTH = 32
MAX_REPEATS = 1024  # layers / blocks / heads: each builds modules, so a huge count is refused early
DEFAULT_MAX_MODEL_BYTES = 8 << 30
_REPEAT_KEY = re.compile(r"(layers|blocks|depth|heads|nhead)$")


def max_model_bytes() -> int:
    """The parameter + buffer bytes above which a checkpoint is refused before it is built."""
    raw = os.environ.get("TELLKIT_MAX_MODEL_BYTES")
    if not raw:
        return DEFAULT_MAX_MODEL_BYTES
    try:
        return int(float(raw))
    except ValueError as exc:
        raise TellkitError(f"TELLKIT_MAX_MODEL_BYTES must be a number of bytes, got {raw!r}") from exc


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
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
               dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors``. ``dtype`` (e.g. ``torch.float16``) stores
    floating-point weights at lower precision to halve a shipped checkpoint; they are cast
    back to the model's dtype on load. ``state``: the tensors to store instead of the model's
    own (an encoding :func:`load_model` decodes, e.g. int8 weights with ``weights_dtype: int8``
    in ``extra``: :func:`tellkit.export.safetensors.quantize_int8`)."""
    from safetensors.torch import save  # heavy

    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise TellkitError(f"{d}: exists and is not a directory")
    d.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "family": model.family,
        "config": to_dict(model.config),
    }
    meta["tellkit_version"] = __version__
    if extra:
        meta.update(extra)
    if dtype is not None and (state is not None or not dtype.is_floating_point):
        raise TellkitError(f"save_model: dtype {dtype} with {'a given state' if state is not None else 'the model'}: "
                           "dtype casts the model's weights to a floating-point type (int8: tellkit.export)")
    if state is None:
        state = unique_state(model)
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        meta["weights_dtype"] = str(dtype).replace("torch.", "")
    atomic_write_bytes(d / WEIGHTS_NAME, save(state, metadata={"format": "pt"}))
    atomic_write_json(d / CONFIG_NAME, meta)
    return d


INT8_SCALE = ".int8_row_scale"  # suffix of the float32 row scales of an int8 weight matrix


def dequantize_int8(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The float32 matrices of an int8 checkpoint (``weights_dtype: int8``); a scale without its
    int8 matrix, or of the wrong size, is a damaged file."""
    out = dict(state)
    for key in [k for k in state if k.endswith(INT8_SCALE)]:
        name = key[: -len(INT8_SCALE)]
        q, scale = out.pop(name, None), out.pop(key)
        if q is None or q.dtype != torch.int8 or q.dim() < 2 or not scale.is_floating_point() \
                or tuple(scale.shape) != (q.size(0),):
            raise TellkitError(f"{where}: the int8 weights of {name} do not match their row scales "
                               "(a damaged checkpoint)")
        out[name] = q.float() * scale.float().reshape(-1, *([1] * (q.dim() - 1)))
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _json_depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        depth = max(depth, d)
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return depth


def read_json_file(path: Path, what: str = "JSON", max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """Parse a small JSON file from an untrusted folder: a regular file only (a FIFO or a device
    named config.json is refused, never read), size and depth capped, one-line errors."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise TellkitError(f"{path}: {size} bytes, more than the {max_bytes} a {what} may have")
        text = read_bytes(path, what, max_bytes).decode("utf-8")
        obj = json.loads(text)
    except TellkitError:
        raise
    except FileNotFoundError as exc:
        raise TellkitError(f"{path}: missing") from exc
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TellkitError(f"{path}: unreadable {what} ({_first_line(exc)})") from exc
    if _json_depth(obj) > MAX_JSON_DEPTH:
        raise TellkitError(f"{path}: {what} nested more than {MAX_JSON_DEPTH} levels deep")
    return obj


def read_checkpoint_config(directory: str | os.PathLike) -> dict[str, Any]:
    d = Path(directory)
    if not d.exists():
        raise TellkitError(f"checkpoint not found: {d}")
    if not d.is_dir():
        raise TellkitError(f"{d}: a checkpoint is a directory with {CONFIG_NAME} and {WEIGHTS_NAME}")
    cfg_path = d / CONFIG_NAME
    if not cfg_path.is_file() or not (d / WEIGHTS_NAME).is_file():
        raise TellkitError(f"{d}: not a tellkit checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
    meta = read_json_file(cfg_path, "checkpoint config")
    if not isinstance(meta, dict) or "family" not in meta or "config" not in meta:
        raise TellkitError(f"{cfg_path}: missing 'family' or 'config'")
    if not isinstance(meta["family"], str) or not meta["family"]:
        raise TellkitError(f"{cfg_path}: 'family' must be a model family name, got a {type(meta['family']).__name__}")
    if not isinstance(meta["config"], dict):
        raise TellkitError(f"{cfg_path}: 'config' must be a mapping, got a {type(meta['config']).__name__}")
    _resolve_encoder_files(meta, d)
    return upgrade_checkpoint_meta(meta, str(cfg_path))


def upgrade_checkpoint_meta(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """A checkpoint's config.json (``family`` and ``config`` checked) in the present format: a
    format-1 BTTR or CoMER config's ``variant`` becomes the family that holds its layout (see
    :data:`FORMER_VARIANTS`), and the variant leaves the config."""
    variants = FORMER_VARIANTS.get(meta.get("family"))  # type: ignore[arg-type]
    if variants is None or meta.get("format_version", 1) != 1 or not isinstance(meta.get("config"), dict):
        return meta
    config = dict(meta["config"])
    variant = config.pop("variant", None)
    if variant is None:
        old = str(meta.get("tellkit_version", "")).startswith("0.1")
        variant = VARIANT_BEFORE_VARIANTS.get(meta["family"], "reference") if old else "reference"
    if not isinstance(variant, str) or variant not in variants:
        raise TellkitError(f"{where}: unknown {meta['family']} variant {variant!r} (one of {', '.join(variants)})")
    return {**meta, "format_version": FORMAT_VERSION, "family": variants[variant], "config": config}


ENCODER_WEIGHT_KEYS = ("image_weights", "face_weights")  # encoders entries that may name a carried file
# the image encoder's weights (and BatchNorm statistics) carried in a checkpoint folder: the
# ResNet of a converted official checkpoint, or the state a reference-mode training run reached
IMAGE_ENCODER_FILE = "image_encoder.safetensors"


def _resolve_encoder_files(meta: dict[str, Any], d: Path) -> None:
    """An ``encoders`` weights entry that names a file inside the checkpoint folder (a bare
    file name, e.g. the image encoder ``tellkit convert`` writes beside the model, or the one a
    training run in the reference's encoder mode saves) becomes its path, so the folder can move."""
    enc = meta.get("encoders")
    if not isinstance(enc, dict):
        return
    for key in ENCODER_WEIGHT_KEYS:
        name = enc.get(key)
        if isinstance(name, str) and name and Path(name).name == name and (d / name).is_file():
            meta["encoders"] = enc = {**enc, key: str(d / name)}


def write_tensor_files(d: Path, files: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Each {file name: tensors} as a safetensors file in the checkpoint folder ``d`` (encoder
    weights a checkpoint carries beside its model)."""
    from safetensors.torch import save  # heavy

    d.mkdir(parents=True, exist_ok=True)
    for name, tensors in files.items():
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise TellkitError(f"{name!r}: a carried file is a bare *.safetensors name")
        state = {k: v.detach().contiguous() for k, v in tensors.items()}
        atomic_write_bytes(d / name, save(state, metadata={"format": "pt"}))


def carried_encoder_files(meta: Mapping[str, Any], d: str | os.PathLike) -> dict[str, Path]:
    """{encoders key: file} for the encoder weights that the checkpoint folder ``d`` carries
    (entries of ``meta``, as :func:`read_checkpoint_config` resolved them, that lie in ``d``)."""
    enc = meta.get("encoders")
    folder = Path(d).resolve()
    out: dict[str, Path] = {}
    if isinstance(enc, Mapping):
        for key in ENCODER_WEIGHT_KEYS:
            v = enc.get(key)
            if isinstance(v, str) and v and Path(v).is_file() and Path(v).resolve().parent == folder:
                out[key] = Path(v)
    return out


def check_config_values(config: Any, where: str) -> None:
    """Before anything is built from an untrusted model config: no integer too large for any
    tensor, and no count of repeated blocks (a ``*layers`` / ``*blocks`` / ``*depth`` /
    ``*heads`` number, at any nesting level) above ``MAX_REPEATS``. Negative or inconsistent
    sizes are caught by the meta-device build that follows."""
    stack: list[tuple[str, Any, bool]] = [("", config, False)]
    while stack:
        key, v, in_list = stack.pop()
        if isinstance(v, dict):
            stack.extend((str(k), x, False) for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            stack.extend((key, x, True) for x in v)
        elif isinstance(v, int) and not isinstance(v, bool):
            if abs(v) > 2**40:
                raise TellkitError(f"{where}: {key} = {v} is out of range")
            if not in_list and _REPEAT_KEY.search(key) and v > MAX_REPEATS:
                raise TellkitError(f"{where}: {key} = {v}, more than the {MAX_REPEATS} repeated blocks tellkit builds")


def estimate_model_bytes(entry, cfg) -> int:
    """Parameter + buffer bytes of the model ``cfg`` describes, built on the meta device."""
    with torch.device("meta"):
        m = entry.model_cls(copy.deepcopy(cfg))
    seen: set[int] = set()
    total = 0
    for t in list(m.parameters()) + list(m.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], where: str, finite: bool = True) -> None:
    """Names, shapes, dtype kinds and finiteness of ``state`` against ``model`` (tied names that
    were stored once are fine). One-line :class:`TellkitError` on the first problem."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    tied_ok = {k for k in missing if _is_tied_alias(model, k, state)}
    really_missing = [k for k in missing if k not in tied_ok]
    unexpected = [k for k in state if k not in own]
    if really_missing or unexpected:
        raise TellkitError(f"{where}: weights do not match the config "
                           f"(missing {really_missing[:5]}, unexpected {unexpected[:5]})")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise TellkitError(f"{where}: tensor {k} has shape {tuple(v.shape)}, config expects {tuple(own[k].shape)}")
        kind_differs = v.is_floating_point() != own[k].is_floating_point()
        if kind_differs or (v.dtype == torch.bool) != (own[k].dtype == torch.bool):
            raise TellkitError(f"{where}: tensor {k} is {str(v.dtype).replace('torch.', '')}, "
                               f"the model holds {str(own[k].dtype).replace('torch.', '')}")
        if finite and v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
            raise TellkitError(f"{where}: tensor {k} holds NaN or infinite values (a diverged or damaged checkpoint)")


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
    training): same family, same tensor names and shapes, except that the tensors a model names
    in ``vocabulary_rows`` may have more rows than the checkpoint's (a vocabulary grown by new
    symbols: the old rows are copied exactly, the new ones keep their initial values); the
    checkpoint's other settings (dropout, search) are not taken. A model of another family goes
    to ``model.adopt_weights`` where the model has one (CoMER from BTTR), whose report of what was
    copied and what is new is left in ``model.init_report``, as it is when the model has parts
    under its ``optional_weight_prefixes`` that the checkpoint lacks. Returns the checkpoint folder used."""
    d = resolve_checkpoint(directory)
    src = load_model(d, map_location="cpu")
    family = getattr(model, "family", None)
    if getattr(src, "family", None) != family:
        adopt = getattr(model, "adopt_weights", None)  # a family that can start from another's weights
        if adopt is None:
            raise TellkitError(f"{d}: holds a '{getattr(src, 'family', None)}' model, this run trains '{family}'")
        model.init_report = adopt(src, str(d))
        return d
    own, theirs = model.state_dict(), src.state_dict()
    # a model over a grown vocabulary has more rows in these (the checkpoint's rows come first)
    rows = set(getattr(model, "vocabulary_rows", ()))

    def fits(k: str) -> bool:
        a, b = own[k].shape, theirs[k].shape
        return a == b or (k in rows and a[1:] == b[1:] and a[0] > b[0])

    # parts a model of the family may have or lack (training-only heads): new ones keep their
    # initial values, the checkpoint's extra ones are left out
    optional = tuple(getattr(model, "optional_weight_prefixes", ()))

    def absent_but_optional(k: str) -> bool:
        return bool(optional) and k.startswith(optional) and (k not in own or k not in theirs)

    bad = sorted(k for k in set(own) | set(theirs)
                 if not absent_but_optional(k) and (k not in own or k not in theirs or not fits(k)))
    if bad:
        raise TellkitError(f"{d}: weights do not fit this model's configuration "
                           f"({len(bad)} tensors differ, e.g. {bad[:3]})")
    with torch.no_grad():
        for k, v in own.items():
            if k in theirs:
                t = theirs[k].to(v.dtype)
                (v[: t.shape[0]] if v.dim() else v).copy_(t)
    new = sorted(k for k in own if k not in theirs)
    if new:
        model.init_report = {"copied": sorted(k for k in own if k in theirs), "new": new}
    return d


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu", expect: type | None = None):
    """Rebuild a model from ``directory`` (JSON config + safetensors weights), checking the
    config and its size before allocating and the weights before using them."""
    from safetensors import SafetensorError  # heavy
    from safetensors.torch import load_file  # heavy

    device = resolve_device(map_location)
    d = Path(directory)
    meta = read_checkpoint_config(d)
    where = str(d / CONFIG_NAME)
    entry = get_entry(meta["family"])
    if expect is not None and not issubclass(entry.model_cls, expect):
        raise TellkitError(f"{d}: holds a '{meta['family']}' model, not {expect.__name__}")
    check_config_values(meta["config"], where)
    cfg = from_dict(entry.config_cls, meta["config"], where)
    try:
        size = estimate_model_bytes(entry, cfg)
    except TellkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - an untrusted config: any failure to build is a bad config
        raise TellkitError(f"{where}: the model config does not build ({_first_line(exc)})") from exc
    limit = max_model_bytes()
    if size > limit:
        raise TellkitError(f"{where}: the model would take {size / 2**30:.1f} GiB, more than the "
                           f"{limit / 2**30:.1f} GiB limit (TELLKIT_MAX_MODEL_BYTES)")
    model = entry.model_cls(cfg)
    try:
        state = load_file(str(d / WEIGHTS_NAME), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise TellkitError(f"{d / WEIGHTS_NAME}: corrupt or unreadable weights ({_first_line(exc)})") from exc
    if meta.get("weights_dtype") == "int8":
        state = dequantize_int8(state, str(d))
    check_state_dict(model, state, str(d))
    model.load_state_dict(state, strict=False)
    model.to(device)
    model.checkpoint_meta = meta
    model.checkpoint_dir = d
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

    def parameter_parts(self) -> dict[str, Any]:
        """Named parts for :meth:`parameter_breakdown`: name -> a module, a list of modules, or
        None. The default is the model's direct submodules; families override it to group them."""
        return dict(self.named_children())  # type: ignore[attr-defined]

    def parameter_breakdown(self) -> dict[str, int]:
        """Trainable parameters per part of :meth:`parameter_parts`
        (:func:`tellkit.utils.parameters.parameter_breakdown`)."""
        return parameter_breakdown(self.parameter_parts(), self)  # type: ignore[arg-type]
