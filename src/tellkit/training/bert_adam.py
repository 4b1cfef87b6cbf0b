"""BertAdam, the optimiser Transform and Tell's reference trained with (AllenNLP's
``bert_adam``, from pytorch-pretrained-BERT).

Per parameter p with gradient g, at step s (0-based):

    g      <- g * min(1, max_grad_norm / ||g||)         clipping of EACH parameter on its own
    m      <- b1 m + (1 - b1) g
    v      <- b2 v + (1 - b2) g^2
    update  = m / (sqrt(v) + eps) + weight_decay * p    no bias correction of m and v
    p      <- p - lr * schedule(s / t_total) * update

``schedule`` is "warmup_linear": x / warmup while x < warmup, then max((x - 1) / (warmup - 1), 0),
i.e. a linear ramp over the first ``warmup`` fraction of ``t_total`` steps (the first step has
lr 0) and a linear decay to zero at ``t_total``. With ``t_total=-1`` the optimiser applies the
group's ``lr`` as given (tellkit's training loop then sets it each step with its own
``linear_warmup`` schedule, which has the same shape).

Differences from ``torch.optim.AdamW``: no bias correction (the first steps move by about
lr * sqrt(1 - b2) / (1 - b1) less), the weight decay enters the update before the learning rate
(lr * wd * p, as AdamW), and clipping is per parameter instead of over the global norm.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer


def warmup_linear(progress: float, warmup: float) -> float:
    """The reference's learning-rate factor at ``progress`` = step / t_total."""
    if progress < warmup:
        return progress / warmup
    return max((progress - 1.0) / (warmup - 1.0), 0.0)


class BertAdam(Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.98),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_grad_norm: float = 1.0,
                 warmup: float = 0.05, t_total: int = -1):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if eps < 0:
            raise ValueError(f"invalid eps {eps}")
        if not (0.0 <= warmup < 1.0):
            raise ValueError(f"invalid warmup {warmup} (a fraction of t_total in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, warmup=warmup, t_total=t_total)
        super().__init__(params, defaults)

    def scheduled_lr(self, group: dict, step: int) -> float:
        if group["t_total"] is None or group["t_total"] <= 0:
            return group["lr"]
        return group["lr"] * warmup_linear(step / group["t_total"], group["warmup"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("BertAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["max_grad_norm"] and group["max_grad_norm"] > 0:
                    coef = group["max_grad_norm"] / (grad.norm(2) + 1e-6)  # as clip_grad_norm_
                    if coef < 1.0:
                        grad = grad * coef
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(grad, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-self.scheduled_lr(group, state["step"]))
                state["step"] += 1
        return loss

