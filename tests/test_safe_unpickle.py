"""``tellkit.utils.safe_unpickle``: a pickle that would run code is refused (data files) or made
inert (reference checkpoints), and what a data file may hold still reads."""
from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch

from tellkit.errors import TellkitError
from tellkit.utils.safe_unpickle import NUMPY_ARRAYS, PLAIN_CONTAINERS, read_pickled_checkpoint, restricted_load


class Touch:
    """Unpickling this calls ``os.system`` (what a hostile file would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_data_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps({"images": [Touch(marker)]})
    with pytest.raises(TellkitError, match=r"images.pkl: the pickle names (posix|nt)\.system") as info:
        restricted_load(io.BytesIO(data), NUMPY_ARRAYS | PLAIN_CONTAINERS, what="images.pkl")
    assert "\n" not in str(info.value)
    assert not marker.exists()


def test_a_data_pickle_of_arrays_numbers_and_strings_reads():
    obj = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 3, "x": 0.5, "s": "caption",
           "scalar": np.float64(2.5), "ids": {1, 2}}
    back = restricted_load(io.BytesIO(pickle.dumps(obj)), NUMPY_ARRAYS | PLAIN_CONTAINERS)
    assert back["a"].dtype == np.float32 and np.array_equal(back["a"], obj["a"])
    assert (back["n"], back["x"], back["s"], back["scalar"], back["ids"]) == (3, 0.5, "caption", 2.5, {1, 2})


def test_numpy_is_refused_unless_allowed():
    with pytest.raises(TellkitError, match="numpy"):
        restricted_load(io.BytesIO(pickle.dumps(np.zeros(2))))


def test_a_damaged_pickle_is_one_line():
    with pytest.raises(TellkitError, match="data.pkl: not a readable pickle"):
        restricted_load(io.BytesIO(pickle.dumps([1, 2, 3])[:-3]), what="data.pkl")


def test_a_checkpoint_that_would_run_code_reads_its_tensors_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4.0)}, "callbacks": Touch(marker)}, path)
    obj = read_pickled_checkpoint(path, max_bytes=1 << 20)
    assert torch.equal(obj["state_dict"]["w"], torch.arange(4.0))
    assert not marker.exists()


def test_a_checkpoint_over_the_byte_limit_is_refused(tmp_path):
    path = tmp_path / "big.ckpt"
    torch.save({"w": torch.zeros(1000)}, path)
    with pytest.raises(TellkitError, match="limit"):
        read_pickled_checkpoint(path, max_bytes=100)
