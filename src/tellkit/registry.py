"""Model registry: ``create_model(name_or_config, **overrides)`` builds any registered model.

Each model family registers itself with its config dataclass::

    @register_model("transform_and_tell", TransformAndTellConfig)
    class TransformAndTell(nn.Module, PretrainedMixin): ...

``name_or_config`` may be a family name (its default config), a YAML recipe (path, or a name
relative to ``configs/`` such as ``tat/tiny``), a config dataclass, or a mapping with ``name``.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tellkit.config import from_dict, load_yaml, resolve_config_path
from tellkit.errors import TellkitError
from tellkit.recipes import model_section


@dataclass(frozen=True)
class ModelEntry:
    name: str
    config_cls: type
    model_cls: type


_MODELS: dict[str, ModelEntry] = {}

# Modules that register model families when imported (kept lazy so `import tellkit` is cheap).
_MODEL_MODULES = (
    "tellkit.models.transform_and_tell",
    "tellkit.models.bttr",
    "tellkit.models.bttr_legacy",
    "tellkit.models.comer",
    "tellkit.models.vg_gplm",
    "tellkit.models.baselines",
)


def register_model(name: str, config_cls: type) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in _MODELS and _MODELS[name].model_cls is not cls:
            raise ValueError(f"model family '{name}' registered twice")
        _MODELS[name] = ModelEntry(name, config_cls, cls)
        cls.family = name
        cls.config_class = config_cls
        return cls

    return deco


def _import_all() -> None:
    for mod in _MODEL_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:  # a real missing dependency inside an existing module
                raise


def get_entry(name: str) -> ModelEntry:
    if not isinstance(name, str):
        raise TellkitError(f"a model family is a name, got a {type(name).__name__}")
    if name not in _MODELS:
        _import_all()
    if name not in _MODELS:
        known = ", ".join(sorted(_MODELS)) or "(none)"
        raise TellkitError(f"unknown model family '{name}'; known: {known}")
    return _MODELS[name]


def list_models() -> list[str]:
    _import_all()
    return sorted(_MODELS)


def build_config(name_or_config: Any, **overrides: Any) -> tuple[ModelEntry, Any]:
    """Resolve anything ``create_model`` accepts into (entry, config dataclass)."""
    if dataclasses.is_dataclass(name_or_config) and not isinstance(name_or_config, type):
        # the family registered with exactly this config class first (CoMER's and bttr_legacy's
        # configs subclass BTTR's: the first isinstance match would build a BTTR)
        def find():
            entries = list(_MODELS.values())
            return next((e for e in entries if type(name_or_config) is e.config_cls),
                        next((e for e in entries if isinstance(name_or_config, e.config_cls)), None))

        entry = find()
        if entry is None or entry.config_cls is not type(name_or_config):
            _import_all()
            entry = find()
        if entry is None:
            raise TellkitError(f"no model registered for config {type(name_or_config).__name__}")
        cfg = dataclasses.replace(name_or_config, **overrides) if overrides else name_or_config
        return entry, cfg
    if isinstance(name_or_config, Mapping):
        sec = model_section(name_or_config)
    elif isinstance(name_or_config, (str, os.PathLike)):
        s = str(name_or_config)
        is_family = not s.endswith((".yaml", ".yml")) and "/" not in s and os.sep not in s
        if is_family:
            _import_all()
        if is_family and s in _MODELS:
            sec = {"name": s}
        else:
            sec = model_section(load_yaml(resolve_config_path(s)))
    else:
        raise TellkitError(f"cannot build a model from {type(name_or_config).__name__}")
    family = sec.pop("name")
    entry = get_entry(family)
    sec.update(overrides)
    return entry, from_dict(entry.config_cls, sec, f"model ({family})")


def create_model(name_or_config: Any, **overrides: Any):
    """Build a freshly initialised model. See the module docstring for accepted inputs."""
    entry, cfg = build_config(name_or_config, **overrides)
    return entry.model_cls(cfg)
