"""Configs: one dataclass per model, YAML run recipes, ``key=value`` overrides.

A run recipe (``configs/**.yaml``) is a mapping with sections, e.g.::

    task: caption             # which tellkit.tasks entry trains/evaluates it
    model: {name: transform_and_tell, d_model: 1024, ...}
    data: {...}
    train: {...}

A model config alone is also accepted wherever a recipe is (``model:`` may be the whole file).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tellkit.errors import TellkitError
from tellkit.utils.files import check_regular_file, read_text

T = TypeVar("T")

MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few KB
MAX_RECIPE_NODES = 100_000  # values (scalars, lists, mappings) in one recipe file or override
MAX_RECIPE_DEPTH = 64
MAX_NUMBER_CHARS = 64  # digits of a number (a float's 17 significant digits and exponent fit easily)
# Recipes ship inside the package (``tellkit/configs``); the checkout's ``configs/`` links there.
CONFIG_ROOT = Path(__file__).resolve().parent / "configs"


def recipe_names() -> list[str]:
    """The packaged recipes by name (``bttr/crohme``), sorted."""
    return sorted(p.relative_to(CONFIG_ROOT).with_suffix("").as_posix() for p in CONFIG_ROOT.rglob("*.yaml"))


def resolve_config_path(name: str | os.PathLike) -> Path:
    """Find a YAML recipe given a path or a packaged recipe's name (``bttr/crohme``, with or
    without ``.yaml``). A path that does not exist here and starts with ``configs/`` names the
    packaged recipe (the checkout's ``configs/`` is the package's), so the same command works
    from any folder. Not found: a one-line error naming the nearest packaged recipes."""
    p = Path(name)
    candidates = [p]
    if not p.suffix:
        candidates.append(p.with_suffix(".yaml"))
    packaged = [CONFIG_ROOT / c for c in candidates]
    if p.parts[:1] == ("configs",):
        packaged += [CONFIG_ROOT / Path(*c.parts[1:]) for c in candidates if len(c.parts) > 1]
    for c in candidates + packaged:
        if c.is_file():
            return c
    if os.path.lexists(p) and not p.is_dir():  # a FIFO, a device, a dangling link: say what it is
        check_regular_file(p, "recipe")
    if p.is_dir():
        raise TellkitError(f"{name}: is a directory, expected a YAML config file")
    key = Path(*p.parts[1:]) if p.parts[:1] == ("configs",) and len(p.parts) > 1 else p
    key_text = (key.with_suffix("") if key.suffix in (".yaml", ".yml") else key).as_posix()
    names = recipe_names()
    near = difflib.get_close_matches(key_text, names, n=3, cutoff=0.5)
    if not near:  # same file name in another family's folder, or same folder
        near = [n for n in names if n.rsplit("/", 1)[-1] == key.stem or n.split("/")[0] == key_text.split("/")[0]][:3]
    hint = f"; nearest packaged recipes: {', '.join(near)}" if near else ""
    raise TellkitError(f"config not found: {name}{hint}")


# The top-level sections a run recipe may have (``base:`` is resolved while loading). A new
# section is added here, so that a misspelt one (``trian:``) is refused instead of ignored.
RECIPE_SECTIONS = ("task", "model", "data", "train", "eval", "encoders", "scst", "row", "published")


def check_recipe_sections(recipe: Mapping[str, Any], where: str = "recipe") -> None:
    unknown = sorted(str(k) for k in recipe if k not in RECIPE_SECTIONS)
    if unknown:
        raise TellkitError(f"{where}: unknown top-level section(s) {', '.join(unknown)}; "
                           f"known: {', '.join(RECIPE_SECTIONS)}")


def load_yaml(path: str | os.PathLike, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = resolve_config_path(path)
    here = path.resolve()
    if here in _chain:
        cycle = " -> ".join(p.name for p in (*_chain[_chain.index(here):], here))
        raise TellkitError(f"{path}: 'base:' chain loops ({cycle})")
    text = read_text(path, "recipe", MAX_RECIPE_BYTES)  # a FIFO or a device named x.yaml is never read
    data = load_yaml_text(text, str(path))
    if not isinstance(data, dict):
        raise TellkitError(f"{path}: expected a mapping at the top level")
    base = data.pop("base", None)  # simple inheritance: `base: other.yaml`
    if base is not None:
        if not isinstance(base, str):
            raise TellkitError(f"{path}: 'base:' must be a file name, got a {type(base).__name__}")
        parent = load_yaml(Path(path).parent / base if not Path(base).is_absolute() else base, (*_chain, here))
        data = deep_merge(parent, data)
    return data


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # LibYAML's parser when built with it: the same documents
_NUMBER = re.compile(r"[-+]?(\.?[0-9])[0-9_.eE+-]*")


def check_yaml_text(text: str, where: str) -> None:
    """Before a recipe (or an override's value) is built: at most :data:`MAX_RECIPE_NODES` values,
    nested at most :data:`MAX_RECIPE_DEPTH` deep, no anchors or aliases (``&a`` / ``*a``: they
    repeat or loop a part of the document), no number of more than :data:`MAX_NUMBER_CHARS`
    characters. Walks LibYAML's event stream and stops at the first breach, so a hostile
    document costs at most that many events. A one-line :class:`TellkitError`."""
    nodes = depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise TellkitError(f"{where}: YAML anchors and aliases (&name, *name) are not accepted; "
                                   "write the values out")
            if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
                nodes += 1
                if nodes > MAX_RECIPE_NODES:
                    raise TellkitError(f"{where}: more than {MAX_RECIPE_NODES:,} values; a recipe holds settings, "
                                       "not data (name a data file instead)")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_RECIPE_DEPTH:
                    raise TellkitError(f"{where}: nested more than {MAX_RECIPE_DEPTH} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            elif isinstance(event, yaml.ScalarEvent) and not event.style and len(event.value) > MAX_NUMBER_CHARS \
                    and _NUMBER.fullmatch(event.value):
                raise TellkitError(f"{where}: a number of {len(event.value):,} characters "
                                   f"(at most {MAX_NUMBER_CHARS} accepted)")
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TellkitError(f"{where}: not valid YAML ({first})") from None


def load_yaml_text(text: str, where: str) -> Any:
    """YAML text -> Python values, checked first by :func:`check_yaml_text`; one-line errors."""
    check_yaml_text(text, where)
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader (CSafeLoader or SafeLoader)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TellkitError(f"{where}: not valid YAML ({first})") from None
    except (RecursionError, ValueError, OverflowError) as exc:
        raise TellkitError(f"{where}: not a usable YAML value ({type(exc).__name__})") from None


def read_yaml_file(path: str | os.PathLike, what: str) -> Any:
    """A YAML file tellkit wrote or a person names (a run's ``config.yaml``) with a recipe's
    bounds: at most :data:`MAX_RECIPE_BYTES`, a regular file, then :func:`load_yaml_text`."""
    return load_yaml_text(read_text(path, what, MAX_RECIPE_BYTES), str(path))


class _PlainDumper(yaml.SafeDumper):
    """Writes every value out: a value met twice is written twice, never as an anchor and alias
    (which :func:`check_yaml_text` refuses on the way back in)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(data: Any) -> str:
    """``data`` as YAML that :func:`read_yaml_file` reads back (keys in their order, no aliases)."""
    return yaml.dump(data, Dumper=_PlainDumper, sort_keys=False)


def deep_merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(a))
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Turn ``["train.lr=3e-4", "model.d_model=256"]`` into a nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise TellkitError(f"override '{item}' is not of the form key=value")
        key, raw = item.split("=", 1)
        if len(raw) > MAX_RECIPE_BYTES:
            raise TellkitError(f"override {key}: the value is longer than {MAX_RECIPE_BYTES:,} characters")
        try:
            value = load_yaml_text(raw, f"override {key}") if raw != "" else ""
        except TellkitError as exc:
            if "not valid YAML" not in str(exc):
                raise
            value = raw  # text YAML cannot read is taken as it is (a path with a colon, say)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Light type coercion for YAML values (lists->tuples, ints->floats, whole floats->ints,
    '1e-4'->float: PyYAML reads ``1e-4`` without a dot as a string)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if value is None:
        return None
    if _is_union(origin):
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], where) if len(non_none) == 1 else value
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        inner = args[0] if args else Any
        seq = [_coerce(v, inner, where) for v in value]
        return tuple(seq) if origin is tuple else seq
    if tp is int and isinstance(value, float) and value.is_integer():  # 1e8, 32.0: whole numbers
        return int(value)
    if tp is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except (ValueError, OverflowError) as exc:
            raise TellkitError(f"{where}: expected a number, got {value!r}") from exc
    return value


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or (origin is not None and str(origin) == "types.UnionType")


def _type_problem(value: Any, tp: Any) -> str | None:
    """What is wrong with ``value`` for a field declared ``tp`` (None: nothing). Checked: whole
    numbers (not text, not fractions, not booleans), finite numbers (no NaN or infinity), booleans,
    sequences of these, and unions of them; other declared types are not checked here."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if value is None:
        return None
    if _is_union(origin):
        problems = [_type_problem(value, a) for a in args if a is not type(None)]
        return None if any(p is None for p in problems) else problems[0]
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return f"expected a list, got {value!r}"
        inner = [a for a in args if a is not Ellipsis]
        if len(inner) == len(value) and len(inner) > 1:  # tuple[int, float]: one type per position
            pairs = zip(value, inner)
        else:
            pairs = ((v, inner[0] if inner else Any) for v in value)
        return next((p for p in (_type_problem(v, t) for v, t in pairs) if p is not None), None)
    if origin is dict and len(args) == 2 and isinstance(value, Mapping):  # dict[str, int]: the values
        return next((p for p in (_type_problem(v, args[1]) for v in value.values()) if p is not None), None)
    if tp is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected a whole number, got {value!r}"
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        if not math.isfinite(value):
            return f"expected a finite number, got {value!r}"
    return None


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and values of the wrong type
    (a string or a fraction for a whole number, NaN or infinity for a number, see
    :func:`_type_problem`) with a one-line message."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise TellkitError(
            f"{where}: unknown key(s) {', '.join(unknown)} for {cls.__name__}; "
            f"known: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for k, v in data.items():
        tp = hints.get(k, Any)
        if dataclasses.is_dataclass(tp) and isinstance(v, Mapping):
            kwargs[k] = from_dict(tp, v, f"{where}.{k}")
        else:
            kwargs[k] = _coerce(v, tp, f"{where}.{k}")
            problem = _type_problem(kwargs[k], tp)
            if problem is not None:
                raise TellkitError(f"{where}.{k}: {problem}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise TellkitError(f"{where}: {exc}") from exc


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass -> plain JSON/YAML-able dict (tuples become lists)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(obj)
