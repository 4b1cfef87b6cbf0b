"""The one training loop (``train``), its config (``TrainConfig``), checkpoints and evaluation."""
from tellkit.training.config import TrainConfig, train_config

__all__ = ["TrainConfig", "train_config", "train"]


def train(*args, **kwargs):
    """See :func:`tellkit.training.loop.train`."""
    from tellkit.training.loop import train as _train

    return _train(*args, **kwargs)
