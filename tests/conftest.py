"""Shared pytest set-up.

Offline model hub: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are set here, before any test
module (and so ``huggingface_hub``, which reads them once at import) is imported. Every default
model loads from files installed with the package, so the suite never needs the hub; without
this, a test that probes for a hub model waits for network time-outs when pytest is started
directly instead of through ``make test``.

``shared_data``: the real data sets (Flickr8k subset, CROHME, How2 samples; see the README in
that folder). The location is ``$TELLKIT_SHARED_DATA``, or ``../shared/data`` beside the checkout
when the variable is unset. Tests that take the fixture skip with a reason on a machine without
the data, but FAIL in CI (``CI=true``), where the data must be present so that they really run.
They are marked ``data`` automatically, so ``pytest -m "not data"`` leaves them out.
"""
from __future__ import annotations

import os

# Before anything below can import huggingface_hub / transformers (they read these once).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA_ENV = "TELLKIT_SHARED_DATA"


def shared_data_location() -> tuple[Path, str]:
    """Where the shared data should be, and how that was decided (for messages)."""
    value = os.environ.get(SHARED_DATA_ENV, "").strip()
    if value:
        return Path(value).expanduser(), f"${SHARED_DATA_ENV}"
    return ROOT.parent / "shared" / "data", f"the default (${SHARED_DATA_ENV} is unset)"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path, source = shared_data_location()
    if path.is_dir():
        return path
    message = f"shared data not found at {path} ({source}); set {SHARED_DATA_ENV} to the data folder"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: data tests must run)")
    pytest.skip(message)


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "shared_data" in getattr(item, "fixturenames", ()) and item.get_closest_marker("data") is None:
            item.add_marker(pytest.mark.data)
