"""AdamW whose bfloat16 weights take each update through stochastic rounding (`train.stochastic_rounding`).

Why: bf16 keeps 8 significant bits, so a weight w moves only when its update exceeds half a unit in
the last place, |w| * 2^-9 to |w| * 2^-8. RL fine-tuning steps are far smaller: at lr 1e-6 an Adam
update is ~1e-6, while a weight of 0.02 needs 6e-5 (half its unit, 2^-13). Rounded to nearest,
~98% of such updates vanish (measured: after 10 steps 1.9% of the weights had changed and the mean
drift was 1/60 of float32's), so a full fine-tune in bf16 barely trains, and the vision tower at
lr * 0.1 even less.

How: the update is computed in float32, exactly as torch's AdamW computes it (decoupled weight
decay, bias-corrected moments), and stored back in bf16 by stochastic rounding:

    round(x) = the bf16 neighbour above |x| with probability (|x| - lo) / (hi - lo), else the one below,

so E[round(x)] = x: small updates land in expectation instead of never. The two moments are
stored the same way (in bf16 the second moment's (1 - beta2) g^2 share would vanish too). Memory
is unchanged (weights and moments stay bf16); the float32 temporaries are taken `CHUNK` elements at
a time. Float32 parameters (LoRA adapters, a float32 run) get the plain float32 update.

The noise is drawn from a generator seeded by (seed, the parameter's step count, its place in the
optimizer): every process draws the same numbers for the same replicated weights (processes stay
identical), and a resumed run draws what an uninterrupted one would (the step count is in the
optimizer's state). Revisiting BFloat16 Training (Zamirai et al., 2020) and torchao's
`bf16_stochastic_round` use the same rule.
"""

from __future__ import annotations

import functools
import math

import torch

from vlmrl.seeds import derive_seed

CHUNK = 1 << 24
"""Elements updated at a time: bounds the step's float32 temporaries (~6 x 64 MiB)."""


def round_stochastically(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """bf16 of float32 `x`, rounded up or down with probabilities that make it unbiased."""
    return rounded(x, rounding_noise(x, generator))


def rounding_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Uniform random 16-bit integers (int32), one per element of `like`."""
    return torch.randint(0, 1 << 16, like.shape, generator=generator, device=like.device, dtype=torch.int32)


def rounded(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """bf16 of float32 `x` by stochastic rounding with `noise` (`rounding_noise`).

    float32 and bf16 share sign and exponent; bf16 keeps the top 16 bits. Adding a uniform random
    16-bit integer to the low 16 bits of |x|'s pattern and cutting them off carries into the kept
    bits with probability (low bits) / 2^16, which is how far |x| lies from the bf16 value below it.
    """
    bits = (x.view(torch.int32) + noise) & -65536  # low 16 bits cleared: an exact bf16 value
    return bits.view(torch.float32).to(torch.bfloat16)


class RoundingAdamW(torch.optim.Optimizer):
    """torch's AdamW update, stored back into bf16 weights and moments by stochastic rounding.

    The state has torch.optim.AdamW's keys ("step", "exp_avg", "exp_avg_sq"), so checkpoints of
    either load into the other. `seed` makes the rounding noise reproducible (module docstring).
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, seed: int = 0, compiled: bool = False):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        # the update's arithmetic: eager, or one torch.compile'd kernel per piece (`compiled`), for
        # a GPU to try against eager (benchmarks/bench_optimizer.py); the two agree to one rounding
        self.values = compiled_adamw_values() if compiled else adamw_values

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        generators: dict[torch.device, torch.Generator] = {}  # one per device, re-seeded per parameter
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                if param.grad is not None:
                    generator = generators.setdefault(param.device, torch.Generator(param.device))
                    self._update(param, group, (group_index, index), generator)
        return loss

    def _update(self, param: torch.Tensor, group: dict, place: tuple[int, int], generator: torch.Generator) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] = state["step"].cpu() + 1  # on the host (a fused AdamW's checkpoint keeps it on the GPU)
        step = int(state["step"])
        generator.manual_seed(derive_seed(self.seed, "rounding", step, *place))
        tensors = tuple(_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
        if all(t.is_contiguous() for t in tensors):
            flat = [t.view(-1) for t in tensors]
            for start in range(0, flat[0].numel(), CHUNK):
                self._piece([t[start:start + CHUNK] for t in flat], group, step, generator)
        else:
            self._piece(list(tensors), group, step, generator)

    def _piece(self, tensors: list[torch.Tensor], group: dict, step: int, generator: torch.Generator) -> None:
        """One AdamW step of (weight, gradient, first moment, second moment), all of one shape, in
        float32; written back by stochastic rounding where they are bf16, else as computed."""
        weight, grad, exp_avg, exp_avg_sq = tensors
        beta1, beta2 = group["betas"]
        hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], 1 - beta1 ** step,
                 math.sqrt(1 - beta2 ** step))
        targets = (weight, exp_avg, exp_avg_sq)
        noise = tuple(rounding_noise(t, generator) if t.dtype == torch.bfloat16 else None for t in targets)
        for target, value in zip(targets, self.values(weight, grad, exp_avg, exp_avg_sq, noise, hyper)):
            target.copy_(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor (FSDP2's DTensor; the update is elementwise), else itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def adamw_values(weight: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 noise: tuple, hyper: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, first moment, second moment) after one AdamW step, computed in float32 as torch's
    AdamW computes them; each rounded to bf16 with its noise (`rounded`), or float32 where its noise
    is None. hyper: (lr, beta1, beta2, eps, weight_decay, 1 - beta1^t, sqrt(1 - beta2^t))."""
    lr, beta1, beta2, eps, weight_decay, correction1, root_correction2 = hyper
    g = grad.float()
    m = torch.lerp(exp_avg.float(), g, 1 - beta1)  # beta1 m + (1 - beta1) g
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g * g  # beta2 v + (1 - beta2) g^2
    denominator = v.sqrt() / root_correction2 + eps  # sqrt(v_hat) + eps
    w = weight.float() * (1 - lr * weight_decay) - (lr / correction1) * (m / denominator)  # decoupled decay
    return tuple(value if n is None else rounded(value, n) for value, n in zip((w, m, v), noise))


@functools.cache
def compiled_adamw_values():
    """`adamw_values` compiled once for pieces of any length (dynamic shapes), its scalars passed in
    as a float32 tensor: a changing learning rate compiles nothing new (torch 2.11 guards on the
    value of a Python float argument, so each new learning rate would compile again)."""
    compiled = torch.compile(adamw_values, dynamic=True)

    def values(weight, grad, exp_avg, exp_avg_sq, noise, hyper):
        scalars = torch.tensor(hyper, dtype=torch.float32, device=weight.device)  # (7,)
        return compiled(weight, grad, exp_avg, exp_avg_sq, noise, tuple(scalars.unbind()))

    return values
