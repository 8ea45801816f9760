"""Fused kernels (fused_kernels.py): the patch points on the CPU, liger's kernels on CUDA.

liger's Triton kernels need CUDA, so on the CPU the same two formulas, written in torch, go through
the same patch: the patched model must then give exactly the original's log-probs and gradients on
Qwen2.5-VL, Qwen2-VL and Idefics3, which proves that every patched module computes its own forward.
Also: which modules are patched, off restores the classes' forward, a deep copy (the reference)
keeps the patch on its own modules, saved weights are unchanged, on the CPU liger falls back, and
kernels that fail the self-check (raise, compute another formula, drop a gradient) are refused.
Marked gpu (benchmarks/gpu_check.sh): liger's kernels against the original on CUDA.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from test_block_attention import rollout_of, scored

from vlmrl.models.fused_kernels import (
    TORCH_KERNELS,
    Kernels,
    computes_fused,
    fusable_modules,
    fused_kernels_unsupported,
    self_check,
    torch_rms_norm,
    torch_silu_mul,
    use_fused_kernels,
)
from vlmrl.models.loading import LoraConfig, apply_lora, load_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def expected_count(model) -> int:
    """Norms and MLPs by the architecture: per text layer two norms and an MLP, the final norm;
    per Qwen2.5-VL vision block two norms and an MLP, and the merger's norm."""
    text = model.config.get_text_config().num_hidden_layers
    vision = model.config.vision_config.depth if model.config.model_type == "qwen2_5_vl" else 0
    return 3 * text + 1 + (3 * vision + 1 if vision else 0)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "idefics3"])
def test_the_patched_model_computes_exactly_the_original(arch, tiny_model_factory):
    model, processor = load_policy(tiny_model_factory(arch), device="cpu")
    completions = rollout_of(model, processor)
    model.train()
    own_logp, own_grad = scored(model, processor, completions, True)
    calls = []
    counting = Kernels(rms_norm=lambda *a: calls.append("norm") or torch_rms_norm(*a),
                       silu_mul=lambda *a: calls.append("mlp") or torch_silu_mul(*a))
    assert use_fused_kernels(model, True, counting) == len(fusable_modules(model)) == expected_count(model)
    assert computes_fused(model)
    calls.clear()  # the self-check's
    fused_logp, fused_grad = scored(model, processor, completions, True)
    assert "norm" in calls and "mlp" in calls
    assert torch.equal(own_logp, fused_logp)
    assert torch.equal(own_grad, fused_grad)


def test_off_restores_the_modules_own_forward(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu")
    keys = list(model.state_dict())
    use_fused_kernels(model, True, TORCH_KERNELS)
    assert list(model.state_dict()) == keys  # nothing saved changes
    assert use_fused_kernels(model, True, TORCH_KERNELS) == expected_count(model)  # again: not patched twice
    assert use_fused_kernels(model, False) == 0
    assert not computes_fused(model)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_a_deep_copy_keeps_the_patch_on_its_own_modules(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu")
    use_fused_kernels(model, True, TORCH_KERNELS)
    twin = copy.deepcopy(model)  # how a full-weight reference policy is made
    assert computes_fused(twin)
    for module in fusable_modules(twin):
        assert module.forward.args[0] is module  # the copy's weights, not the original's


def test_under_lora_the_wrapped_projections_are_called(tiny_model_dir):
    model, processor = load_policy(tiny_model_dir, device="cpu")
    model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # adapters that change the output
    completions = rollout_of(model, processor)
    model.train()
    own_logp, own_grad = scored(model, processor, completions, True)
    assert use_fused_kernels(model, True, TORCH_KERNELS) == expected_count(model.base_model.model)
    fused_logp, fused_grad = scored(model, processor, completions, True)
    assert torch.equal(own_logp, fused_logp) and torch.equal(own_grad, fused_grad)


def test_on_the_cpu_liger_falls_back_with_its_reason(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu")
    assert fused_kernels_unsupported(model) == "needs a CUDA device: the kernels are Triton's"
    assert use_fused_kernels(model, True) == 0 and not computes_fused(model)


def test_kernels_that_fail_their_self_check_are_refused_before_step_1(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, device="cpu")
    norm_widths = sorted({m.weight.shape[0] for m in fusable_modules(model) if type(m).__name__.endswith("RMSNorm")})
    assert len(norm_widths) == 2  # the vision tower's and the language model's: each is checked

    def broken(*tensors):
        raise RuntimeError("Triton: no kernel image is available for execution on the device\nmore")

    crashing = Kernels(rms_norm=broken, silu_mul=torch_silu_mul)
    assert fused_kernels_unsupported(model, crashing) == (
        f"rms_norm (width {norm_widths[0]}) failed its self-check: "
        "RuntimeError: Triton: no kernel image is available for execution on the device more")  # whole, on one line
    wrong = Kernels(rms_norm=torch_rms_norm, silu_mul=lambda gate, up: torch.sigmoid(gate) * up)
    assert re.fullmatch(r"silu_mul \(width \d+\) failed its self-check: values are off torch's by \S+ of their norm",
                        fused_kernels_unsupported(model, wrong))

    def wide_only_wrong(x, w, eps):  # right at the smaller width, wrong at the larger one
        return torch_rms_norm(x, w, eps) * (1.0 if x.shape[-1] == norm_widths[0] else 1.5)

    assert fused_kernels_unsupported(model, Kernels(wide_only_wrong, torch_silu_mul)).startswith(
        f"rms_norm (width {norm_widths[1]}) failed its self-check: values are off torch's by 0.5 of their norm")
    no_weight_gradient = Kernels(rms_norm=lambda x, w, eps: torch_rms_norm(x, w.detach(), eps) + 0 * w.sum(),
                                 silu_mul=torch_silu_mul)
    assert re.fullmatch(r"rms_norm \(width \d+\) failed its self-check: weight gradients are off torch's by 1 of their norm",
                        fused_kernels_unsupported(model, no_weight_gradient))
    for kernels in (crashing, wrong, no_weight_gradient):
        assert use_fused_kernels(model, True, kernels) == 0 and not computes_fused(model)
    with torch.no_grad():  # the check computes gradients even when asked from a no-grad pass
        assert fused_kernels_unsupported(model, TORCH_KERNELS) is None


class InPlaceSiluMul(torch.autograd.Function):
    """silu(gate) * up whose backward writes the gradients over its saved inputs, as liger's
    swiglu_backward does (the kernel's way to spare two buffers)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        d_gate = grad * up * sig * (1 + gate * (1 - sig))
        d_up = grad * gate * sig
        gate.data.copy_(d_gate)  # over the inputs, unseen by autograd's version counter, as Triton's stores
        up.data.copy_(d_up)
        return gate, up


def test_a_kernel_that_overwrites_its_inputs_in_backward_passes_the_self_check(tiny_model_dir):
    """liger's silu_mul overwrites gate and up with their gradients in its backward: right wherever
    gate and up are fresh tensors, as gate_proj(x) and up_proj(x) are in the model. The self-check
    once fed x itself as the gate beside `x * w`, whose backward then read the overwritten x, and it
    refused liger on CUDA ('weight gradients are off torch's by 2.79 of their norm'). Here the same
    in-place backward passes the check, and patched into the model gives its own gradients."""
    in_place = Kernels(rms_norm=torch_rms_norm, silu_mul=InPlaceSiluMul.apply)
    widths = [("silu_mul", 64), ("silu_mul", 3420)]
    assert self_check(in_place, torch.zeros(()), widths) is None
    model, processor = load_policy(tiny_model_dir, device="cpu")
    completions = rollout_of(model, processor)
    model.train()
    own_logp, own_grad = scored(model, processor, completions, True)
    assert use_fused_kernels(model, True, in_place) == expected_count(model)
    fused_logp, fused_grad = scored(model, processor, completions, True)
    assert torch.equal(own_logp, fused_logp)
    assert (own_grad - fused_grad).abs().max() <= 1e-6 * own_grad.abs().max()  # the formula's rounding
    x, w = torch.randn(4, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    (InPlaceSiluMul.apply(x, x * w)).sum().backward()  # the old check's use: x is saved by x * w as well
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch_silu_mul(x2, x2 * w2)).sum().backward()
    assert not torch.allclose(w.grad, w2.grad, rtol=0.1)  # x overwritten before w's gradient read it


def test_in_bf16_rounding_passes_the_self_check_at_qwen25_vl_3b_widths():
    """torch's own formulas in bf16, which round more often than a fused kernel, pass against the
    float32 reference: the check refuses wrong kernels, not bf16."""
    widths = [("rms_norm", 1280), ("rms_norm", 2048), ("silu_mul", 3420), ("silu_mul", 11008)]
    assert self_check(TORCH_KERNELS, torch.zeros((), dtype=torch.bfloat16), widths) is None
    wrong = Kernels(rms_norm=torch_rms_norm, silu_mul=lambda gate, up: torch.sigmoid(gate) * up)
    assert self_check(wrong, torch.zeros((), dtype=torch.bfloat16), widths) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, logp_tolerance", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_on_cuda_liger_kernels_give_the_models_own_numbers(tiny_model_dir, dtype, logp_tolerance):
    model, processor = load_policy(tiny_model_dir, device="cuda", dtype=dtype)
    completions = rollout_of(model, processor)
    model.train()
    own_logp, own_grad = scored(model, processor, completions, True)
    assert fused_kernels_unsupported(model) is None  # liger's, on CUDA: the self-check passes
    assert use_fused_kernels(model, True) == expected_count(model)
    fused_logp, fused_grad = scored(model, processor, completions, True)
    assert (own_logp.float() - fused_logp.float()).abs().max() < logp_tolerance
    assert F.cosine_similarity(own_grad.float(), fused_grad.float(), dim=0) >= (0.9999 if dtype == "float32" else 0.99)
    rollout = rollout_of(model, processor)  # generation runs on the kernels too (the decode path compiles them)
    assert rollout.completion_ids.shape == completions.completion_ids.shape
