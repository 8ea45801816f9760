"""Processor outputs along the token axis, and the position ids that go with them.

A processor returns some tensors that run along the prompt tokens (input_ids, attention_mask,
token-type ids of any name, mllama's cross_attention_mask) and some that do not (pixel values, image
grids). Appending tokens to a prompt extends the first kind and passes the second through untouched
(`extend_tokens`), which is what lets prefill, packing and the plain forward work for any family
without per-architecture code.

The new tokens are plain text, and get what `generate` gives the tokens it appends (transformers
5.24): a per-token id (B, P) such as mm_token_type_ids gets 0, "text"
(`GenerationMixin._update_model_kwargs_for_generation`; it repeats the last value of a plain
`token_type_ids` instead, which only PaliGemma returns, and there 0 means "prefix": PaliGemma's
completions are not handled here); a per-token tensor with trailing dims
(B, P, ...) says what each token sees, and a new token sees what the last prompt token sees: mllama's
cross_attention_mask (B, P, images, tiles) gets the last prompt position's row repeated, as mllama's
`_update_model_kwargs_for_generation` (one row per decoded token) and `prepare_inputs_for_generation`
(`cross_attention_mask[:, -1:]` expanded over the missing positions) do. Without it, completion tokens
would attend to no image tile at all.
"""

from __future__ import annotations

import torch

from vlmrl.models.support import hf_model


def per_token_keys(inputs: dict[str, torch.Tensor]) -> list[str]:
    """Processor outputs that run along the prompt tokens: tensors whose first two dims are
    input_ids' (B, P), with or without trailing dims (input_ids, attention_mask, type ids, mllama's
    cross_attention_mask (B, P, images, tiles))."""
    shape = inputs["input_ids"].shape
    return [k for k, v in inputs.items() if torch.is_tensor(v) and v.shape[:2] == shape]


def token_fill(value: torch.Tensor, length: int) -> torch.Tensor:
    """What `length` plain-text tokens appended after the prompt get in a per-token input `value`
    (B, P, ...): 0 for a (B, P) id, the last prompt position repeated where there are trailing dims
    (see the module docstring). Returns (B, length, ...)."""
    if value.dim() == 2:
        return value.new_zeros((value.shape[0], length))  # (B, length)
    return value[:, -1:].expand(-1, length, *value.shape[2:])  # (B, length, ...)


def extend_tokens(inputs: dict[str, torch.Tensor], new_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Model inputs for the prompts followed by `new_ids` (B, T) of plain text.

    inputs: processor outputs (input_ids (B, P), ...). `attention_mask` replaces the prompt's: a
    (B, P+T) padding mask, or a 4-D block mask for packed sequences. Other per-token inputs are
    extended along dim 1 by `token_fill` (0 for type ids (B, P); the last prompt row for (B, P, ...)
    such as mllama's cross_attention_mask); pixel inputs pass through.
    """
    along = per_token_keys(inputs)
    length = new_ids.shape[1]  # T
    joined = {}
    for key, value in inputs.items():
        if key == "attention_mask":
            joined[key] = attention_mask
        elif key in along:
            tail = new_ids if key == "input_ids" else token_fill(value, length)  # (B, T, ...)
            joined[key] = torch.cat([value, tail.to(value.dtype)], dim=1)  # (B, P+T, ...)
        else:
            joined[key] = value
    return joined


def join_prompt_and_completion(inputs: dict[str, torch.Tensor], completion_ids: torch.Tensor,
                               completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Model inputs for N prompts (left-padded processor outputs, input_ids (N, P)) each followed
    by its completion (N, T): per-token inputs become (N, P+T)."""
    mask = inputs["attention_mask"]  # (N, P)
    return extend_tokens(inputs, completion_ids, torch.cat([mask, completion_mask.to(mask.dtype)], dim=1))


def prompt_positions(model: torch.nn.Module, prompt: dict[str, torch.Tensor]) -> torch.Tensor:
    """Position ids of left-padded prompts, exactly as `generate` makes them.

    (B, P) for 1-D rope; Qwen-VL gives (4, B, P): text positions, then temporal/height/width.
    """
    inner = hf_model(model)
    return inner._prepare_position_ids_for_generation(prompt["input_ids"], dict(prompt))


def following_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """Positions of `length` text tokens after the prompts: last prompt position + 1, + 2, ...

    positions (..., B, P) -> (..., B, length); left padding puts every prompt's last token last.
    """
    steps = torch.arange(1, length + 1, device=positions.device, dtype=positions.dtype)  # (length,)
    return positions[..., -1:] + steps
