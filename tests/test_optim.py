"""The optimizer and the schedule (optim.py): AdamW's groups and its fused kernel, the learning-rate
factor by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.training.optim import build_optimizer, lr_factor


class TwoTowers(torch.nn.Module):
    """A language part and a vision part, named as is_vision_parameter reads them."""

    def __init__(self):
        super().__init__()
        self.language_model = torch.nn.Linear(3, 2)
        self.visual = torch.nn.Linear(2, 2)


def train_settings(*overrides: str):
    return load_config(None, ["train.lr=0.1", "train.weight_decay=0.01", *overrides]).train


def test_the_vision_tower_gets_its_own_rate_and_a_zero_scale_freezes_it():
    model = TwoTowers()
    optimizer = build_optimizer(model, train_settings(), vision_lr_scale=0.5)
    assert [(g["name"], g["lr"], len(g["params"])) for g in optimizer.param_groups] == [
        ("language", 0.1, 2), ("vision", 0.05, 2)]
    optimizer = build_optimizer(model, train_settings(), vision_lr_scale=0)
    assert [g["name"] for g in optimizer.param_groups] == ["language"]
    assert not any(p.requires_grad for p in model.visual.parameters())


def test_adamw_runs_fused_on_the_cpu_and_its_first_step_is_the_hand_computed_one():
    model = TwoTowers()
    optimizer = build_optimizer(model, train_settings())
    assert optimizer.defaults["fused"] is True
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.linspace(-2.0, 3.0, p.numel()).reshape(p.shape)
    optimizer.step()
    for name, p in model.named_parameters():  # step 1: m_hat = g, v_hat = g^2
        g, p0 = p.grad, before[name]
        expected = p0 * (1 - 0.1 * 0.01) - 0.1 * g / (g.abs() + 1e-8)
        assert torch.allclose(p.detach(), expected, atol=1e-6), name


def test_the_fused_update_equals_the_multi_tensor_one():
    fused_model, plain_model = TwoTowers(), TwoTowers()
    plain_model.load_state_dict(fused_model.state_dict())
    settings = train_settings()
    fused = build_optimizer(fused_model, settings)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.1, betas=tuple(settings.adam_betas), weight_decay=0.01,
                              foreach=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        for a, b in zip(fused_model.parameters(), plain_model.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("step, expected", [(0, 1 / 3), (1, 2 / 3), (2, 1.0), (10, 1.0)])
def test_warmup_then_constant(step, expected):
    assert lr_factor(step, total=10, warmup=2, schedule="constant") == pytest.approx(expected)


@pytest.mark.parametrize("step, expected", [(2, 1.0), (6, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))),
                                            (10, 0.1), (20, 0.1)])
def test_cosine_decays_to_a_tenth_after_warmup(step, expected):
    assert lr_factor(step, total=10, warmup=2, schedule="cosine") == pytest.approx(expected)
