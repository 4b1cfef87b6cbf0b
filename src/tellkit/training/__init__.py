"""The one training loop (``train``), its config (``TrainConfig``), checkpoints and evaluation."""
from tellkit.recipes import TrainConfig, train_config
from tellkit.training.loop import train
from tellkit.training.task import Task

__all__ = ["Task", "TrainConfig", "train_config", "train"]

