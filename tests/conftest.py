"""Shared pytest fixtures.

``shared_data``: the real data beside the project (``../shared/data``; see its README). Tests
that need it skip with a reason on a newcomer's machine, but FAIL in CI (``CI=true``), where the
data must be present so that those tests really run.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = (ROOT.parent / "shared" / "data", Path("/work/shared/data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    for c in _CANDIDATES:
        if c.is_dir():
            return c
    where = ", ".join(str(c) for c in _CANDIDATES)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"shared data missing in CI (looked in {where})")
    pytest.skip(f"shared data not found (looked in {where}); see ../shared/data/README.md")
