"""Generation from one prefill per prompt: the image and the prompt computed once per group.

The vision encoder and the prefill run once per unique prompt (all prompt tokens but the last);
the KV cache is repeated G times along the batch and Hugging Face `generate` continues from it
with its usual logits processors, so the sampling distribution is that of the plain way, where
every prompt is repeated G times (tests/test_speedups.py). The last prompt token is the only
prompt work done G times: `generate` needs one new token to start from.
"""

from __future__ import annotations

import torch

from vlmrl.models.support import CACHE_KEY, hf_model, takes_logits_to_keep
from vlmrl.models.token_inputs import per_token_keys, prompt_positions
from vlmrl.rollout.prompts import image_token_id


def last_prompt_token_is_text(model, processor, prompt: dict[str, torch.Tensor]) -> bool:
    """The prefill leaves the last prompt token to `generate`; it must not be an image placeholder."""
    last = prompt["input_ids"][:, -1]  # (B,)
    return not bool((last == image_token_id(processor, hf_model(model).config)).any())


@torch.no_grad()
def prefill_once(model, prompt: dict[str, torch.Tensor], group: int) -> dict[str, object]:
    """Run the vision encoder and all prompt tokens but the last once per prompt, then repeat the KV
    cache `group` times. Returns the keyword arguments for `generate` on the B * G rows (row i
    answers prompt i // G): input_ids, attention_mask, position_ids and the cache (CACHE_KEY)."""
    positions = prompt_positions(model, prompt)  # (..., B, P)
    along = per_token_keys(prompt)
    all_but_last = {k: (v[:, :-1] if k in along else v) for k, v in prompt.items()}  # (B, P-1) per token
    extra = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    out = model(**all_but_last, position_ids=positions[..., :-1], use_cache=True, **extra)
    cache = out[CACHE_KEY]
    cache.batch_repeat_interleave(group)
    batch_dim = positions.dim() - 2
    return {
        "input_ids": prompt["input_ids"].repeat_interleave(group, dim=0),  # (B*G, P)
        "attention_mask": prompt["attention_mask"].repeat_interleave(group, dim=0),  # (B*G, P)
        "position_ids": positions.repeat_interleave(group, dim=batch_dim),  # (..., B*G, P)
        CACHE_KEY: cache,
    }
