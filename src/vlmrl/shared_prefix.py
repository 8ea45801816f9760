"""Each prompt (image + question) computed once per group, not once per completion.

In GRPO every prompt is answered G times, and its image (hundreds of tokens) dominates the
sequence. Repeating it G times in generation and in every log-prob pass wastes most of the work.
Here it runs once:

- Generation (`generate_shared`): the vision encoder and the prefill run once per unique prompt
  (all prompt tokens but the last); the KV cache is repeated G times along the batch and Hugging
  Face `generate` continues from it with the usual logits processors, so the sampling distribution
  is that of the plain way. The last prompt token is the only prompt work done G times.
- Log-probs (`packed_logprobs`, for the policy, old and reference passes): each unique prompt and
  its completions are packed into one sequence [prompt, completion 1, ..., completion k] under a
  block attention mask: a completion sees the prompt and its own earlier tokens, nothing else. Its
  positions continue from the prompt's last one (for Qwen-VL the 3-D rope positions, which come from
  the model's own `_prepare_position_ids_for_generation`, as in `generate`). One forward and one
  backward: the gradients are exact, and gradient checkpointing works unchanged.
- The output layer runs in chunks of positions (`chunked_head`): log-softmax and gather per chunk,
  recomputed in backward, so full-vocabulary logits never exist for the whole batch at once.

Families checked to match the plain forward (tests/test_shared_prefix.py) are listed in
`SHARED_PREFIX_MODEL_TYPES`; other models, or attention kernels that take no arbitrary mask (flash
attention), use the plain path, and say so once.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from vlmrl.tasks import Example

# Model types checked (tests/test_shared_prefix.py) to take explicit position ids from
# `_prepare_position_ids_for_generation`, a DynamicCache repeated along the batch, and a 4-D
# additive attention mask. Others use the plain path.
SHARED_PREFIX_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "idefics3", "smolvlm")
MASKABLE_ATTENTION = ("eager", "sdpa")

_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP / DeepSpeed / compile and peft wrappers."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def prefill_unsupported(model: torch.nn.Module) -> str | None:
    """Why generation cannot share one prefill among a group's samples, or None when it can."""
    kind = hf_model(model).config.model_type
    if kind not in SHARED_PREFIX_MODEL_TYPES:
        return f"model type {kind!r} is not one of {', '.join(SHARED_PREFIX_MODEL_TYPES)}"
    return None


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why the packed forward cannot be used for `model`, or None when it can."""
    if (reason := prefill_unsupported(model)) is not None:
        return reason
    attention = hf_model(model).config.get_text_config()._attn_implementation
    if attention not in MASKABLE_ATTENTION:
        return f"attention kernel {attention!r} takes no block mask (use eager or sdpa)"
    return None


def head_unchunkable(model: torch.nn.Module) -> str | None:
    """Why log-probs cannot be read from the output layer's input in chunks, or None."""
    inner = hf_model(model)
    text = inner.config.get_text_config()
    if getattr(text, "final_logit_softcapping", None) or getattr(inner.config, "final_logit_softcapping", None):
        return "the model soft-caps its logits after the output layer"
    if inner.get_output_embeddings() is None:
        return "the model has no output embeddings module"
    return None


# --------------------------------------------------------------------------- positions


def per_token_keys(inputs: dict[str, torch.Tensor]) -> list[str]:
    """Processor outputs that run along the prompt tokens (input_ids, attention_mask, type ids)."""
    shape = inputs["input_ids"].shape
    return [k for k, v in inputs.items() if torch.is_tensor(v) and v.shape[:2] == shape]


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


# --------------------------------------------------------------------------- output layer in chunks


def chunked_head(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                 chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (M,) of each target under softmax(head(hidden) / temperature), and the entropy (M,).

    hidden (M, H), targets (M,). At most `chunk` rows of logits exist at a time (0 = all at once);
    under autograd each chunk is recomputed in backward instead of keeping its logits.
    """
    def one(h: torch.Tensor, ids: torch.Tensor):
        logits = head.forward(h).float() / temperature  # (m, V)
        log_probs = torch.log_softmax(logits, dim=-1)  # (m, V)
        picked = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (m,)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = -(log_probs.exp() * log_probs).sum(-1)  # (m,)
        return picked, entropy

    size = chunk if chunk > 0 else max(len(targets), 1)
    parts = []
    for start in range(0, len(targets), size):
        h, ids = hidden[start:start + size], targets[start:start + size]
        if torch.is_grad_enabled() and h.requires_grad and chunk > 0:
            parts.append(checkpoint(one, h, ids, use_reentrant=False))
        else:
            parts.append(one(h, ids))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp = torch.cat([p for p, _ in parts])  # (M,)
    entropy = torch.cat([e for _, e in parts]) if with_entropy else None  # (M,)
    return logp, entropy


@contextlib.contextmanager
def tapped_head(model: torch.nn.Module, compute: Callable[[torch.nn.Module, torch.Tensor], object]):
    """Within: the output layer hands its input (B, L, H) to `compute(head, hidden)` and computes no
    logits itself (it gets zero positions). The result lands in the yielded dict under "value".

    The work happens inside the model's forward, so wrappers that gather sharded weights around
    the forward (FSDP, DeepSpeed ZeRO-3) see an ordinary call.
    """
    head = hf_model(model).get_output_embeddings()
    result: dict[str, object] = {}

    def hook(module, args):
        (hidden,) = args
        result["value"] = compute(module, hidden)
        return (hidden[:, :0],)

    handle = head.register_forward_pre_hook(hook)
    try:
        yield result
    finally:
        handle.remove()


# --------------------------------------------------------------------------- packed log-probs


def group_rows(rows: list[Example]) -> list[list[int]]:
    """Row indices of each unique prompt (the same Example object), in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, example in enumerate(rows):
        groups.setdefault(id(example), []).append(i)
    return list(groups.values())


def pack_groups(model, prompt: dict[str, torch.Tensor], groups: list[list[int]], completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, pad_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Model inputs of U packed sequences [prompt, completion slot 0, ..., slot K-1], and, for every
    completion token, the flat position (into U * L) whose output predicts it.

    prompt: processor outputs for the U unique prompts (input_ids (U, P), left-padded);
    completion_ids, completion_mask: (n, T); groups[u] lists the rows answering prompt u.
    Returns inputs (input_ids (U, L), 4-D additive attention_mask (U, 1, L, L), position_ids, pixel
    inputs untouched) and index (n, T), with L = P + K * T.
    """
    device = completion_ids.device
    length = completion_ids.shape[1]  # T
    prompt_ids, prompt_mask = prompt["input_ids"], prompt["attention_mask"]  # (U, P) each
    units, width = prompt_ids.shape  # U, P
    slots = max(len(g) for g in groups)  # K
    total = width + slots * length  # L
    pack = torch.tensor([u for u, g in enumerate(groups) for _ in g], device=device)  # (n,) in group order
    slot = torch.tensor([k for g in groups for k in range(len(g))], device=device)  # (n,)
    order = torch.tensor([r for g in groups for r in g], device=device)  # (n,) row of each entry

    ids = completion_ids.new_full((units, slots, length), pad_id)  # (U, K, T)
    ids[pack, slot] = completion_ids[order]
    mask = completion_mask.new_zeros((units, slots, length))  # (U, K, T)
    mask[pack, slot] = completion_mask[order]

    # Block mask: a query sees valid keys at or before it, in the prompt or in its own slot.
    segment = torch.cat([torch.full((width,), -1, device=device),
                         torch.arange(slots, device=device).repeat_interleave(length)])  # (L,)
    same_block = (segment[None, :] == -1) | (segment[None, :] == segment[:, None])  # (L, L) [query, key]
    causal = torch.ones(total, total, dtype=torch.bool, device=device).tril()  # (L, L)
    key_valid = torch.cat([prompt_mask, mask.view(units, -1)], dim=1).bool()  # (U, L)
    allowed = (causal & same_block)[None] & key_valid[:, None, :]  # (U, L, L)
    allowed |= torch.eye(total, dtype=torch.bool, device=device)  # padding rows see themselves: no NaN
    dtype = hf_model(model).dtype
    attention = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]  # (U, 1, L, L)

    positions = prompt_positions(model, prompt)  # (..., U, P)
    after = following_positions(positions, length).repeat(*([1] * (positions.dim() - 1)), slots)  # (..., U, K*T)

    inputs = {}
    for key, value in prompt.items():
        if key == "input_ids":
            inputs[key] = torch.cat([prompt_ids, ids.view(units, -1)], dim=1)  # (U, L)
        elif key == "attention_mask":
            inputs[key] = attention
        elif key in per_token_keys(prompt):  # e.g. mm_token_type_ids: completions are text (0)
            inputs[key] = torch.cat([value, value.new_zeros(units, slots * length)], dim=1)  # (U, L)
        else:
            inputs[key] = value
    inputs["position_ids"] = torch.cat([positions, after], dim=-1)  # (..., U, L)

    # Token t of the completion in slot k is predicted by position P - 1 (t = 0) or P + k*T + t - 1.
    steps = torch.arange(length, device=device)  # (T,)
    where = width + slot[:, None] * length + steps[None, :] - 1  # (n, T) in group order
    where[:, 0] = width - 1
    index = torch.empty_like(where)
    index[order] = pack[:, None] * total + where  # (n, T) back in row order
    return inputs, index


def packed_logprobs(model, prompt: dict[str, torch.Tensor], groups: list[list[int]], completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor, pad_id: int, temperature: float, chunk: int,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (n, T) of the completion tokens, and optionally entropies (n, T), from one packed
    forward over the unique prompts. Masked positions hold 0."""
    inputs, index = pack_groups(model, prompt, groups, completion_ids, completion_mask, pad_id)
    return logprobs_at(model, inputs, index, completion_ids, completion_mask, temperature, chunk, with_entropy)


def logprobs_at(model, inputs: dict[str, torch.Tensor], index: torch.Tensor, completion_ids: torch.Tensor,
                completion_mask: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of `inputs`; the output layer reads only the positions `index` (n, T), flat into
    (B * L), each predicting the completion token at the same place of `completion_ids` (n, T)."""
    def compute(head, hidden):  # hidden (B, L, H)
        picked = hidden.reshape(-1, hidden.shape[-1])[index.reshape(-1)]  # (n*T, H)
        return chunked_head(head, picked, completion_ids.reshape(-1), temperature, chunk, with_entropy)

    with tapped_head(model, compute) as result:
        model(**inputs, use_cache=False)
    logp, entropy = result["value"]
    mask = completion_mask.to(logp.dtype)
    logp = logp.view_as(mask) * mask  # (n, T)
    if entropy is not None:
        entropy = entropy.view_as(mask) * mask  # (n, T)
    return logp, entropy


# --------------------------------------------------------------------------- generation


def last_prompt_token_is_text(model, prompt: dict[str, torch.Tensor]) -> bool:
    """The prefill leaves the last prompt token to `generate`; it must not be an image placeholder."""
    config = hf_model(model).config
    image_ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index", "video_token_id")}
    last = prompt["input_ids"][:, -1]  # (B,)
    return not any(i is not None and bool((last == i).any()) for i in image_ids)


def logits_to_keep_supported(model) -> bool:
    return "logits_to_keep" in inspect.signature(hf_model(model).forward).parameters


@torch.no_grad()
def prefill_shared(model, prompt: dict[str, torch.Tensor], group: int) -> dict[str, object]:
    """Run the vision encoder and all prompt tokens but the last once per prompt, then repeat the KV
    cache `group` times. Returns the keyword arguments for `generate` on the B * G rows (row i
    answers prompt i // G): input_ids, attention_mask, position_ids and past_key_values."""
    positions = prompt_positions(model, prompt)  # (..., B, P)
    along = per_token_keys(prompt)
    head = {k: (v[:, :-1] if k in along else v) for k, v in prompt.items()}  # all but the last token
    extra = {"logits_to_keep": 1} if logits_to_keep_supported(model) else {}
    out = model(**head, position_ids=positions[..., :-1], use_cache=True, **extra)
    cache = out.past_key_values
    cache.batch_repeat_interleave(group)
    batch_dim = positions.dim() - 2
    return {
        "input_ids": prompt["input_ids"].repeat_interleave(group, dim=0),  # (B*G, P)
        "attention_mask": prompt["attention_mask"].repeat_interleave(group, dim=0),  # (B*G, P)
        "position_ids": positions.repeat_interleave(group, dim=batch_dim),  # (..., B*G, P)
        "past_key_values": cache,
    }


@contextlib.contextmanager
def counting_vision_rows(model: torch.nn.Module):
    """Within: the yielded list holds, per call of the vision tower, the rows it was given (patches
    for Qwen-VL, images for Idefics3). For tests and benchmarks."""
    from vlmrl.models import VISION_MODULE_NAMES

    tower = next(m for name, m in hf_model(model).named_modules() if name.split(".")[-1] in VISION_MODULE_NAMES)
    calls: list[int] = []

    def hook(module, args, kwargs):
        first = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
        calls.append(int(first.shape[0]))

    handle = tower.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
