"""Fused kernels for the decoder's RMSNorm and SiLU-gated MLP, from liger-kernel (`train.fused_kernels`).

Off by default until its effect is measured on a GPU (benchmarks/gpu_pending.sh, part `fused`).
When on, each RMSNorm and SwiGLU MLP of a checked model family computes with one fused Triton
kernel from liger-kernel, the library TRL, verl and EasyR1 use for the same purpose:

    RMSNorm:  y = w * (x * rsqrt(mean(x^2) + eps))   x in float32, cast back before the weight
              (transformers' own formula; liger's "llama" casting)
    MLP:      y = down(silu(gate(x)) * up(x))        silu and the product in one kernel, whose
                                                     backward recomputes silu instead of storing it

Instances are patched, not classes: `forward` is replaced on each module only (an instance
attribute), over the module's own weights. Nothing else in the process changes, state dicts and
saved models are unchanged, a deep copy (the reference policy) keeps the patch, and
`use_fused_kernels(model, False)` takes it off. Every pass of the patched model uses the kernels,
generation included, so the sampler and the training pass still compute the same function.

Which modules: the classes in FUSABLE_NORMS and FUSABLE_MLPS, whose forward is the formula above
(an MLP only with a SiLU activation). Qwen2.5-VL's vision tower uses both; Qwen2-VL's and
Idefics3's vision towers use neither (LayerNorm, GELU), so only their language models change.

tests/test_fused_kernels.py checks the patch points on the CPU by running the same formulas
written in torch (the patched model equals the original); liger's kernels need CUDA, and the
tests marked gpu check them against the original within bf16/fp32 tolerances.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

FUSABLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm")
FUSABLE_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen2_5_VLMLP")
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


@dataclass(frozen=True)
class Kernels:
    """The two fused operations, as functions of tensors."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x (..., H), weight (H,), eps) -> (..., H), the RMSNorm formula above."""
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up), (..., I) each -> silu(gate) * up."""


def liger_kernels() -> Kernels:
    """liger-kernel's Triton kernels (CUDA only)."""
    from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # in_place=False: the backward writes dx to a new buffer, never over the incoming gradient
        return liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)

    return Kernels(rms_norm=rms_norm, silu_mul=liger_swiglu)


def fusable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's RMSNorm and SiLU-gated MLP modules whose forward the kernels compute."""
    return [module for module in model.modules() if _fused_forward(module) is not None]


def fused_kernels_unsupported(model: torch.nn.Module) -> str | None:
    """Why the model cannot compute with liger's fused kernels, or None when it can."""
    if next(model.parameters()).device.type != "cuda":
        return "needs a CUDA device: the kernels are Triton's"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel, or vlmrl's [kernels] extra)"
    if not fusable_modules(model):
        return f"no RMSNorm or MLP of a checked kind ({', '.join(FUSABLE_NORMS + FUSABLE_MLPS)})"
    return None


def use_fused_kernels(model: torch.nn.Module, on: bool, kernels: Kernels | None = None) -> int:
    """Put the model's fusable modules on `kernels` (on; liger's when None) or back on their own
    forward (off). Returns how many modules compute with the kernels. On with kernels=None and a
    model liger cannot serve (`fused_kernels_unsupported`) leaves every module on its own forward."""
    for module in model.modules():
        if _is_patched(module):
            del module.forward  # the instance attribute: the class's forward shows through again
    if not on or (kernels is None and fused_kernels_unsupported(model) is not None):
        return 0
    kernels = kernels if kernels is not None else liger_kernels()
    patched = 0
    for module in model.modules():
        if (forward := _fused_forward(module)) is not None:
            module.forward = functools.partial(forward, module, kernels)
            patched += 1
    return patched


def computes_fused(model: torch.nn.Module) -> bool:
    """Whether some module of the model computes with fused kernels (`use_fused_kernels`)."""
    return any(_is_patched(module) for module in model.modules())


def _fused_norm(module: torch.nn.Module, kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    return kernels.rms_norm(x, module.weight, module.variance_epsilon)


def _fused_mlp(module: torch.nn.Module, kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(kernels.silu_mul(module.gate_proj(x), module.up_proj(x)))


def _fused_forward(module: torch.nn.Module) -> Callable | None:
    """The fused forward that computes `module`'s own, or None when there is none."""
    kind = type(module).__name__
    if kind in FUSABLE_NORMS:
        return _fused_norm
    if kind in FUSABLE_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU_ACTIVATIONS:
        return _fused_mlp
    return None


def _is_patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in (_fused_norm, _fused_mlp)
