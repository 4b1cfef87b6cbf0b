"""`tellkit serve`'s options: the request-limit flags take their defaults from
:class:`tellkit.server.limits.Limits` (one place for each default), and the values given on the
command line reach the server's limits; ``--runtime onnx`` is refused in one line for a random
(``--untrained``) model, which has no exported graphs (tests/test_onnx_runtime.py serves one
that has)."""
from __future__ import annotations

import pytest

from tellkit.cli import build_parser
from tellkit.cli.cmd_serve import LIMIT_OPTIONS, load_backends, serve_limits
from tellkit.errors import TellkitError
from tellkit.server.limits import Limits


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_limit_flags_default_to_the_limits_dataclass():
    assert serve_limits(serve_args()) == Limits()
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "(default 16,000,000)" in help_text and f"(default {Limits().request_timeout_s:g})" in help_text
    assert len(LIMIT_OPTIONS) == len({field for field, _, _ in LIMIT_OPTIONS.values()})


def test_each_limit_flag_reaches_its_field():
    limits = serve_limits(serve_args("--timeout", "7", "--max-upload-mb", "2", "--max-image-pixels", "1000",
                                     "--max-buffered-mb", "9", "--memory-budget-mb", "50"))
    assert (limits.request_timeout_s, limits.max_upload_bytes, limits.max_image_pixels) == (7.0, 2 << 20, 1000)
    assert (limits.max_buffered_mb, limits.memory_budget_mb) == (9, 50)


def test_runtime_onnx_needs_checkpoints():
    args = serve_args("--models", "recognize", "--untrained", "--runtime", "onnx")
    with pytest.raises(TellkitError, match="--runtime onnx .* --untrained recognize model") as err:
        load_backends(args)
    assert "\n" not in str(err.value)
