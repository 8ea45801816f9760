"""AdamW with its own learning rate for the vision tower, and the warmup + decay schedule.

bfloat16 weights train with RoundingAdamW (stochastic_rounding.py: the update computed in float32
and stored back unbiased; `train.stochastic_rounding`), since rounded to nearest most small
updates vanish. Otherwise AdamW runs fused (one kernel pass over each parameter, gradient and
moment) where every trainable parameter lives on CUDA or the CPU: the same update as the default
multi-tensor ("foreach") one up to float rounding, faster, and without foreach's temporaries,
which at the step hold one more copy of every trainable parameter. It is also what transformers'
Trainer, and so TRL, uses by default (`adamw_torch_fused`). Elsewhere (MPS, ...) torch picks its
default.
"""

from __future__ import annotations

import math

import torch

from vlmrl.config import TrainConfig
from vlmrl.models.loading import is_vision_parameter
from vlmrl.training.stochastic_rounding import RoundingAdamW

FUSED_DEVICES = ("cuda", "cpu")
"""Where torch's fused AdamW runs (see the module docstring)."""


def trainable_groups(model: torch.nn.Module, vision_lr_scale: float = 1.0) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """The (name, parameter) pairs AdamW trains, by group, in its order: "language", then "vision"
    (the vision tower's, absent when it has none or when vision_lr_scale is 0). Changes nothing."""
    groups: dict[str, list] = {"language": [], "vision": []}
    for name, param in model.named_parameters():
        if param.requires_grad and not (vision_lr_scale == 0 and is_vision_parameter(name)):
            groups["vision" if is_vision_parameter(name) else "language"].append((name, param))
    return {"language": groups["language"], **({"vision": groups["vision"]} if groups["vision"] else {})}


def optimizer_layout(model: torch.nn.Module, vision_lr_scale: float = 1.0) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(name, full shape) of each parameter of each group of `build_optimizer`'s AdamW, in its order:
    what a checkpoint's optimizer state must fit (safety/checkpoint.py `optimizer_problem`). Read
    before the model is sharded or partitioned (the full shapes)."""
    return [[(name, tuple(param.shape)) for name, param in group]
            for group in trainable_groups(model, vision_lr_scale).values()]


def freeze_unscaled_vision(model: torch.nn.Module, vision_lr_scale: float) -> None:
    """A vision_lr_scale of 0 freezes the vision tower (requires_grad off): what the trainer's optimizer
    does, and what a process that holds a copy of the policy must do to name the same trainable
    parameters (a one-step-ahead generator, training/ahead.py)."""
    if vision_lr_scale == 0:
        for name, param in model.named_parameters():
            if is_vision_parameter(name):
                param.requires_grad_(False)


def build_optimizer(model: torch.nn.Module, train: TrainConfig, vision_lr_scale: float = 1.0, seed: int = 0):
    """AdamW over the trainable parameters (`trainable_groups`); the vision tower's at lr * vision_lr_scale.

    A scale of 0 freezes the vision tower instead of giving AdamW a zero learning rate. With a
    bfloat16 trainable parameter and train.stochastic_rounding, RoundingAdamW with noise from `seed`
    (its one-kernel update on CUDA).
    """
    freeze_unscaled_vision(model, vision_lr_scale)
    scales = {"language": 1.0, "vision": vision_lr_scale}
    groups = [{"params": [param for _, param in members], "lr": train.lr * scales[name], "name": name}
              for name, members in trainable_groups(model, vision_lr_scale).items()]
    settings = {"lr": train.lr, "betas": tuple(train.adam_betas), "weight_decay": train.weight_decay}
    params = [p for group in groups for p in group["params"]]
    if train.stochastic_rounding and any(p.dtype == torch.bfloat16 for p in params):
        # on CUDA one compiled kernel per parameter (292 ms eager against fused AdamW's 21 ms at 3B
        # on an H200); elsewhere the eager ops, which need no compiler
        compiled = all(p.device.type == "cuda" for p in params)
        return RoundingAdamW(groups, seed=seed, compiled=compiled, **settings)
    fused = all(p.device.type in FUSED_DEVICES for p in params) or None
    return torch.optim.AdamW(groups, fused=fused, **settings)


def lr_factor(step: int, total: int, warmup: int, schedule: str, floor: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer, train: TrainConfig, total_updates: int):
    """Linear warmup to the peak, then constant or cosine down to 10% of it."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_updates, train.warmup_steps, train.schedule))
