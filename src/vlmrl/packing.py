"""A group's completions packed with their prompt into one sequence, for exact log-probs.

In GRPO every prompt is answered G times and its image (hundreds of tokens) dominates the
sequence. For the policy, old and reference log-prob passes, each unique prompt and its
completions are packed into one sequence [prompt, completion 1, ..., completion k] under a block
attention mask: a completion sees the prompt and its own earlier tokens, nothing else. Its
positions continue from the prompt's last one (for Qwen-VL the 3-D rope positions, from the
model's own `_prepare_position_ids_for_generation`, as in `generate`). One forward and one
backward: log-probs and gradients are exact (tests/test_speedups.py), and gradient checkpointing
works unchanged. On the block kernel (`use_block_attention`), the mask carries its block plan and
the model's SDPA layers compute only the blocks it allows (block_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.block_attention import NAME, plan_blocks, with_plan
from vlmrl.completions import Completions
from vlmrl.support import block_attention_unsupported, hf_model
from vlmrl.tasks import Example
from vlmrl.token_inputs import extend_tokens, following_positions, prompt_positions


def group_rows(rows: list[Example]) -> list[list[int]]:
    """Row indices of each unique prompt (the same Example object), in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, example in enumerate(rows):
        groups.setdefault(id(example), []).append(i)
    return list(groups.values())


@dataclass
class Layout:
    """Where each completion row goes: U packs of K slots of T tokens after a P-token prompt."""

    groups: list[list[int]]  # groups[u]: the rows answering prompt u
    prompt_length: int  # P
    slot_length: int  # T

    @property
    def slots(self) -> int:  # K
        return max(len(g) for g in self.groups)

    @property
    def length(self) -> int:  # L = P + K * T
        return self.prompt_length + self.slots * self.slot_length

    def entries(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n,) each, in group order: the pack, the slot and the row of every completion."""
        pack = torch.tensor([u for u, g in enumerate(self.groups) for _ in g], device=device)
        slot = torch.tensor([k for g in self.groups for k in range(len(g))], device=device)
        order = torch.tensor([r for g in self.groups for r in g], device=device)
        return pack, slot, order


def use_block_attention(model: torch.nn.Module, on: bool) -> bool:
    """Put the text model's SDPA attention on block_attention's kernel (on; plain SDPA for every mask
    without a block plan, so generation is unchanged) or back on SDPA (off). True when packed
    forwards now compute blocks; eager and FlashAttention kernels stay as they are (False)."""
    text = hf_model(model).config.get_text_config()
    if on and block_attention_unsupported(model) is None:
        text._attn_implementation = NAME
    elif not on and text._attn_implementation == NAME:
        text._attn_implementation = "sdpa"
    return computes_blocks(model)


def computes_blocks(model: torch.nn.Module) -> bool:
    """Whether the model's packed forwards compute attention blocks (see `use_block_attention`)."""
    return hf_model(model).config.get_text_config()._attn_implementation == NAME


def segment_attention_mask(segment: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype,
                           blocks: bool = False) -> torch.Tensor:
    """(U, 1, L, L) additive mask of packed sequences: a query sees valid keys at or before it in the
    shared prefix (segment -1) or in its own segment. segment (U, L) or (L,), valid (U, L).
    blocks: the mask carries its block plan (block_attention.py)."""
    total = valid.shape[1]  # L
    segment = segment.expand_as(valid)  # (U, L)
    key = segment[:, None, :]  # (U, 1, L)
    same = (key == -1) | (key == segment[:, :, None])  # (U, L, L) [query, key]
    causal = torch.ones(total, total, dtype=torch.bool, device=valid.device).tril()  # (L, L)
    allowed = same & causal & valid.bool()[:, None, :]  # (U, L, L)
    allowed |= torch.eye(total, dtype=torch.bool, device=valid.device)  # padding rows see themselves: no NaN
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]  # (U, 1, L, L)
    return with_plan(mask, plan_blocks(segment, valid)) if blocks else mask


def block_attention_mask(layout: Layout, prompt_mask: torch.Tensor, slot_mask: torch.Tensor,
                         dtype: torch.dtype, blocks: bool = False) -> torch.Tensor:
    """(U, 1, L, L) additive mask: a query sees valid keys at or before it, in the prompt or in its
    own slot. prompt_mask (U, P), slot_mask (U, K, T). blocks: the mask carries its block plan."""
    device = prompt_mask.device
    segment = torch.cat([torch.full((layout.prompt_length,), -1, device=device),
                         torch.arange(layout.slots, device=device).repeat_interleave(layout.slot_length)])  # (L,)
    valid = torch.cat([prompt_mask, slot_mask.view(prompt_mask.shape[0], -1)], dim=1)  # (U, L)
    return segment_attention_mask(segment, valid, dtype, blocks)


def pack_groups(model, prompt: dict[str, torch.Tensor], completions: Completions,
                pad_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Model inputs of U packed sequences [prompt, completion slot 0, ..., slot K-1], and, for every
    completion token, the flat position (into U * L) whose output predicts it.

    prompt: processor outputs for the U unique prompts of `completions.rows`, in order of first
    appearance (input_ids (U, P), left-padded); completions: n rows of T tokens. Empty slots hold
    `pad_id`. Returns inputs (input_ids (U, L), 4-D additive attention_mask (U, 1, L, L),
    position_ids, pixel inputs untouched; the mask carries its block plan when the model computes
    blocks) and index (n, T).
    """
    completion_ids, completion_mask = completions.completion_ids, completions.completion_mask  # (n, T) each
    device = completion_ids.device
    layout = Layout(group_rows(completions.rows), prompt["input_ids"].shape[1], completion_ids.shape[1])
    units, slots, length, width = len(layout.groups), layout.slots, layout.slot_length, layout.prompt_length
    pack, slot, order = layout.entries(device)  # (n,) each
    ids = completion_ids.new_full((units, slots, length), pad_id)  # (U, K, T)
    ids[pack, slot] = completion_ids[order]
    mask = completion_mask.new_zeros((units, slots, length))  # (U, K, T)
    mask[pack, slot] = completion_mask[order]

    attention = block_attention_mask(layout, prompt["attention_mask"], mask, hf_model(model).dtype,
                                     computes_blocks(model))
    inputs = extend_tokens(prompt, ids.view(units, -1), attention)  # (U, L) per-token inputs
    positions = prompt_positions(model, prompt)  # (..., U, P)
    after = following_positions(positions, length).repeat(*([1] * (positions.dim() - 1)), slots)  # (..., U, K*T)
    inputs["position_ids"] = torch.cat([positions, after], dim=-1)  # (..., U, L)

    # Token t of the completion in slot k is predicted by position P - 1 (t = 0) or P + k*T + t - 1.
    steps = torch.arange(length, device=device)  # (T,)
    where = width + slot[:, None] * length + steps[None, :] - 1  # (n, T) in group order
    where[:, 0] = width - 1
    index = torch.empty_like(where)
    index[order] = pack[:, None] * layout.length + where  # (n, T) back in row order
    return inputs, index
