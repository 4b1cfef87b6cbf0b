"""Handwritten math -> LaTeX (BTTR, CoMER): the pipeline behind ``tellkit recognize``,
``tellkit demo``, the server's ``/api/recognize`` and ``tellkit.pipeline("recognize")``.

    rec = RecognitionPipeline.load()                        # the packaged default model
    rec("formula.png")["text"]                              # 'x ^ { 2 } + 1'
    rec(["a.inkml", Strokes([[(0, 0), (5, 9)]]), pil_image])  # -> [{"text", "tokens", "score", ...}, ...]

Inputs are prepared by the checkpoint's :class:`~tellkit.tasks.recognition.RecognitionProcessor`,
the one ``tellkit evaluate`` uses: InkML files and pen strokes (the web page's drawing pad) go
through the renderer of the training data (:mod:`tellkit.data.inkml`); bitmaps are read with the
bitmap loader (ink found in either polarity, cropped to the ink, scaled as in training; for a
model trained on InkML renders, brought to the scale of those renders). The joint search runs
with the whole stored search setting (``eval:``: beam size, length, alpha, bidirectional,
rescore), over size-sorted batches; a search is stopped early once its best live hypothesis runs
away (one token or a few repeated over and over, or groups nested deeper than any training
expression: a photo given to the formula reader), as the stored ``stop_runaways`` setting says
(on unless the recipe turned it off: :class:`~tellkit.tasks.recognition.RecognitionGeneration`),
in evaluation as here. Every answer says how sure it is (``confidence``, ``unsure``:
:mod:`tellkit.decoding.confidence`); a runaway answer is always unsure.

Also names the project's own sample expression (``assets/samples/bttr_x2_plus_1.{inkml,png}``,
hand-made pen strokes; the PNG is their rendering).
"""
from __future__ import annotations

from tellkit.data.page_lines import split_page
from tellkit.errors import TellkitError
from tellkit.pipelines.base import Pipeline
from tellkit.recipes import ASSETS
from tellkit.registry import create_model
from tellkit.tasks.processor import input_path, is_pil
from tellkit.tasks.recognition import MAX_INPUT_PIXELS, RecognitionGeneration, RecognitionProcessor, Strokes
from tellkit.utils.images import ImageError, check_image_path, open_image
from tellkit.utils.precision import resolve_device

__all__ = ["SAMPLE_INKML", "SAMPLE_LATEX", "SAMPLE_PATH", "RecognitionPipeline", "Strokes"]

SAMPLE_PATH = ASSETS / "samples" / "bttr_x2_plus_1.png"
SAMPLE_INKML = ASSETS / "samples" / "bttr_x2_plus_1.inkml"
SAMPLE_LATEX = "x ^ { 2 } + 1"


class RecognitionPipeline(Pipeline):
    """Images, InkML files or :class:`Strokes` -> ``{"text": LaTeX tokens joined by spaces,
    "tokens", "score", "confidence", "unsure"}``. ``load(..., stroke_size=PX)`` reads at another median stroke size
    than the checkpoint's (models trained on InkML renders)."""

    task = "recognize"
    families = ("bttr", "comer")
    processor_class = RecognitionProcessor
    processor_options = ("stroke_size",)

    def read_page(self, page, batch_size: int | None = None) -> list[dict]:
        """A page of several lines of handwriting (an image path or a PIL image) -> one answer per
        line, top to bottom (:mod:`tellkit.data.page_lines` finds them), each with ``line`` (1, 2,
        ...) and the rows it spans (``top``, ``bottom``)."""
        if not is_pil(page):
            path = input_path(page)
            if path is None:
                raise TellkitError(f"a page is an image path or a PIL image, not a {type(page).__name__}")
            try:
                check_image_path(path)
                page = open_image(path, max_pixels=MAX_INPUT_PIXELS, mode="L")
            except ImageError as exc:
                raise TellkitError(str(exc) if exc.reason == "too many pixels" else f"{path}: not a readable image "
                                   f"({exc})") from None
        parts = split_page(page)
        answers = self([im for _, im in parts], batch_size=batch_size)
        return [{**r, "line": i + 1, "top": box.top, "bottom": box.bottom}
                for i, ((box, _), r) in enumerate(zip(parts, answers))]

    def postprocess(self, outputs, batch, **options):
        return self.processor.decode(outputs, batch, max_len=self.generation.max_len, **options)

    @classmethod
    def untrained(cls, seed: int = 0, device: str | None = None) -> RecognitionPipeline:
        """A tiny randomly initialised BTTR: the page and the API work end to end, but the LaTeX
        is noise (``info.trained`` is false)."""
        import torch  # heavy

        device = resolve_device(device)  # None: the GPU when there is one, else the CPU
        torch.manual_seed(seed)
        model = create_model("bttr/tiny").eval().to(device)
        return cls(model, RecognitionProcessor(), RecognitionGeneration(beam_size=2, max_len=12), device=device,
                   info={"family": "bttr", "checkpoint": None, "trained": False,
                         "note": "tiny random model (tellkit serve --untrained): LaTeX is noise"})
