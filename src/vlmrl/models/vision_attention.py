"""The vision tower's attention in one call per window length, not one per window (`train.batched_vision_attention`).

Qwen2.5-VL's vision tower attends within windows (4 x 4 merged tokens, i.e. 64 patches) in all but
four of its 32 layers, and over each whole image in those four; Qwen2-VL's attends over each image.
Under FlashAttention transformers passes the boundaries (`cu_seqlens`) to one varlen call; under
SDPA it calls attention once per window, in a Python loop: for 8 images of 896 x 896 px (64
windows each) that is 28 x 512 + 4 x 8 = 14,368 calls per pass through the tower, each a few small
kernels, so the tower is bound by kernel launches on a GPU, and the vision tower runs in every
pass of a step (the prompt's prefill, the old, reference and policy log-probs, their backward).

Here the windows of one length go through one batched call:

    windows of length w:  B x heads x w x head_dim  ->  F.scaled_dot_product_attention, no mask

and where every window has the same length (the usual case: one image size) the batch is a view
of the sequence, with no copy. Each query sees the same keys as in transformers' loop and the
arithmetic per (window, head) is the same, so the numbers are the same (tests/test_vision_attention.py:
the tower's output, the log-probs and the gradients against the loop, Qwen2.5-VL with window layers
and Qwen2-VL).

Instances are patched, as fused_kernels.py does: each vision attention module of a class in
BATCHABLE gets its own `forward` (an instance attribute) that computes its class's forward, batched.
At each call it defers to the class's forward unless the vision tower runs on SDPA (or vlmrl's
block-attention kernel, SDPA for the tower) with no dropout: an eager tower (attention maps) or
FlashAttention's varlen call stay as transformers has them. Before any module is patched, the
batched forward must give the class's numbers on a small input (`self_check`): a transformers
whose vision attention computes something else keeps its own forward, and the preflight's speed
line says why.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch
import torch.nn.functional as F

from vlmrl.errors import one_line
from vlmrl.models.block_attention import NAME as BLOCKS_KERNEL

BATCHABLE = ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLVisionAttention",
             "transformers.models.qwen2_vl.modeling_qwen2_vl.VisionAttention")
"""The vision attention classes (Qwen2.5-VL, Qwen2-VL) whose forward `_batched_forward` computes."""
SDPA_KERNELS = ("sdpa", BLOCKS_KERNEL)
"""Attention implementations under which transformers loops over the windows with SDPA."""


def window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Attention of each position over the positions of its own window: query, key, value (S, h, d);
    window k spans positions cu_seqlens[k] to cu_seqlens[k + 1] (cu_seqlens (W + 1,), from 0 to S).
    Returns (S, h, d)."""
    bounds = cu_seqlens.tolist()  # the host needs the lengths to shape the batches (so does the loop)
    starts, lengths = bounds[:-1], [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    sizes = set(lengths) - {0}
    if len(sizes) == 1 and bounds[0] == 0 and bounds[-1] == len(query):  # consecutive rows of one view
        width = sizes.pop()
        return _attend(*(t.view(-1, width, *t.shape[1:]) for t in (query, key, value)), scaling).flatten(0, 1)
    out = torch.empty_like(query)  # (S, h, d): each position is in exactly one window
    for width in sorted(sizes):
        first = torch.tensor([s for s, n in zip(starts, lengths) if n == width], device=query.device)  # (B,)
        rows = (first[:, None] + torch.arange(width, device=query.device)).flatten()  # (B * w,)
        batch = (t[rows].view(-1, width, *t.shape[1:]) for t in (query, key, value))  # (B, w, h, d) each
        out = out.index_copy(0, rows, _attend(*batch, scaling).flatten(0, 1))
    return out


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """(B, w, h, d) each -> (B, w, h, d): every position of a window over the whole window."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, h, w, d)
    return F.scaled_dot_product_attention(q, k, v, scale=scaling).transpose(1, 2)


def _batched_forward(module: torch.nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, max_seqlen=None,
                     **kwargs) -> torch.Tensor:
    """transformers' Qwen2-VL / Qwen2.5-VL vision attention forward, its windows batched."""
    if module.config._attn_implementation not in SDPA_KERNELS or (module.training and module.attention_dropout):
        return type(module).forward(module, hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
    length = hidden_states.shape[0]  # S
    qkv = module.qkv(hidden_states).reshape(length, 3, module.num_heads, -1)  # (S, 3, h, d)
    query, key, value = qkv.permute(1, 0, 2, 3).unbind(0)  # (S, h, d) each
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb_vision  # the model family's own
    query, key = rotary(query, key, *position_embeddings)
    out = window_attention(query, key, value, cu_seqlens, module.scaling)  # (S, h, d)
    return module.proj(out.reshape(length, -1))


def use_batched_vision_attention(model: torch.nn.Module, on: bool, device: torch.device | None = None) -> int:
    """Put the model's vision attention modules on one call per window length (on) or back on their
    class's forward (off). Returns how many modules compute batched: none where
    `batched_vision_unsupported` gives a reason on `device` (the model's when None)."""
    on = on and batched_vision_unsupported(model, device) is None
    patched = 0
    for module in model.modules():
        if _is_patched(module):
            del module.forward  # the instance attribute: the class's forward shows through again
        if on and _batchable(module):
            module.forward = functools.partial(_batched_forward, module)
            patched += 1
    return patched


def batched_vision_unsupported(model: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """Why the model's vision attention cannot be batched on `device` (the model's when None), or
    None when it can: a Qwen2-VL or Qwen2.5-VL vision tower on SDPA, whose batched forward passes
    `self_check` there."""
    modules = [module for module in model.modules() if _batchable(module)]
    if not modules:
        return "not a Qwen2-VL or Qwen2.5-VL vision tower"
    kernel = modules[0].config._attn_implementation
    if kernel not in SDPA_KERNELS:
        return f"the vision tower runs on {kernel}" + (", one varlen call already" if "flash" in str(kernel) else "")
    return self_check(modules[0], device)


def self_check(module: torch.nn.Module, device: torch.device | None = None) -> str | None:
    """Why the batched forward cannot stand in for `module`'s own, or None: both on a small random
    input (windows of 4, 2 and 6 positions) on `device` (the module's when None: a copy of the
    module is checked there, for a model still in CPU memory that trains on a GPU) and its dtype,
    within a rounding (1e-5 of the norm in float32, 2e-2 in 16 bits). Catches a transformers whose
    vision attention computes something else than the forward copied here, before it trains anything."""
    own_device = next(module.parameters()).device
    if own_device.type == "meta" or (device is not None and own_device != torch.device(device)):
        try:
            module = _copy_on(module, device if device is not None else torch.device("cpu"))
        except (RuntimeError, AssertionError) as error:  # a device this torch cannot reach
            return f"not checked on {device}: {one_line(error)[:200]}"
    parameter = next(module.parameters())
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, module.dim, generator=generator).to(parameter)  # (S, dim)
    angles = torch.randn(12, module.dim // module.num_heads, generator=generator).to(parameter)  # (S, d)
    windows = torch.tensor([0, 4, 6, 12], dtype=torch.int32, device=parameter.device)
    training = module.training
    module.eval()  # no dropout (a LoRA adapter's on qkv) to tell the two apart
    with torch.no_grad():
        own = type(module).forward(module, hidden, windows, (angles.cos(), angles.sin())).float()
        batched = _batched_forward(module, hidden, windows, (angles.cos(), angles.sin())).float()
    module.train(training)
    error = float((own - batched).norm() / own.norm().clamp(min=1e-12))
    if not error <= (1e-5 if parameter.element_size() >= 4 else 2e-2):  # NaN fails too
        return f"the batched forward is off transformers' by {error:.2g} of its norm (its vision attention changed?)"
    return None


def _copy_on(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of `module` (one attention module: small) on `device`; a module built without weights
    (meta device) gets random ones, which tell the two forwards apart as well as its own would."""
    if next(module.parameters()).device.type != "meta":
        return copy.deepcopy(module).to(device)
    twin = copy.deepcopy(module).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    return twin


def computes_batched(model: torch.nn.Module) -> bool:
    """Whether some vision attention module of the model computes its windows batched."""
    return any(_is_patched(module) for module in model.modules())


def _batchable(module: torch.nn.Module) -> bool:
    return f"{type(module).__module__}.{type(module).__name__}" in BATCHABLE


def _is_patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _batched_forward
