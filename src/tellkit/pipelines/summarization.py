"""Transcript (+ video features) -> summary: the pipeline of the summarization family (VG-BART /
VG-T5, ``vg_gplm``, and the How2 ``seq2seq`` baseline) behind ``tellkit summarize`` and
``tellkit.pipeline("summarize", model=...)``.

    summ = SummarizationPipeline.load("runs/how2_bart")        # a checkpoint or run folder (none is packaged)
    summ({"transcript": text, "features": "video.npy"})["text"]
    summ("talk.txt")                                           # a transcript file; talk.npy beside it is its video

``load`` reads the checkpoint, the tokenizer saved beside it (else the backbone's) and the recipe
stored with it; inputs go through the task's
:class:`~tellkit.tasks.summarization.SummaryProcessor`, the one ``tellkit evaluate`` uses (the
``data`` section says how the source was built: ``max_source_tokens``, ``max_frames``,
``source_prefix``), and decoding follows the ``eval`` section
(:class:`~tellkit.tasks.summarization.SummaryGeneration`). A result holds ``text``, ``frames``
(video frames read) and ``video_ignored`` (features given to a text-only model).
"""
from __future__ import annotations

from tellkit.pipelines.base import Pipeline
from tellkit.tasks.summarization import SummaryProcessor

__all__ = ["FAMILIES", "SummarizationPipeline"]

FAMILIES = ("vg_gplm", "seq2seq")


class SummarizationPipeline(Pipeline):
    """See the module docstring."""

    task = "summarize"
    families = FAMILIES
    processor_class = SummaryProcessor
    api_text = "summary"

    @property
    def uses_video(self) -> bool:
        return self.processor.uses_video
