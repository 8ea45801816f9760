"""Fused kernels for the decoder's RMSNorm and SiLU-gated MLP, from liger-kernel (`train.fused_kernels`).

Off by default until its effect is measured on a GPU (`bench_pass.py --compare fused --arch-3b`).
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

Before any module is patched, the kernels pass a self-check on the model's device and dtype:
values and gradients of both operations on a small random input against the same formulas in
torch (TORCH_KERNELS). A kernel that fails to compile or launch (an old GPU, a Triton that does
not match the driver), or that computes something else, is refused with its reason before step 1,
and the model keeps its own forward.

liger's silu_mul saves its two inputs, and its backward writes their gradients over them in place
(swiglu_backward stores da and db into a and b: no new buffers). The model's use
allows it: gate_proj(x) and up_proj(x) are fresh outputs that no other operation saves (a linear
layer saves its input, not its output). A use where an input is also saved elsewhere does not: the
self-check once fed x itself as the gate while `x * w` saved x for w's gradient, so liger's
backward overwrote that x and the weight gradients came out wrong (2.79 of their norm on an H200),
which refused a correct kernel. The check now feeds fresh tensors, as the model does.

tests/test_fused_kernels.py checks the patch points on the CPU by running TORCH_KERNELS through
them (the patched model equals the original exactly); liger's kernels need CUDA, and the tests
marked gpu check them against the original within bf16/fp32 tolerances.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from vlmrl.errors import one_line

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


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 inside, cast back before the weight."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)  # (..., H)
    return weight * y.to(x.dtype)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


TORCH_KERNELS = Kernels(rms_norm=torch_rms_norm, silu_mul=torch_silu_mul)
"""The two operations as the models compute them: the reference of the self-check."""

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
"""The self-check's bound on |kernel - reference| / |reference| (norms over the whole tensor) per
dtype; others (bf16, fp16): 5e-2, a few roundings of 2^-8 each. A wrong formula is off by far more
(a missing gradient by 1)."""


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


def fused_kernels_unsupported(model: torch.nn.Module, kernels: Kernels | None = None,
                              device: torch.device | None = None) -> str | None:
    """Why the model cannot compute with `kernels` (liger's when None), or None when it can: liger
    needs CUDA and its package; any kernels need a module to patch and must pass the self-check at
    every width the model uses them (`self_check`), on `device` (the model's when None: a model
    still in CPU memory that will train on a GPU is checked for the GPU)."""
    parameter = next(model.parameters())
    target = torch.device(device) if device is not None else parameter.device
    if kernels is None:
        if target.type != "cuda":
            return "needs a CUDA device: the kernels are Triton's"
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel is not installed (pip install liger-kernel, or vlmrl's [kernels] extra)"
    modules = fusable_modules(model)
    if not modules:
        return f"no RMSNorm or MLP of a checked kind ({', '.join(FUSABLE_NORMS + FUSABLE_MLPS)})"
    cases = sorted({_operation_and_width(module) for module in modules})
    like = torch.empty(0, dtype=parameter.dtype, device=target)
    return self_check(kernels if kernels is not None else liger_kernels(), like, cases)


def self_check(kernels: Kernels, like: torch.Tensor, cases: list[tuple[str, int]]) -> str | None:
    """Why `kernels` cannot be trusted on `like`'s device and dtype, or None. Each case (operation,
    width), "rms_norm" or "silu_mul" over a last dimension of `width`: values and gradients on a
    small random input against TORCH_KERNELS."""
    with torch.enable_grad():  # also when asked from inside a no-grad pass
        for name, width in cases:
            if (reason := _check_one(kernels, name, width, like)) is not None:
                return f"{name} (width {width}) failed its self-check: {reason}"
    return None


def _check_one(kernels: Kernels, name: str, width: int, like: torch.Tensor) -> str | None:
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).to(like.device, like.dtype)
              for shape in ((4, 3, width), (width,), (4, 3, width))]  # x, w, the upstream gradient
    try:
        got = _values_and_gradients(kernels, name, inputs)
    except Exception as error:  # a kernel that cannot compile or launch here
        return f"{type(error).__name__}: {one_line(error)[:200]}"
    exact = [t.float() if t.element_size() < 4 else t for t in inputs]  # 16-bit: the reference in float32
    expected = _values_and_gradients(TORCH_KERNELS, name, exact)
    for what, a, b in zip(("values", "input gradients", "weight gradients"), got, expected):
        error = float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))
        if not error <= TOLERANCE.get(like.dtype, 5e-2):  # NaN fails too
            return f"{what} are off torch's by {error:.3g} of their norm"
    return None


def _values_and_gradients(kernels: Kernels, name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The operation's output on (x, w), and the gradients of <output, upstream> w.r.t. x and w."""
    x, w, upstream = (t.clone().requires_grad_(i < 2) for i, t in enumerate(inputs))
    if name == "rms_norm":
        out = kernels.rms_norm(x, w, 1e-6)  # (4, 3, width)
    else:  # gate and up fresh tensors that nothing else saves, as gate_proj(x) and up_proj(x) are in
        # the model: liger's backward writes its gradients over them in place (module docstring)
        out = kernels.silu_mul(x * 1.0, x * w)  # (4, 3, width)
    grads = torch.autograd.grad((out * upstream).sum(), (x, w))
    return [out.detach(), *grads]


def use_fused_kernels(model: torch.nn.Module, on: bool, kernels: Kernels | None = None,
                      device: torch.device | None = None) -> int:
    """Put the model's fusable modules on `kernels` (on; liger's when None) or back on their own
    forward (off). Returns how many modules compute with the kernels. Kernels the model cannot use
    on `device` (the model's when None; `fused_kernels_unsupported`: no CUDA or liger, a failed
    self-check) leave every module on its own forward."""
    for module in model.modules():
        if _is_patched(module):
            del module.forward  # the instance attribute: the class's forward shows through again
    if not on or fused_kernels_unsupported(model, kernels, device) is not None:
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


def _operation_and_width(module: torch.nn.Module) -> tuple[str, int]:
    """What a fusable module runs its kernel on: ("rms_norm", hidden) or ("silu_mul", intermediate)."""
    if _fused_forward(module) is _fused_norm:
        return "rms_norm", module.weight.shape[0]
    return "silu_mul", module.gate_proj.out_features


def _is_patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func in (_fused_norm, _fused_mlp)
