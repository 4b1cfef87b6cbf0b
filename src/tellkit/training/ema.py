"""An exponential moving average of a model's weights, kept as training goes (``train.ema``).

After every optimizer step each floating-point tensor of the model's state (parameters and
BatchNorm running statistics) moves the average by ``1 - decay`` towards it:
``ema = decay * ema + (1 - decay) * weights``; integer buffers (BatchNorm batch counts) are not
averaged. The average starts from the weights the run starts with (``train.init_from``'s, or
the fresh ones), is saved in every state as ``ema.safetensors`` beside the raw model, restored
on ``--resume``, validated beside the raw weights (``ema_*`` rows of the evaluation log), and
exported instead of them with ``tellkit export --ema``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from tellkit.errors import TellkitError

EMA_FILE = "ema.safetensors"


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < float(decay) < 1.0:
            raise TellkitError(f"train.ema must be a decay between 0 and 1 (e.g. 0.999), got {decay}")
        self.decay = float(decay)
        self.shadow = {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            s = self.shadow.get(k)
            if s is not None:
                s.lerp_(v.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        check_fits(self.shadow, tensors, where)
        for k, v in tensors.items():
            self.shadow[k].copy_(v.float())

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside the block, its own again after it."""
        own = model.state_dict()
        saved = {k: own[k].detach().clone() for k in self.shadow}
        with torch.no_grad():
            for k, v in self.shadow.items():
                own[k].copy_(v.to(own[k].dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in saved.items():
                    own[k].copy_(v)


def check_fits(model_or_state: nn.Module | Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
               where: str) -> None:
    """Averaged weights must be exactly the floating-point tensors of the model, in its shapes."""
    own = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    own = {k: v for k, v in own.items() if v.is_floating_point()}
    bad = sorted(set(tensors) ^ set(own)) or sorted(
        k for k in tensors if tuple(tensors[k].shape) != tuple(own[k].shape))
    if bad:
        raise TellkitError(f"{where}: the averaged weights do not fit this model (e.g. {bad[:3]})")


def read_average(directory: str | Path) -> dict[str, torch.Tensor] | None:
    """The averaged weights a saved state or checkpoint folder carries (None when it has none)."""
    from safetensors.torch import load_file  # heavy

    f = Path(directory) / EMA_FILE
    if not f.is_file():
        return None
    try:
        return load_file(str(f), device="cpu")
    except Exception as exc:  # noqa: BLE001 - a damaged file: one line
        raise TellkitError(f"{f}: unreadable averaged weights ({str(exc).splitlines()[0] if str(exc) else exc})") \
            from None
