"""A group's completions (or tool trajectories) packed with their prompt into one sequence, for
exact log-probs.

In GRPO every prompt is answered G times and its image (hundreds of tokens) dominates the
sequence. For the policy, old and reference log-prob passes, each unique prompt and its
completions are packed into one sequence [prompt, completion 1, ..., completion k] under a block
attention mask: a completion sees the prompt and its own earlier tokens, nothing else. Its
positions continue from the prompt's last one (for Qwen-VL the 3-D rope positions, from the
model's own `_prepare_position_ids_for_generation`, as in `generate`). One forward and one
backward: log-probs and gradients are exact (tests/test_speedups.py), and gradient checkpointing
works unchanged. On the block kernel (`use_block_attention`), the mask carries its block plan and
the model's SDPA layers compute only the blocks it allows (models/block_attention.py).

`pack_trajectories` does the same for multi-turn trajectories (rollout/trajectories.py): one
sequence per prompt, [prompt, trajectory 1, trajectory 2, ...], each trajectory's positions those
it would have after its prompt alone, its tool results' images in the one processor call.

transformers takes a 4-D mask as it is, so the packed mask carries the model's own rules too
(`support.attention_rules`): each image block attends both ways where the family does (Gemma 3:
OR'd in), and a sliding window counts tokens as the plain sequence has them, each segment right
after the prefix (AND'd in; a dict of masks by layer kind where only some layers slide).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.models.block_attention import NAME, plan_blocks, with_plan
from vlmrl.models.support import attention_rules, block_attention_unsupported, hf_model
from vlmrl.models.token_inputs import extend_tokens, following_positions, per_token_keys, prompt_positions
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import model_inputs, processor_inputs
from vlmrl.rollout.trajectories import Segment, pixels_of, prompt_text
from vlmrl.tasks import Example


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
    segment = segment.expand_as(valid)  # (U, L)
    mask = additive(seen_keys(segment, valid), dtype)  # (U, 1, L, L)
    return with_plan(mask, plan_blocks(segment, valid)) if blocks else mask


def seen_keys(segment: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(U, L, L) [query, key]: the packing's rule, before any of the model's own."""
    total = valid.shape[1]  # L
    key = segment[:, None, :]  # (U, 1, L)
    same = (key == -1) | (key == segment[:, :, None])  # (U, L, L)
    causal = torch.ones(total, total, dtype=torch.bool, device=valid.device).tril()  # (L, L)
    return same & causal & valid.bool()[:, None, :]  # (U, L, L)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(U, 1, L, L) additive mask from allowed (U, L, L); padding rows see themselves (no NaN)."""
    allowed = allowed | torch.eye(allowed.shape[-1], dtype=torch.bool, device=allowed.device)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


def packed_mask(model, segment: torch.Tensor, valid: torch.Tensor,
                inputs: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of packed sequences (segment, valid (U, L); -1 the shared prefix) under
    the model's rules (`support.attention_rules`): (U, 1, L, L), or one per layer kind. It carries
    its block plan when the model computes blocks and nothing but the packing's rule applies."""
    rules, dtype = attention_rules(model), hf_model(model).dtype
    if rules.image_blocks is None and (rules.window is None or rules.window >= valid.shape[1]):
        return segment_attention_mask(segment, valid, dtype, computes_blocks(model))
    allowed = seen_keys(segment, valid)  # (U, L, L)
    if rules.image_blocks is not None:
        block = image_blocks(inputs[rules.image_blocks])  # (U, L)
        allowed |= (block[:, :, None] == block[:, None, :]) & (block >= 0)[:, :, None]
    if rules.window is None:
        return additive(allowed, dtype)
    sliding = additive(allowed & within_window(segment, rules.window), dtype)
    if not rules.per_kind:
        return sliding
    return {kind: sliding if kind == "sliding_attention" else additive(allowed, dtype) for kind in rules.layer_kinds}


def image_blocks(token_types: torch.Tensor) -> torch.Tensor:
    """(U, L): each run of image tokens (type 1) numbered from 0 along its row, -1 elsewhere."""
    image = token_types == 1  # (U, L)
    starts = image & ~torch.nn.functional.pad(image, (1, 0))[:, :-1]  # (U, L) first token of a block
    return torch.where(image, starts.long().cumsum(1) - 1, -1)


def within_window(segment: torch.Tensor, window: int) -> torch.Tensor:
    """(U, L, L) [query, key]: the key is less than `window` tokens back, counted in the sequence the
    query has alone (the prefix, then its own segment from where the prefix ends)."""
    units, total = segment.shape
    index = torch.arange(total, device=segment.device).expand(units, total)  # (U, L)
    prefix = (segment == -1).sum(1, keepdim=True)  # (U, 1) the prefix comes first
    first = torch.full((units, total + 1), total, device=segment.device).scatter_reduce(
        1, segment.clamp(min=-1) + 1, index, "amin")  # (U, L+1): first index of each label (+1)
    start = first.gather(1, segment.clamp(min=-1) + 1)  # (U, L) where each token's segment begins
    alone = torch.where(segment >= 0, prefix + index - start, index)  # (U, L)
    return alone[:, None, :] > alone[:, :, None] - window


def layout_segments(layout: Layout, prompt_mask: torch.Tensor,
                    slot_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment labels (L,) of packed groups (-1 the prompt, k slot k) and which positions are
    valid (U, L). prompt_mask (U, P), slot_mask (U, K, T)."""
    device = prompt_mask.device
    segment = torch.cat([torch.full((layout.prompt_length,), -1, device=device),
                         torch.arange(layout.slots, device=device).repeat_interleave(layout.slot_length)])  # (L,)
    valid = torch.cat([prompt_mask, slot_mask.view(prompt_mask.shape[0], -1)], dim=1)  # (U, L)
    return segment.expand_as(valid), valid


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

    segment, valid = layout_segments(layout, prompt["attention_mask"], mask)  # (U, L) each
    inputs = extend_tokens(prompt, ids.view(units, -1), valid)  # (U, L) per-token inputs
    inputs["attention_mask"] = packed_mask(model, segment, valid, inputs)
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


# --------------------------------------------------------------------------- a group's first turn once


def _row_tokens(segments: list[Segment], keys: list[str]) -> tuple[list[int], dict[str, list[int]], str, list, list]:
    """A trajectory's ids, its other per-token inputs, its context texts, its images and its videos."""
    ids = [i for s in segments for i in s.ids]
    extras = {k: [v for s in segments for v in s.extras.get(k, [0] * len(s.ids))] for k in keys}
    return (ids, extras, "".join(s.text for s in segments if not s.model), [im for s in segments for im in s.images],
            [video for s in segments for video in s.videos])


def _slot_positions(model, processor, example: Example, prompt: dict, row: tuple) -> torch.Tensor:
    """Position ids (..., 1, n) of a trajectory's n tokens, as if it followed its prompt alone."""
    ids, extras, text, images, videos = row
    alone = model_inputs(processor(text=[prompt_text(processor, example) + text], return_tensors="pt",
                                   **processor_inputs(processor, [example], [images], [videos])))
    inputs = {k: v for k, v in alone.items() if k not in per_token_keys(alone)}
    inputs["input_ids"] = torch.cat([prompt["input_ids"][0].cpu(), torch.tensor(ids, dtype=torch.long)])[None]
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    for key, values in extras.items():
        inputs[key] = torch.cat([prompt[key][0].cpu(), torch.tensor(values, dtype=prompt[key].dtype)])[None]
    device = prompt["input_ids"].device
    positions = prompt_positions(model, {k: v.to(device) for k, v in inputs.items()})  # (..., 1, P + n)
    return positions[..., prompt["input_ids"].shape[1]:]  # (..., 1, n)


def pack_trajectories(model, processor, rows: list[Example], segments: list[list[Segment]],
                      length: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Inputs of U sequences, one per unique prompt (the same Example object), each [prompt,
    trajectory 1, trajectory 2, ...] under a block attention mask (a trajectory sees the prompt and
    its own earlier tokens), and for every token of every trajectory the flat position into U * L
    whose output predicts it: (N, `length`). The prompt and its images are computed once per group.
    The mask carries its block plan when the model computes blocks (packing.use_block_attention)."""
    device = next(model.parameters()).device
    groups = group_rows(rows)
    prompts = [{k: v.to(device) for k, v in model_inputs(processor(
        text=[prompt_text(processor, rows[g[0]])], return_tensors="pt", **processor_inputs(processor, [rows[g[0]]]))).items()}
        for g in groups]  # (1, P_u) each
    keys = [k for k in per_token_keys(prompts[0]) if k not in ("input_ids", "attention_mask")]
    tokens = {r: _row_tokens(segments[r], keys) for g in groups for r in g}
    inputs = {k: v.to(device) for k, v in _pack_inputs(processor, rows, groups, prompts, tokens).items()}
    total = inputs["input_ids"].shape[1]  # L
    label = torch.full((len(groups), total), -2, device=device)  # -1 prompt, k slot k, -2 padding
    index = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    positions = []
    for u, (prompt, g) in enumerate(zip(prompts, groups)):
        start = width = prompt["input_ids"].shape[1]  # P
        label[u, :start] = -1
        parts = [prompt_positions(model, dict(prompt))]  # (..., 1, P)
        for k, r in enumerate(g):
            n = len(tokens[r][0])
            label[u, start:start + n] = k
            steps = torch.arange(length, device=device).clamp(max=max(n - 1, 0))
            index[r] = u * total + torch.where(steps == 0, width - 1, start + steps - 1)  # token 0: the prompt's last
            parts.append(_slot_positions(model, processor, rows[g[0]], prompt, tokens[r]).to(device))
            start += n
        pad = torch.zeros(*parts[0].shape[:-1], total - start, dtype=parts[0].dtype, device=device)
        positions.append(torch.cat([*parts, pad], dim=-1))  # (..., 1, L)
    inputs["attention_mask"] = packed_mask(model, label, label != -2, inputs)
    inputs["position_ids"] = torch.cat(positions, dim=-2)  # (..., U, L)
    return inputs, index


def _pack_inputs(processor, rows: list[Example], groups: list[list[int]], prompts: list[dict],
                 tokens: dict[int, tuple]) -> dict[str, torch.Tensor]:
    """input_ids and other per-token inputs of the packs (right-padded), and the pixel inputs of every
    image and video: each pack's prompt's, then its trajectories', in order (one processor call)."""
    packs = [prompt["input_ids"][0].tolist() + [i for r in g for i in tokens[r][0]] for prompt, g in zip(prompts, groups)]
    total = max(len(p) for p in packs)  # L
    pad = processor.tokenizer.pad_token_id
    inputs = {"input_ids": torch.tensor([p + [pad] * (total - len(p)) for p in packs])}  # (U, L)
    for key in [k for k in per_token_keys(prompts[0]) if k not in ("input_ids", "attention_mask")]:
        values = [prompt[key][0].tolist() + [v for r in g for v in tokens[r][1][key]] for prompt, g in zip(prompts, groups)]
        inputs[key] = torch.tensor([v + [0] * (total - len(v)) for v in values])  # (U, L)
    texts = ["".join(tokens[r][2] for r in g) for g in groups]  # each pack's context, in order
    images = [[im for r in g for im in tokens[r][3]] for g in groups]
    videos = [[video for r in g for video in tokens[r][4]] for g in groups]
    return inputs | pixels_of(processor, [rows[g[0]] for g in groups], texts, images, videos)
