"""tellkit: transformers that write text from images in context.

    import tellkit
    tellkit.pipeline("caption")("photo.jpg")["text"]          # the packaged default captioner
    tellkit.pipeline("recognize")("formula.png")["text"]      # handwritten math -> LaTeX
    model = tellkit.create_model("tat/tiny", dropout=0.0)     # any registered family or YAML recipe
    model.save_pretrained("ckpt"); model = tellkit.load_model("ckpt")
"""
from __future__ import annotations

from tellkit._version import __version__

__all__ = ["__version__", "pipeline", "create_model", "load_model", "list_models", "TellkitError"]

from tellkit.errors import TellkitError


def pipeline(task, model=None, device=None, dtype=None, **options):
    """A ready-to-call inference pipeline: ``task`` is "caption", "recognize" or "summarize" (the
    commands' names); ``model`` a checkpoint or run folder (None: the packaged default);
    ``device`` cpu or cuda (None: the GPU when there is one, else the CPU); ``dtype`` "bf16" or
    "fp32"; ``options``: generation settings (``beam_size=3``, ...) and the task's input options.
    Called with one input (a path, a PIL image, an array, pen strokes, a transcript) it answers
    ``{"text": ..., extras}``; with a list, a list."""
    from tellkit.pipelines import pipeline as _pipeline  # heavy

    return _pipeline(task, model, device=device, dtype=dtype, **options)


def create_model(name_or_config, **overrides):
    """Build a model from a family name, a YAML recipe, or a config dataclass (see registry)."""
    from tellkit.registry import create_model as _create  # heavy

    return _create(name_or_config, **overrides)


def load_model(directory, map_location="cpu"):
    """Load a checkpoint directory written by ``save_pretrained`` (JSON + safetensors)."""
    from tellkit.checkpoint import load_model as _load  # heavy

    return _load(directory, map_location)


def list_models():
    from tellkit.registry import list_models as _list  # heavy

    return _list()
