"""Grouped generation: G sampled completions for each prompt (image + question).

`generate_groups` samples G completions per prompt with Hugging Face `generate` on the policy
itself and returns a `Rollout`: completion ids and masks, texts, and which rows were cut off.
Completions end at the first end-of-turn token, which is kept (the model must learn to stop).
By default each image is encoded and each prompt prefilled once per group, and the KV cache is
shared by its G samples (prefill.py); with `share_prompt_cache=False`, or for a model family not
checked for it, every prompt is repeated G times in the batch, as TRL does. The KV cache grows
or is static, and the decode step eager or compiled, as `settings.decode` says (decoding.py).
The shared prefill and the static or compiled decode are fast paths: an error on their first use
switches the run to the plain way (repeated prompts, the dynamic cache) with a warning
(fast_paths.py).

Nothing here keeps the logits of every step: `generate` returns the sampled ids, and the sampler's
log-prob of each (sampling.py: one step's distribution held at a time), which the loss compares
with the training pass's (logprobs.py) to correct the rollout/training mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from vlmrl.config import GenerationSettings
from vlmrl.models.fast_paths import first_use
from vlmrl.models.support import shared_prefill_unsupported, warn_once
from vlmrl.rollout.completions import Completions, pad_right
from vlmrl.rollout.decode_loop import sample_loop
from vlmrl.rollout.decoding import decode_kwargs, decode_mode, grouped_decode_attention
from vlmrl.rollout.prefill import last_prompt_token_is_text, prefill_once
from vlmrl.rollout.prompts import Encoded, encode_prompts
from vlmrl.rollout.sampling import SampledLogprobs, note_broken_rows, sampling_kwargs
from vlmrl.tasks import Example


@dataclass
class Rollout(Completions):
    """N = B*G sampled completions; rows of one prompt are contiguous."""

    texts: list[str]  # (N,) decoded completions, special tokens dropped
    truncated: torch.Tensor  # (N,) True where no stop token came within max_new_tokens
    sampler_logp: torch.Tensor | None = None  # (N, T) the sampler's log-probs (0 off the mask); None: greedy

    def select(self, index: list[int]) -> Rollout:
        """The rows `index`, in that order (the same kind of rollout: a subclass's own fields are
        selected by its own `select`)."""
        part = Completions.select(self, index)
        at = torch.tensor(index, dtype=torch.long, device=self.truncated.device)
        sampler = None if self.sampler_logp is None else self.sampler_logp[at.to(self.sampler_logp.device)]
        return replace(self, rows=part.rows, completion_ids=part.completion_ids, completion_mask=part.completion_mask,
                       texts=[self.texts[i] for i in index], truncated=self.truncated[at], sampler_logp=sampler)

    @staticmethod
    def concat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Rows of all parts, completions right-padded to the longest."""
        length = max(p.completion_ids.shape[1] for p in parts)
        recorded = all(p.sampler_logp is not None for p in parts)
        return Rollout(
            rows=[r for p in parts for r in p.rows],
            completion_ids=torch.cat([pad_right(p.completion_ids, length, pad_id) for p in parts]),
            completion_mask=torch.cat([pad_right(p.completion_mask, length, 0) for p in parts]),
            texts=[t for p in parts for t in p.texts],
            truncated=torch.cat([p.truncated for p in parts]),
            sampler_logp=torch.cat([pad_right(p.sampler_logp, length, 0.0) for p in parts]) if recorded else None,
        )

    def base_fields(self) -> dict:
        """This rollout's Rollout fields by name (what a subclass adds its own to)."""
        return {f.name: getattr(self, f.name) for f in fields(Rollout)}


def stop_token_ids(processor, model) -> list[int]:
    """Ids that end a completion: the tokenizer's EOS and the generation config's."""
    ids = {processor.tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def suppressed_token_ids(processor, stop_ids: list[int]) -> list[int]:
    """Special tokens a completion must never contain (image placeholders, padding, turn starts).

    A sampled image placeholder would break the next forward pass (more image tokens than image
    features), so every special token except the stop tokens is banned from sampling.
    """
    added = processor.tokenizer.added_tokens_decoder  # id -> AddedToken
    return sorted(i for i, token in added.items() if token.special and i not in stop_ids)


def completion_mask(ids: torch.Tensor, stop_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first stop token, and which rows never stopped.

    ids (N, T) -> mask (N, T) long, truncated (N,) bool.
    """
    is_stop = torch.isin(ids, torch.tensor(stop_ids, device=ids.device))  # (N, T)
    stopped = is_stop.any(-1)  # (N,)
    first_stop = torch.where(stopped, is_stop.float().argmax(-1), ids.shape[1] - 1)  # (N,)
    positions = torch.arange(ids.shape[1], device=ids.device)  # (T,)
    mask = (positions[None, :] <= first_stop[:, None]).long()  # (N, T)
    return mask, ~stopped


def generation_inputs(model, processor, examples: list[Example], settings: GenerationSettings) -> dict:
    """What `generate` starts from for G rows per example: the prompts' KV cache computed once per
    example and repeated (when the model supports it), or every prompt repeated G times. `examples`
    may come `Encoded` already (prompts.py): the shared prompt is then that encoding, not the processor's again."""
    device = next(model.parameters()).device
    group = settings.group_size
    if settings.share_prompt_cache and group > 1:
        prompt = ({key: value.to(device) for key, value in examples.prompt.items()} if isinstance(examples, Encoded)
                  else encode_prompts(processor, examples, device, settings.max_prompt_length))  # (B, P) each
        reason = shared_prefill_unsupported(model) or (
            None if last_prompt_token_is_text(model, processor, prompt) else "a prompt ends with an image token")
        if reason is None:
            return first_use(model, "shared_prefill", lambda: prefill_once(model, prompt, group),  # (N, P), cache
                             lambda: repeated_prompts(processor, examples, settings, device))
        warn_once(f"vlmrl: shared prompt cache off ({reason}); every prompt is repeated {group} times")
    return repeated_prompts(processor, examples, settings, device)


def repeated_prompts(processor, examples: list[Example], settings: GenerationSettings, device: torch.device) -> dict:
    """The plain way: every prompt encoded `settings.group_size` times, (B*G, P)."""
    return encode_prompts(processor, [example for example in examples for _ in range(settings.group_size)], device,
                          settings.max_prompt_length)


def sample(model, processor, inputs: dict, settings: GenerationSettings,
           suppressed: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`generate` from `inputs` (the prompt's tensors, and any further stop arguments) on the
    settings' decode path and sampling, never picking a `suppressed` token. Returns the new ids
    (N, T), up to settings.max_new_tokens, and the sampler's log-probs of them (N, T), None when
    greedy. A static or compiled decode that fails on its first use falls back to the dynamic cache."""
    mode = decode_mode(model, settings.decode)
    if mode == "dynamic":
        return sample_on(model, processor, inputs, settings, suppressed)
    dynamic = replace(settings, decode="dynamic")
    return first_use(model, f"{mode}_decode", lambda: sample_on(model, processor, inputs, settings, suppressed),
                     lambda: sample_on(model, processor, inputs, dynamic, suppressed))


def sample_on(model, processor, inputs: dict, settings: GenerationSettings,
              suppressed: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample` on the decode path `settings.decode` as it is, without a fallback."""
    inputs = inputs | decode_kwargs(model, inputs, settings.decode, settings.max_new_tokens)
    recorder = SampledLogprobs(settings.temperature, suppressed)
    # synced_gpus: transformers makes every process step until all finish when the model is sharded
    # (FSDP2), as per-layer gathers need; a sharded model gathered whole around the call
    # (training/sharding.py) needs none, so each process generates alone, as long as its rows need.
    # One process decoding alone runs decode_loop's loop (no host sync per token); a sharded one, transformers'.
    synced = None if any(hasattr(p, "to_local") for p in model.parameters()) else False  # None: transformers decides
    loop = {"custom_generate": sample_loop} if synced is False else {"synced_gpus": synced}
    with grouped_decode_attention(model):  # one query token never repeats the cache's keys (grouped_attention.py)
        out = model.generate(**inputs, max_new_tokens=settings.max_new_tokens, **loop,
                             eos_token_id=stop_token_ids(processor, model), pad_token_id=processor.tokenizer.pad_token_id,
                             use_cache=True, return_dict_in_generate=False, **sampling_kwargs(settings, recorder))
    ids = out[:, inputs["input_ids"].shape[1]:]  # (N, T)
    note_broken_rows(model, recorder.broken_rows())  # one host sync per call; the caller stops on it
    return ids, recorder.logprobs(ids)


@torch.no_grad()
def generate_groups(model, processor, examples: list[Example], settings: GenerationSettings,
                    seed: int | None = None) -> Rollout:
    """Sample `settings.group_size` completions for each example (greedy when temperature is 0).

    Rows i*G .. i*G+G-1 answer example i. Same sampling distribution with or without the shared
    prompt cache. With `seed`, sampling is reproducible for this batch alone.
    """
    stop_ids = stop_token_ids(processor, model)
    inputs = generation_inputs(model, processor, examples, settings)
    if seed is not None:
        torch.manual_seed(seed)
    ids, sampler_logp = sample(model, processor, inputs, settings, suppressed_token_ids(processor, stop_ids))
    mask, truncated = completion_mask(ids, stop_ids)  # (N, T), (N,)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, processor.tokenizer.pad_token_id))
    texts = processor.batch_decode(ids, skip_special_tokens=True)
    rows = [example for example in examples for _ in range(settings.group_size)]
    return Rollout(rows, ids, mask, texts=[t.strip() for t in texts], truncated=truncated,
                   sampler_logp=None if sampler_logp is None else sampler_logp * mask)
