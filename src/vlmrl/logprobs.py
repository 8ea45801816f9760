"""Per-token log-probs of completions under a model: the training forward pass.

The prompt inputs are rebuilt with the processor, then the completion tokens are appended.
Processor outputs that run along the prompt tokens (input_ids, attention_mask, token-type ids of
any name) are extended over the completion; everything else (pixel values, image grids) passes
through untouched. No per-architecture code.

Two speedups, both on by default and exact (tests/test_shared_prefix.py):
- shared prefix: rows that answer the same prompt (the same Example object, as a group's rows
  are) are packed with that prompt into one sequence, so the image and prompt are computed once
  per group (`vlmrl.shared_prefix.pack_groups`);
- chunked output layer: the log-softmax over the vocabulary is taken `chunk` positions at a time
  from the final hidden states, so full-vocabulary logits never exist for the whole batch.
"""

from __future__ import annotations

import torch

from vlmrl.rollout import encode_prompts
from vlmrl.shared_prefix import (group_rows, head_unchunkable, logprobs_at, packed_logprobs, packing_unsupported,
                                 warn_once)
from vlmrl.tasks import Example


def join_prompt_and_completion(inputs: dict[str, torch.Tensor], completion_ids: torch.Tensor,
                               completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Model inputs for prompt + completion.

    inputs: processor outputs for N left-padded prompts (input_ids (N, P), ...);
    completion_ids, completion_mask: (N, T).
    """
    prompt_ids = inputs["input_ids"]  # (N, P)
    joined = {}
    for key, value in inputs.items():
        if key == "input_ids":
            joined[key] = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P+T)
        elif key == "attention_mask":
            joined[key] = torch.cat([value, completion_mask.to(value.dtype)], dim=1)  # (N, P+T)
        elif torch.is_tensor(value) and value.shape[:2] == prompt_ids.shape:
            # Per-token side inputs (e.g. mm_token_type_ids): completion tokens are plain text (0).
            joined[key] = torch.cat([value, value.new_zeros(completion_ids.shape)], dim=1)
        else:
            joined[key] = value
    return joined


def completion_logprobs(model, processor, rows: list[Example], completion_ids: torch.Tensor,
                        completion_mask: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False, shared_prefix: bool = True,
                        chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, T) of the completion tokens, and optionally the entropy (N, T) of each step.

    Logits are divided by the sampling temperature so that the log-probs match the sampling
    policy's. Masked positions hold 0. `shared_prefix`: compute each distinct prompt once (when
    some rows share one and the model family supports it). `chunk`: positions per output-layer
    chunk (0 = all logits at once).
    """
    device = completion_ids.device
    pad_id = processor.tokenizer.pad_token_id
    groups = group_rows(rows)
    if shared_prefix and len(groups) < len(rows):
        reason = packing_unsupported(model) or head_unchunkable(model)
        if reason is None:
            prompt = encode_prompts(processor, [rows[g[0]] for g in groups], device)  # (U, P)
            return packed_logprobs(model, prompt, groups, completion_ids, completion_mask, pad_id, temperature,
                                   chunk, with_entropy)
        warn_once(f"vlmrl: shared-prefix log-probs off ({reason}); every prompt is repeated per completion")
    inputs = join_prompt_and_completion(encode_prompts(processor, rows, device),
                                        completion_ids, completion_mask)
    length = completion_ids.shape[1]  # T
    if chunk > 0 and head_unchunkable(model) is None:
        total = inputs["input_ids"].shape[1]  # P + T
        before = torch.arange(total - length - 1, total - 1, device=device)  # (T,) P-1 .. P+T-2
        index = torch.arange(len(rows), device=device)[:, None] * total + before  # (N, T) flat positions
        return logprobs_at(model, inputs, index, completion_ids, completion_mask, temperature, chunk,
                           with_entropy)
    # The logits at positions P-1 .. P+T-2 predict the T completion tokens.
    logits = model(**inputs, logits_to_keep=length + 1, use_cache=False).logits[:, :-1]  # (N, T, V)
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)  # (N, T, V)
    token_logprobs = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # (N, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1) * completion_mask  # (N, T)
    return token_logprobs * completion_mask, entropy
