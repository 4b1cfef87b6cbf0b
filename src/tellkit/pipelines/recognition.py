"""Handwritten math -> LaTeX with BTTR: the pipeline that ``tellkit serve`` (``/api/recognize``)
and ``tellkit demo`` run, over ``tellkit.tasks.recognition.Recognizer`` (the code of
``tellkit recognize``).

Also names the project's own sample expression (``assets/samples/bttr_x2_plus_1.png``, drawn
from hand-made pen strokes by ``tellkit.bench.bttr.draw_sample``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from tellkit.pipelines.base import checkpoint_info, finite_or_none

ASSETS = Path(__file__).resolve().parents[1] / "assets"
SAMPLE_PATH = ASSETS / "samples" / "bttr_x2_plus_1.png"
SAMPLE_LATEX = "x ^ { 2 } + 1"


class BTTRMathRecognizer:
    """PIL images -> ``[{"latex", "tokens", "score"}, ...]`` through ``Recognizer``. ``info``
    says which model it serves, from which checkpoint, and whether it was trained."""

    def __init__(self, recognizer, info: dict[str, Any], beam_size: int | None = None, max_len: int | None = None):
        self.rec = recognizer
        self.beam_size, self.max_len = beam_size, max_len
        self.info = {"name": "bttr", "parameters": sum(p.numel() for p in recognizer.model.parameters()), **info}

    @classmethod
    def load(cls, checkpoint: str | Path | None = None, device: str = "cpu", **kw) -> "BTTRMathRecognizer":
        from tellkit.checkpoint import read_checkpoint_config
        from tellkit.tasks.recognition import Recognizer

        rec = Recognizer.load(checkpoint, device=device)
        meta = read_checkpoint_config(rec.checkpoint) if rec.checkpoint else {}
        return cls(rec, checkpoint_info("bttr", rec.checkpoint, meta), **kw)

    @classmethod
    def untrained(cls, seed: int = 0, device: str = "cpu") -> "BTTRMathRecognizer":
        import torch

        from tellkit.registry import create_model
        from tellkit.tasks.recognition import Recognizer

        torch.manual_seed(seed)
        model = create_model("bttr/tiny").eval().to(device)
        rec = Recognizer(model, {}, {"beam_size": 2, "max_len": 12})
        return cls(rec, {"family": "bttr", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): LaTeX is noise"})

    def recognize(self, images: Sequence[Any]) -> list[dict[str, Any]]:
        out = self.rec.recognize(list(images), batch_size=max(1, len(images)), beam_size=self.beam_size,
                                 max_len=self.max_len)
        return [{**r, "score": finite_or_none(r["score"])} for r in out]
