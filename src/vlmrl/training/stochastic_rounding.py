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

The noise of the eager update is drawn from a generator seeded by (seed, the parameter's step
count, its place in the optimizer): every process draws the same numbers for the same replicated
weights (processes stay identical), and a resumed run draws what an uninterrupted one would (the
step count is in the optimizer's state). Revisiting BFloat16 Training (Zamirai et al., 2020) and
torchao's `bf16_stochastic_round` use the same rule.

The compiled update (`compiled`, `optim.build_optimizer`'s choice on CUDA) runs as one
torch.compile'd kernel per piece that makes its own noise, computes the update and writes weight
and moments back in place: a single pass over memory instead of the eager path's dozen, and no
generator call per tensor. Its noise is counter-based, so a kernel can compute it: element i gets
the top 16 bits of a 32-bit integer hash of i xor a key derived from (seed, step count, place,
piece, which of weight / moments) -- the same numbers on any device, and reproducible on resume
as the generator's are. Given the same noise, the kernel computes exactly the eager arithmetic
compiled (tests/test_stochastic_rounding.py; benchmarks/bench_optimizer.py times both). A run keeps
one path (it follows the device), so its resume is exact either way.
"""

from __future__ import annotations

import functools
import math

import torch

from vlmrl.seeds import derive_seed

CHUNK = 1 << 24
"""Elements updated at a time: bounds the step's float32 temporaries (~6 x 64 MiB)."""


MASK32 = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x5BD1E995)
"""The two odd multipliers of the noise hash (lowbias32's first and MurmurHash2's): each below 2^31,
so a product with a 32-bit value never overflows int64, in eager kernels or compiled ones."""


def round_stochastically(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """bf16 of float32 `x`, rounded up or down with probabilities that make it unbiased."""
    return rounded(x, rounding_noise(x, generator))


def rounding_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Uniform random 16-bit integers (int32), one per element of `like`."""
    return torch.randint(0, 1 << 16, like.shape, generator=generator, device=like.device, dtype=torch.int32)


def hashed_noise(key: torch.Tensor, count: int, device: torch.device) -> torch.Tensor:
    """(count,) uniform 16-bit integers (int32): element i is the top half of a 32-bit hash of
    i xor `key` (an int64 scalar tensor below 2^32). Integer arithmetic only: exact and the same in
    any kernel on any device."""
    x = torch.arange(count, device=device, dtype=torch.int64) ^ key.to(device)  # (count,)
    x = x ^ (x >> 16)
    x = (x * HASH_MULTIPLIERS[0]) & MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_MULTIPLIERS[1]) & MASK32
    x = x ^ (x >> 16)
    return (x >> 16).to(torch.int32)  # (count,) in [0, 2^16)


def rounded(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """bf16 of float32 `x` by stochastic rounding with `noise` (`rounding_noise` or `hashed_noise`,
    shaped as `x`).

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
        self.compiled = compiled  # eager torch ops, or one compiled kernel per piece (module docstring)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                if param.grad is not None:
                    self._update(param, group, (group_index, index))
        return loss

    def _update(self, param: torch.Tensor, group: dict, place: tuple[int, int]) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] = state["step"].cpu() + 1  # on the host (a fused AdamW's checkpoint keeps it on the GPU)
        step = int(state["step"])
        beta1, beta2 = group["betas"]
        hyper = (group["lr"], beta1, beta2, group["eps"], group["weight_decay"], 1 - beta1 ** step,
                 math.sqrt(1 - beta2 ** step))
        tensors = tuple(_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"]))
        pieces = [list(tensors)]  # a tensor that is not contiguous: one piece, updated through copies
        if all(t.is_contiguous() for t in tensors):
            flat = [t.view(-1) for t in tensors]
            pieces = [[t[start:start + CHUNK] for t in flat] for start in range(0, flat[0].numel(), CHUNK)]
        if self.compiled:
            for number, piece in enumerate(pieces):
                keys = [derive_seed(self.seed, "rounding", step, *place, number, target) & MASK32 for target in range(3)]
                compiled_update()(piece, torch.tensor(keys), hyper)
            return
        generator = torch.Generator(param.device).manual_seed(derive_seed(self.seed, "rounding", step, *place))
        for piece in pieces:
            noise = tuple(rounding_noise(t, generator) if t.dtype == torch.bfloat16 else None
                          for t in (piece[0], piece[2], piece[3]))
            update_in_place(piece, noise, hyper)


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


def update_in_place(tensors: list[torch.Tensor], noise: tuple, hyper: tuple) -> None:
    """One AdamW step of the piece (weight, gradient, first moment, second moment), all of one
    shape, computed in float32 (`adamw_values`) and written back, by stochastic rounding with its
    noise (weight, first, second moment) where a target is bf16, else as is."""
    weight, grad, exp_avg, exp_avg_sq = tensors
    for target, value in zip((weight, exp_avg, exp_avg_sq), adamw_values(weight, grad, exp_avg, exp_avg_sq, noise, hyper)):
        target.copy_(value)


def hashed_update(tensors: list[torch.Tensor], keys: torch.Tensor, hyper: tuple) -> None:
    """`update_in_place` with counter-based noise: target i's from `hashed_noise(keys[i])`."""
    targets = (tensors[0], tensors[2], tensors[3])
    noise = tuple(hashed_noise(key, t.numel(), t.device).view(t.shape) if t.dtype == torch.bfloat16 else None
                  for key, t in zip(keys.unbind(), targets))
    update_in_place(tensors, noise, hyper)


@functools.cache
def compiled_update():
    """`hashed_update` as one kernel per piece: torch.compile'd once for pieces of any length
    (dynamic shapes), the keys and scalars passed as tensors (torch 2.11 guards on the value of a
    Python float argument, so each new learning rate would compile again). The noise is hashed,
    the update computed and the three targets written in one pass."""
    compiled = torch.compile(hashed_update, dynamic=True)

    def update(tensors: list[torch.Tensor], keys: torch.Tensor, hyper: tuple) -> None:
        scalars = torch.tensor(hyper, dtype=torch.float32, device=tensors[0].device)  # (7,)
        compiled(tensors, keys.to(tensors[0].device), tuple(scalars.unbind()))

    return update
