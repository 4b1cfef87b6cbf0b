"""The teacher-forced token loss every model's ``forward`` returns.

The training loop's contract (:mod:`tellkit.training.loop`): ``loss`` is the mean negative
log-likelihood (nats) over the real target tokens of the batch, ``ntokens`` the number of those
tokens (the loop weights micro-batches by it), ``nll_bits`` the same mean in bits, detached.
Models that compute log p(target) themselves (adaptive softmax, copying, LSTM baselines) call
:func:`token_loss`; models with a plain output layer call :func:`logits_loss`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tellkit.errors import TellkitError


def token_loss(target_lp: torch.Tensor, ntokens: torch.Tensor | int,
               extra: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``target_lp``: log p of each real target token [N]; ``extra``: a summed regulariser added
    to the summed NLL before the division (Show-Attend-and-Tell's attention penalty)."""
    ntokens = torch.as_tensor(ntokens, device=target_lp.device)
    n = ntokens.clamp(min=1)
    nll = -target_lp.sum()
    loss = (nll + (extra if extra is not None else 0.0)) / n
    return {"loss": loss, "ntokens": ntokens, "nll_bits": (nll / n).detach() / math.log(2)}


def weight_sequences(target_lp: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """``target_lp`` [N] (the real tokens of ``mask`` [B, T], in its order) times the weight of
    each token's sequence, ``weights`` [B] (self-critical training: a drawn caption's reward
    advantage); unchanged when ``weights`` is None."""
    if weights is None:
        return target_lp
    if weights.shape != mask.shape[:1]:
        raise TellkitError(f"sequence_weights must be [{mask.size(0)}], got {tuple(weights.shape)}")
    return target_lp * weights.to(target_lp.dtype)[:, None].expand_as(mask)[mask]


def logits_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> dict[str, torch.Tensor]:
    """Cross-entropy of ``logits`` [..., V] (computed in float32) against ``targets`` [...];
    positions whose target is ``ignore_index`` are not counted."""
    flat = targets.reshape(-1)
    real = flat != ignore_index
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index,
                          reduction="none")
    return token_loss(-nll[real], real.sum())
