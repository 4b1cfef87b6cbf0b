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

Served (``/api/recognize``), a result's text is ``latex``; an input is prepared (rendered or
scaled for the model) on the server's decoding threads before it is queued, since the working set
of its search follows from the prepared size (:func:`recognition_cost`), and small inputs (a
drawing) may run beside a batch of large ones.

Also names the project's own sample expression (``assets/samples/bttr_x2_plus_1.{inkml,png}``,
hand-made pen strokes; the PNG is their rendering).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tellkit.data.page_lines import split_page
from tellkit.errors import TellkitError
from tellkit.pipelines.base import FIXED_BYTES, Cost, Pipeline
from tellkit.recipes import ASSETS
from tellkit.registry import create_model
from tellkit.tasks.processor import input_path, is_pil
from tellkit.tasks.recognition import MAX_INPUT_PIXELS, RecognitionGeneration, RecognitionProcessor, Strokes
from tellkit.utils.images import ImageError, check_image_path, open_image
from tellkit.utils.precision import resolve_device

__all__ = ["SAMPLE_INKML", "SAMPLE_LATEX", "SAMPLE_PATH", "RecognitionPipeline", "Strokes", "recognition_cost"]

SAMPLE_PATH = ASSETS / "samples" / "bttr_x2_plus_1.png"
SAMPLE_INKML = ASSETS / "samples" / "bttr_x2_plus_1.inkml"
SAMPLE_LATEX = "x ^ { 2 } + 1"

# What one search costs. From the prepared image's size follow BTTR's encoder grid (one cell per
# 16 x 16 pixels) and so the working set of its search: the grid's projected keys and values in
# every decoder layer (one copy per image, shared by the beams of both directions, and again in
# the rescoring pass), the self-attention cache of the 2 x beam decoder rows up to max_len tokens,
# and the encoder's activations. Measured on the packaged BTTR (beam 10, d_model 256, 3 decoder
# layers; a 300 x 300 noise PNG is prepared to 576 x 576, 1,296 cells): one search grows the
# process's peak by 96 MiB, two in one batch by 188 MiB; the estimate is 141 MiB a search
# (docs/server.md).
GRID_STRIDE = 16            # BTTR's DenseNet encoder: one memory cell per 16 x 16 input pixels
WORST_PIXELS = 576 * 576    # an input that was not prepared first: the renderer's cap, padded
ENCODER_BYTES_PER_PIXEL = 240  # DenseNet activations at their peak (measured: 79 MiB for 576 x 576)
KV_COPIES = 2               # the projected memory in the search and again in the rescoring pass
CACHE_OVERHEAD = 1.5        # the self-attention cache and the copy made when beams are reordered


def _pixels(prepared: Any) -> tuple[int, int] | None:
    """(height, width) of a prepared input: a tensor [..., H, W] or a mapping holding one."""
    if isinstance(prepared, Mapping):
        prepared = prepared.get("image")
    shape = getattr(prepared, "shape", None)
    if shape is None or len(shape) < 2:
        return None
    return int(shape[-2]), int(shape[-1])


def recognition_cost(model, prepared: Any = None) -> Cost:
    """Bytes and work of one input's search by ``model`` (a pipeline: its network's ``config``
    and its ``generation``), the worst case when ``prepared`` is None."""
    hw = _pixels(prepared) if prepared is not None else None
    pixels = hw[0] * hw[1] if hw else WORST_PIXELS
    cells = (math.ceil(hw[0] / GRID_STRIDE) * math.ceil(hw[1] / GRID_STRIDE)) if hw else WORST_PIXELS // 256
    cfg = getattr(getattr(model, "model", None), "config", None)
    if cfg is None or not hasattr(cfg, "d_model"):  # not a BTTR-like search: its share only
        return Cost(FIXED_BYTES, 1.0)
    gen = getattr(model, "generation", None)
    beam, length = int(getattr(gen, "beam_size", None) or 1), int(getattr(gen, "max_len", None) or 256)
    d, layers = int(getattr(cfg, "d_model", 256)), int(getattr(cfg, "num_decoder_layers", 3))
    rows = 2 * beam  # both directions
    per_row = 2 * layers * d * 4  # keys and values, float32, every layer: per memory cell or past token
    kv = KV_COPIES * cells * per_row  # one projected memory per image, shared by its rows
    cache = CACHE_OVERHEAD * rows * length * per_row  # the self-attention cache at max_len
    total = kv + cache + ENCODER_BYTES_PER_PIXEL * pixels + FIXED_BYTES
    return Cost(int(total), float(rows * (cells + 64)))


class RecognitionPipeline(Pipeline):
    """Images, InkML files or :class:`Strokes` -> ``{"text": LaTeX tokens joined by spaces,
    "tokens", "score", "confidence", "unsure"}``. ``load(..., stroke_size=PX)`` reads at another median stroke size
    than the checkpoint's (models trained on InkML renders)."""

    task = "recognize"
    families = ("bttr", "comer", "bttr_legacy")
    processor_class = RecognitionProcessor
    processor_options = ("stroke_size",)
    api_text = "latex"
    prepares_early = True
    small_lane = True

    def cost(self, item, prepared=None) -> Cost:
        return recognition_cost(self, prepared)

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
