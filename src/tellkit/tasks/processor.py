"""The one path from raw input to answer, per task: a :class:`Processor` turns what a user gives
(a path, a PIL image, an array, pen strokes, a transcript) into the model's batch, runs the
model's ``generate`` with the task's generation config, and turns the output back into results
(``{"text": ..., extras}``).

Each task owns one (``CaptionProcessor``, ``RecognitionProcessor``, ``SummaryProcessor`` in
:mod:`tellkit.tasks`). It is built from the recipe sections a checkpoint stores in its
``config.json`` (``data``, ``encoders``, ``eval``: :meth:`Processor.from_checkpoint`), so a
model carries its processor. The task's ``predict`` (training validation and ``tellkit
evaluate``) and every inference pipeline (:mod:`tellkit.pipelines`: the commands, the server,
``tellkit.pipeline``) call the same :meth:`Processor.generate` and the same decoding::

    batch = processor.collate([processor.prepare(x) for x in inputs])
    out = processor.generate(model, batch, generation, precision)   # model.generate(**generation.kwargs())
    results = processor.decode(out, batch)
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from tellkit.errors import TellkitError
from tellkit.recipes import GenerationSettings, section
from tellkit.utils.precision import Precision


def finite_or_none(x) -> float | None:
    """JSON has no infinities: a search that found nothing scores -inf -> None."""
    x = float(x)
    return x if math.isfinite(x) else None


def as_pil(array, what: str = "image"):
    """A numpy array (H x W, or H x W x 1/3/4; uint8, bool, or floats in [0, 1]) as a PIL image."""
    import numpy as np  # heavy
    from PIL import Image  # heavy

    a = np.asarray(array)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (3, 4)) or 0 in a.shape[:2]:
        raise TellkitError(f"{what}: an array must be H x W or H x W x 3 (or 4), got shape {a.shape}")
    if a.dtype == bool:
        a = a.astype(np.uint8) * 255
    elif a.dtype != np.uint8:
        if not np.issubdtype(a.dtype, np.number) or not np.isfinite(a).all():
            raise TellkitError(f"{what}: an array must hold finite numbers, got {a.dtype}")
        top = 1.0 if a.max() <= 1.0 else 255.0
        a = (np.clip(a, 0, top) * (255.0 / top)).round().astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a))


def is_pil(x) -> bool:
    from PIL import Image  # heavy

    return isinstance(x, Image.Image)


def is_array(x) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "shape")


class Processor:
    """Raw input -> model batch; model output -> results, for one task. Subclasses set
    :attr:`task` (the pipeline's name, a command: ``caption``, ``recognize``, ``summarize``) and
    :attr:`generation_class` / :attr:`eval_class`, and fill in the hooks below."""

    task: ClassVar[str] = ""
    generation_class: ClassVar[type[GenerationSettings]]
    eval_class: ClassVar[type]  # the task's eval section: its generation config + how it is scored

    # --- built from what a checkpoint stores --------------------------------------------------
    @classmethod
    def from_checkpoint(cls, meta: Mapping[str, Any], path: Path, *, device: torch.device,
                        **options: Any) -> Processor:
        """The processor of the checkpoint at ``path`` (its ``config.json`` is ``meta``);
        ``options``: the task's input options (e.g. recognition's ``stroke_size``)."""
        raise NotImplementedError

    def check(self, model, generation: GenerationSettings) -> None:
        """Refuse a model these inputs or settings do not fit (default: none refused)."""

    @classmethod
    def generation(cls, meta: Mapping[str, Any], **overrides: Any) -> GenerationSettings:
        """The stored generation settings (the ``eval`` section, read with the task's eval
        config: an unknown key is refused) with non-None ``overrides``."""
        ev = section({"eval": cls.stored_eval(meta)}, "eval", cls.eval_class, "checkpoint eval")
        return ev.generation.updated(**overrides)

    @classmethod
    def stored_eval(cls, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        return meta.get("eval") or {}

    # --- input ---------------------------------------------------------------------------------
    def is_input(self, x: Any) -> bool:
        """Whether ``x`` is ONE input even though it is a list (pen strokes); a list is otherwise
        a list of inputs."""
        return False

    def prepare(self, item: Any) -> Any:
        """One raw input, checked and read (a bad one is a one-line :class:`TellkitError`)."""
        raise NotImplementedError

    def batches(self, prepared: Sequence[Any], batch_size: int) -> list[list[int]]:
        """The indices of ``prepared`` grouped into batches (default: in order)."""
        n = len(prepared)
        return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]

    def collate(self, prepared: Sequence[Any], precision: Precision | None = None) -> dict[str, Any]:
        """Prepared inputs -> the model's batch (on the CPU)."""
        raise NotImplementedError

    # --- the model -----------------------------------------------------------------------------
    def generate(self, model, batch: Mapping[str, Any], generation: GenerationSettings,
                 precision: Precision | None = None, **extra: Any) -> dict[str, Any]:
        """``model.generate`` on ``batch`` with ``generation.kwargs()`` (and ``extra`` keyword
        arguments), without gradients, in ``precision`` (autocast; the weights stay float32)."""
        with torch.no_grad(), (precision.autocast() if precision is not None else contextlib.nullcontext()):
            return self.call_generate(model, batch, {**generation.kwargs(), **extra})

    def call_generate(self, model, batch: Mapping[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        return model.generate(batch, **kwargs)

    # --- output --------------------------------------------------------------------------------
    def decode(self, outputs: Mapping[str, Any], batch: Mapping[str, Any], **options: Any) -> list[dict[str, Any]]:
        """The model's output for ``batch`` -> one result per input: ``{"text": ..., extras}``."""
        raise NotImplementedError


def input_path(item: Any) -> Path | None:
    """``item`` as a file path (a str or PathLike), else None."""
    if isinstance(item, Path):
        return item
    if isinstance(item, str):
        return Path(item)
    return None
