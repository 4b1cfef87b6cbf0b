"""One device and precision resolver (``tellkit.utils.precision``): one default device for
training, evaluation, the pipelines and the commands; one reading of a dtype name."""
from __future__ import annotations

import pytest
import torch

import tellkit
from tellkit.errors import TellkitError
from tellkit.registry import create_model
from tellkit.training import distributed
from tellkit.utils import precision
from tellkit.utils.precision import default_device, resolve_device, resolve_precision


def test_the_default_is_the_gpu_when_there_is_one_else_the_cpu():
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert default_device() == want == resolve_device(None)
    assert resolve_device("cpu") == torch.device("cpu")


def test_training_and_the_pipelines_take_the_same_default(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "default_device", lambda: torch.device("meta"))  # a device no other rule picks
    info = distributed.setup(None)
    assert info.device == torch.device("meta")
    distributed.teardown(info)
    monkeypatch.undo()
    create_model("bttr/tiny").save_pretrained(tmp_path / "m", extra={"task": "recognize"})
    assert tellkit.pipeline("recognize", tmp_path / "m").device == default_device()
    from tellkit.pipelines.recognition import RecognitionPipeline

    assert RecognitionPipeline.untrained().device == default_device()  # tellkit serve --untrained, no --device


@pytest.mark.parametrize("spec, message", [("bogus", "unknown device 'bogus'"), ("xpu", "unsupported device xpu")])
def test_a_bad_device_is_one_line(spec, message):
    with pytest.raises(TellkitError, match=message) as info:
        resolve_device(spec)
    assert "\n" not in str(info.value)


def test_a_missing_gpu_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(TellkitError, match="no CUDA GPU"):
        resolve_device("cuda")


def test_dtype_names_read_one_way():
    assert resolve_precision("cpu", None).dtype is None
    assert resolve_precision("cpu", "fp32").dtype is None
    assert resolve_precision("cpu", "float16").note  # float16 is for GPUs: float32 and a note
    with pytest.raises(TellkitError, match="dtype: unknown dtype 'int8'"):
        resolve_precision("cpu", "int8")
