"""BertAdam (the Transform and Tell reference's optimiser): no bias correction, per-parameter
gradient clipping, warm-up linear schedule; wired into the training config."""
import math

import pytest
import torch

from tellkit.training.bert_adam import BertAdam, warmup_linear


def _hand_steps(p0, grads, lr, b1, b2, eps, wd, max_norm, factors):
    """The reference update written out with Python floats, one scalar parameter at a time."""
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    for g_all, f in zip(grads, factors):
        norm = math.sqrt(sum(g * g for g in g_all))  # one parameter tensor = the whole vector here
        coef = max_norm / (norm + 1e-6)
        g_all = [g * coef for g in g_all] if coef < 1 else g_all
        for i, g in enumerate(g_all):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            upd = m[i] / (math.sqrt(v[i]) + eps) + wd * p[i]
            p[i] -= lr * f * upd
    return p


def test_update_matches_the_reference_formula_without_bias_correction():
    p0 = [0.5, -1.0, 2.0]
    grads = [[0.3, -0.2, 0.05], [2.0, 1.0, -3.0], [0.01, 0.02, 0.0]]  # the second is clipped
    w = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = BertAdam([w], lr=0.1, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
    for g in grads:
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = _hand_steps(p0, grads, 0.1, 0.9, 0.98, 1e-6, 0.01, 1.0, [1, 1, 1])
    assert w.detach().tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # no bias correction: the first update of a coordinate with gradient g is
    # lr (1 - b1) g / (sqrt(1 - b2) |g| + eps) + lr wd p (AdamW's would be lr g / |g| + lr wd p)
    b = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    opt_b = BertAdam([b], lr=0.1, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, max_grad_norm=0.0)
    b.grad = torch.tensor([0.3], dtype=torch.float64)
    opt_b.step()
    step = 2.0 - b.item()
    assert step == pytest.approx(0.1 * 0.1 * 0.3 / (math.sqrt(0.02) * 0.3 + 1e-6) + 0.1 * 0.01 * 2.0, rel=1e-9)
    a = torch.nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    adamw = torch.optim.AdamW([a], lr=0.1, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    a.grad = torch.tensor([0.3], dtype=torch.float64)
    adamw.step()
    assert abs((2.0 - a.item()) - step) > 0.02


def test_clipping_is_per_parameter_not_global():
    big = torch.nn.Parameter(torch.zeros(4))
    small = torch.nn.Parameter(torch.zeros(4))
    opt = BertAdam([big, small], lr=1.0, betas=(0.0, 0.0), eps=0.0, max_grad_norm=0.1)
    big.grad = torch.full((4,), 10.0)
    small.grad = torch.full((4,), 0.01)  # norm 0.02 < 0.1: untouched, whatever the other's norm
    opt.step()
    assert opt.state[small]["exp_avg"].tolist() == pytest.approx([0.01] * 4)
    assert opt.state[big]["exp_avg"].norm().item() == pytest.approx(0.1, rel=1e-4)


def test_warmup_linear_schedule():
    assert warmup_linear(0.0, 0.05) == 0.0
    assert warmup_linear(0.025, 0.05) == pytest.approx(0.5)
    assert warmup_linear(0.05, 0.05) == pytest.approx(1.0)
    assert warmup_linear(0.525, 0.05) == pytest.approx(0.5)
    assert warmup_linear(1.0, 0.05) == 0.0 and warmup_linear(1.2, 0.05) == 0.0
    w = torch.nn.Parameter(torch.zeros(1))
    opt = BertAdam([w], lr=1.0, betas=(0.0, 0.0), eps=0.0, max_grad_norm=0.0, warmup=0.5, t_total=4)
    seen = []
    for _ in range(5):
        before = w.item()
        w.grad = torch.ones(1)
        opt.step()
        seen.append(before - w.item())
    assert seen == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])  # the first step has lr 0, as the reference


def test_bert_adam_in_training_config_and_paper_recipe():
    from tellkit.config import load_yaml
    from tellkit.recipes import TrainConfig, train_config
    from tellkit.training.loop import build_optimizer

    cfg = TrainConfig(optimizer="bert_adam", max_grad_norm=0.1, clip_norm=0.0)
    opt = build_optimizer(cfg, [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": cfg.lr}])
    assert isinstance(opt, BertAdam) and opt.param_groups[0]["max_grad_norm"] == 0.1
    for name in ("tat/nytimes_faces", "tat/nytimes_full", "tat/goodnews"):
        t = train_config(load_yaml(name))
        assert (t.optimizer, t.max_grad_norm, t.clip_norm, t.warmup) == ("bert_adam", 0.1, 0.0, 0.05)
