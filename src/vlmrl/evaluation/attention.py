"""How much the model looks at the image: the share of attention that completion tokens put on
image tokens.

The trainer logs `completion_image_attention` every `train.attention_every` steps, one float: a
policy that stops looking at the image shows it here first. `vlmrl attention` (attention_maps.py)
draws the same weights as heatmaps. Attention weights exist only in the eager implementation: the
model is switched to it for that one forward pass and back.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from vlmrl.errors import VlmrlError
from vlmrl.models.token_inputs import join_prompt_and_completion
from vlmrl.rollout.completions import Completions
from vlmrl.rollout.prompts import encode_prompts, image_token_id
from vlmrl.tasks import Example


def image_attention_share(attentions, input_ids: torch.Tensor, image_id: int,
                          query_mask: torch.Tensor, layer: int | None = None) -> float:
    """Mean share of attention that the masked queries put on image tokens (a float in [0, 1]).

    attentions: `outputs.attentions`, one (B, H, S, S) tensor per layer; input_ids: (B, S);
    query_mask: (B, S), 1 at the query positions to average over. layer: one layer (negative
    counts from the end), or None for the mean over all layers. Heads are averaged.
    """
    if not attentions:
        raise VlmrlError("the model returned no attention weights (load it with "
                         "attn_implementation='eager')")
    chosen = list(attentions) if layer is None else [attentions[resolve_layer(layer, len(attentions))]]
    keys = (input_ids == image_id)  # (B, S)
    queries = query_mask.bool()  # (B, S)
    if not keys.any() or not queries.any():
        return 0.0
    shares = []
    for weights in chosen:  # (B, H, S, S)
        on_image = weights @ keys.to(weights.dtype)[:, None, :, None]  # (B, H, S, 1)
        per_query = on_image.squeeze(-1).float().mean(1)  # (B, S) averaged over heads
        shares.append(per_query[queries].mean())
    return float(torch.stack(shares).mean().clamp(0.0, 1.0))


def resolve_layer(layer: int, n_layers: int) -> int:
    """`layer` as an index in 0..n_layers-1 (negative counts from the end), or a VlmrlError."""
    if not -n_layers <= layer < n_layers:
        raise VlmrlError(f"layer {layer} is out of range: the model has {n_layers} layers "
                         f"(use 0..{n_layers - 1} or -{n_layers}..-1)")
    return layer % n_layers


@contextmanager
def eager_attention(model):
    """Attention weights exist only in the eager implementation: switch to it, then back."""
    before = model.config._attn_implementation
    if before != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before != "eager":
            model.set_attn_implementation(before)


@torch.no_grad()
def attention_forward(model, processor, rows: list[Example], completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor):
    """One forward over prompts + completions with attention weights.

    Returns (attentions: one (N, H, S, S) per layer, inputs, query_mask (N, S)): query_mask marks
    the positions that produced the completion tokens, P-1 .. P+T-2 where completion_mask is 1.
    """
    device = completion_ids.device
    inputs = join_prompt_and_completion(encode_prompts(processor, rows, device),
                                        completion_ids, completion_mask)
    prompt_len = inputs["input_ids"].shape[1] - completion_ids.shape[1]  # P
    with eager_attention(model):
        out = model(**inputs, output_attentions=True, use_cache=False, logits_to_keep=1)
    query_mask = torch.zeros_like(inputs["input_ids"])  # (N, S)
    query_mask[:, prompt_len - 1:-1] = completion_mask
    return out.attentions, inputs, query_mask


@torch.no_grad()
def completion_image_attention(model, processor, completions: Completions, layer: int | None = None,
                               max_rows: int = 4) -> float:
    """Mean share of attention that completion tokens put on image tokens, for the trainer's log.

    Uses the first `max_rows` rows of `completions` (a Rollout, say): one extra forward pass with
    eager attention, all layers held at once, so keep `max_rows` small on a big model.
    layer=None averages over layers.
    """
    n = min(max_rows, len(completions.rows))
    mask = completions.completion_mask[:n]  # (n, T)
    length = max(int(mask.sum(-1).max()), 1)  # drop padding past the longest
    ids, mask = completions.completion_ids[:n, :length], mask[:, :length]  # (n, T')
    attentions, inputs, query_mask = attention_forward(model, processor, completions.rows[:n], ids, mask)
    return image_attention_share(attentions, inputs["input_ids"], image_token_id(processor, model.config),
                                 query_mask, layer=layer)


def image_grids(inputs: dict[str, torch.Tensor], processor, model, n_images: int,
                n_tokens: int) -> list[tuple[int, int]]:
    """(rows, cols) of each image's tokens, in order: from `image_grid_thw` over the merge size, else
    `n_tokens` split evenly into squares."""
    grid_thw = inputs.get("image_grid_thw")
    if grid_thw is not None and len(grid_thw) == n_images:
        merge = (getattr(processor.image_processor, "merge_size", None)
                 or getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", None) or 1)
        grids = [(int(t) * (int(h) // merge), int(w) // merge) for t, h, w in grid_thw]
        if sum(r * c for r, c in grids) == n_tokens:
            return grids
    side = math.isqrt(n_tokens // n_images)
    if n_tokens % n_images == 0 and side * side == n_tokens // n_images:
        return [(side, side)] * n_images
    raise VlmrlError(f"cannot tell the layout of the {n_tokens} image tokens of this model "
                     "(no image_grid_thw from the processor and not a square)")


def token_grid(inputs: dict[str, torch.Tensor], processor, model, n_tokens: int) -> tuple[int, int]:
    """(rows, cols) of the tokens of a prompt's single image (see `image_grids`)."""
    return image_grids(inputs, processor, model, 1, n_tokens)[0]
