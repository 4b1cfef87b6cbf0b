"""The packaged BTTR default reads real handwriting: CROHME 2014 test InkML, through the same
path as ``tellkit evaluate`` (shared data; runs in CI)."""
from __future__ import annotations

import pytest

from tellkit.recipes import PACKAGED_DEFAULTS
from tellkit.workflows import checkpoint_recipe, evaluate_checkpoint

N = 60  # a seeded sample of the 986 (data.limit), about 30 s on two CPU threads


@pytest.mark.data
def test_packaged_bttr_reads_a_third_of_crohme_2014_test_at_its_stored_size(shared_data, tmp_path):
    stored = checkpoint_recipe(PACKAGED_DEFAULTS["recognize"])["data"]["render"]
    assert stored["stroke_size"] > 16  # it reads larger than its 16 px training renders (docs/bttr.md)
    res = evaluate_checkpoint(PACKAGED_DEFAULTS["recognize"], "test", data=str(shared_data / "crohme_inkml"),
                              overrides={"data": {"limit": {"test": N}}}, out=tmp_path, device="cpu", progress=False)
    assert len(res.predictions) == N
    at_stored = res.metrics["exprate"]
    # all 986 at the stored size: 40.2; a broken model, vocabulary or renderer reads close to none
    assert at_stored >= 25.0, at_stored
