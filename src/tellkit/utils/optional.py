"""Lazy imports of heavy optional parts that fail with a message naming the missing extra."""
from __future__ import annotations

import importlib
from types import ModuleType

from tellkit.errors import MissingExtraError


def require(module: str, extra: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming ``pip install tellkit[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised through tests with a fake name
        what = f" for {purpose}" if purpose else ""
        raise MissingExtraError(
            f"'{module}' is needed{what} but is not installed: "
            f"install it with `pip install 'tellkit[{extra}]'` ({exc})"
        ) from exc
