"""Import checkpoints written by the reference implementations into tellkit checkpoint folders.

Each model family that can be imported has a module here (``tellkit.convert.<family>``) with::

    FAMILY = "bttr"                                  # the registered tellkit family
    def matches(state: dict[str, Tensor]) -> bool    # does this state dict look like ours?
    def convert(state, **options) -> tuple[dict, dict[str, Tensor]]
        # -> (model config fields, tellkit state dict); raise TellkitError on a mismatch

and optionally, to go back (``tellkit export --format reference``: :mod:`tellkit.export.reference`)::

    def to_reference(config: dict, state: dict[str, Tensor]) -> dict   # the reference's checkpoint

Reference checkpoints are PyTorch pickles (a Lightning ``.ckpt``, an AllenNLP ``best.th``),
read by :func:`read_reference_state_dict` through ``tellkit.utils.safe_unpickle``: reading an
untrusted file never executes its code.
"""
from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path
from typing import Any

import torch

from tellkit.checkpoint import max_model_bytes, save_model, write_tensor_files
from tellkit.errors import TellkitError
from tellkit.registry import create_model
from tellkit.utils.safe_unpickle import read_pickled_checkpoint

CONVERTERS = ("bttr", "transform_and_tell")


def read_reference_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a reference checkpoint: a Lightning ``state_dict`` entry, a bare state
    dict, or a safetensors file; a pickle is read without running any of its code."""
    p = Path(path)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file  # heavy

        try:
            return load_file(str(p))
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
            raise TellkitError(f"{p}: not a readable safetensors file ({exc})") from None
    obj = read_pickled_checkpoint(p, max_model_bytes())
    state = obj.get("state_dict", obj.get("model", obj))
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise TellkitError(f"{p}: holds no tensors")
    return tensors


def converter(family: str):
    if family not in CONVERTERS:
        raise TellkitError(f"no converter for {family!r} (known: {', '.join(CONVERTERS)})")
    return importlib.import_module(f"tellkit.convert.{family}")


def detect_family(state: dict[str, torch.Tensor]) -> str:
    found = []
    for fam in CONVERTERS:
        try:
            mod = converter(fam)
        except ImportError:
            continue
        if mod.matches(state):
            found.append(fam)
    if len(found) != 1:
        what = "no known layout" if not found else f"several layouts ({', '.join(found)})"
        raise TellkitError(f"cannot tell which model this checkpoint holds ({what}); pass --family")
    return found[0]


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, family: str | None = None,
                       **options: Any) -> Path:
    """Convert ``src`` into a tellkit checkpoint folder ``out`` (config.json + safetensors).

    The converted weights are loaded strictly into a freshly built tellkit model, so a missing,
    unexpected or mis-shaped tensor is an error, never a silently random layer."""

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TellkitError(f"{out}: exists and is not an empty folder (nothing was written)")
    state = read_reference_state_dict(src)
    family = family or detect_family(state)
    options = _checked_options(converter(family).convert, options)
    config, new_state = converter(family).convert(state, **options)
    try:
        model = create_model({"name": family, **config})
    except TellkitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a config the model cannot be built from
        raise TellkitError(f"{src}: the converted {family} model does not build "
                           f"({type(exc).__name__}: {exc})") from None
    _check_weights(src, model, new_state)
    result = model.load_state_dict(new_state, strict=False)
    missing = [k for k in result.missing_keys if not _is_buffer(model, k)]
    if missing or result.unexpected_keys:
        raise TellkitError(f"{src}: converted weights do not fit the {family} model "
                           f"(missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})")
    extra: dict[str, Any] = {"converted_from": Path(src).name}
    try:
        if hasattr(converter(family), "encoder_files"):  # encoder weights the checkpoint carries
            section, files = converter(family).encoder_files(state)
            write_tensor_files(out, files)
            if section:
                extra["encoders"] = section
        if hasattr(converter(family), "recipe_sections"):  # what the model runs with: task, encoders, data, eval
            extra.update(converter(family).recipe_sections(config, extra.get("encoders", {}), **options))
        save_model(model, out, extra=extra)
    except OSError as exc:  # a read-only folder, a full disk
        raise TellkitError(f"{out}: cannot write there ({exc.strerror or exc})") from None
    return out


def _checked_options(fn, options: dict[str, Any]) -> dict[str, Any]:
    """The ``-o KEY=VALUE`` options of a converter, each of the kind its default has (a number
    for ``nhead``, true/false for a flag); an unknown one is refused."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in options.items():
        if key not in params or key == "state":
            if takes_any:
                continue
            known = ", ".join(k for k in params if k != "state")
            raise TellkitError(f"-o {key}: not an option of this converter (known: {known})")
        default = params[key].default
        kinds = {bool: (bool,), int: (int,), float: (int, float)}.get(type(default))
        ok = kinds is None or (isinstance(value, kinds) and (kinds == (bool,) or not isinstance(value, bool)))
        if not ok:
            what = {bool: "true or false", int: "a whole number", float: "a number"}[type(default)]
            raise TellkitError(f"-o {key}={value!r}: expected {what}")
    return options


def _check_weights(src, model: torch.nn.Module, new_state: dict[str, torch.Tensor]) -> None:
    """Converted tensors are refused unless each fits its parameter's kind (no integer tensor for a
    float parameter) and is finite: ``load_model`` would refuse the checkpoint written from them."""
    own = model.state_dict()
    for key, t in new_state.items():
        target = own.get(key)
        if target is None or not target.is_floating_point():
            continue
        if not t.is_floating_point():
            raise TellkitError(f"{src}: tensor {key} is {t.dtype}, not floating point like the model's {target.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise TellkitError(f"{src}: tensor {key} holds NaN or infinite values")


def _is_buffer(model: torch.nn.Module, key: str) -> bool:
    return key in dict(model.named_buffers())
