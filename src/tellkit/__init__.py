"""tellkit: transformers that write text from images in context.

    import tellkit
    model = tellkit.create_model("tat/tiny", dropout=0.0)   # any registered family or YAML recipe
    model.save_pretrained("ckpt"); model = tellkit.load_model("ckpt")
"""
from __future__ import annotations

from tellkit._version import __version__

__all__ = ["__version__", "create_model", "load_model", "list_models", "TellkitError"]

from tellkit.errors import TellkitError


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
