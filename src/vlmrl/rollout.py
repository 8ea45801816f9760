"""Grouped generation: G sampled completions for each prompt (image + question).

`encode_prompts` turns task examples into model inputs through the model's own chat template and
processor, so any image-text-to-text family works without per-architecture code. `generate_groups`
samples G completions per prompt with Hugging Face `generate` and returns everything the trainer
needs: completion ids and masks, the sampling policy's per-token log-probs, texts and group ids.
Completions end at the first end-of-turn token, which is kept (the model must learn to stop).
By default each image is encoded and each prompt prefilled once per group, and the KV cache is
shared by its G samples (`vlmrl.shared_prefix`); with `shared_prefill=False`, or for a model
family not checked for it, every prompt is repeated G times in the batch, as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmrl.shared_prefix import last_prompt_token_is_text, prefill_shared, prefill_unsupported, warn_once
from vlmrl.tasks import Example


@dataclass
class GenerationSettings:
    """How completions are sampled."""

    group_size: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0  # > 0 forces length (benchmarks)
    greedy: bool = False
    shared_prefill: bool = True  # image encoded and prompt prefilled once per group, KV cache shared


@dataclass
class Rollout:
    """N = B*G completions; row i answers `rows[i]`, and rows of one prompt are contiguous."""

    rows: list[Example]  # (N,) the example each completion answers
    completion_ids: torch.Tensor  # (N, T) right-padded with the pad token
    completion_mask: torch.Tensor  # (N, T) 1 on completion tokens, EOS included
    logprobs: torch.Tensor  # (N, T) log-prob of each sampled token under the sampling policy
    texts: list[str]  # (N,) decoded completions, special tokens dropped
    truncated: torch.Tensor  # (N,) True where no EOS came within max_new_tokens

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)  # (N,)

    def select(self, index: list[int]) -> Rollout:
        """The rows `index`, in that order."""
        at = torch.tensor(index, dtype=torch.long, device=self.completion_ids.device)
        return Rollout(rows=[self.rows[i] for i in index], completion_ids=self.completion_ids[at],
                       completion_mask=self.completion_mask[at], logprobs=self.logprobs[at],
                       texts=[self.texts[i] for i in index], truncated=self.truncated[at])

    @staticmethod
    def concat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Rows of all parts, completions right-padded to the longest."""
        length = max(p.completion_ids.shape[1] for p in parts)

        def pad(x: torch.Tensor, value) -> torch.Tensor:  # (n, t) -> (n, length)
            return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)

        return Rollout(
            rows=[r for p in parts for r in p.rows],
            completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
            completion_mask=torch.cat([pad(p.completion_mask, 0) for p in parts]),
            logprobs=torch.cat([pad(p.logprobs, 0.0) for p in parts]),
            texts=[t for p in parts for t in p.texts],
            truncated=torch.cat([p.truncated for p in parts]),
        )


def chat_messages(example: Example) -> list[dict]:
    """The user turn: the image, then the task's question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": example.prompt}]}]


def encode_prompts(processor, examples: list[Example], device: torch.device) -> dict[str, torch.Tensor]:
    """Processor inputs (input_ids, attention_mask, pixel values, grids...) for a batch of examples."""
    texts = [processor.apply_chat_template(chat_messages(ex), add_generation_prompt=True, tokenize=False)
             for ex in examples]
    images = [[ex.image] for ex in examples]
    batch = processor(images=images, text=texts, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in batch.items()}


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


@torch.no_grad()
def generate_groups(model, processor, examples: list[Example], settings: GenerationSettings,
                    seed: int | None = None) -> Rollout:
    """Sample `settings.group_size` completions for each example.

    Rows i*G .. i*G+G-1 answer example i. With `shared_prefill`, the vision encoder and the prefill
    run once per example and `generate` continues G samples from the repeated KV cache; otherwise
    each prompt is repeated G times in the batch. Same sampling distribution either way. With
    `seed`, sampling is reproducible for this batch alone.
    """
    device = next(model.parameters()).device
    group = settings.group_size
    rows = [example for example in examples for _ in range(group)]
    inputs = None
    if settings.shared_prefill and group > 1:
        prompt = encode_prompts(processor, examples, device)
        reason = prefill_unsupported(model) or (
            None if last_prompt_token_is_text(model, prompt) else "a prompt ends with an image token")
        if reason is None:
            inputs = prefill_shared(model, prompt, group)  # input_ids (N, P), cache of P - 1 tokens, ...
        else:
            warn_once(f"vlmrl: shared prefill off ({reason}); every prompt is repeated {group} times")
    if inputs is None:
        inputs = encode_prompts(processor, rows, device)
    stop_ids = stop_token_ids(processor, model)
    sampling = {"do_sample": False} if settings.greedy else {
        "do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        **inputs,
        max_new_tokens=settings.max_new_tokens,
        min_new_tokens=settings.min_new_tokens or None,
        eos_token_id=stop_ids,
        suppress_tokens=suppressed_token_ids(processor, stop_ids),
        pad_token_id=processor.tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
        use_cache=True,
        **sampling,
    )
    prompt_len = inputs["input_ids"].shape[1]
    ids = out.sequences[:, prompt_len:]  # (N, T)
    mask, truncated = completion_mask(ids, stop_ids)  # (N, T), (N,)
    temperature = 1.0 if settings.greedy else settings.temperature
    logprobs = torch.stack([  # one step's (N, V) logits at a time
        torch.log_softmax(step.float() / temperature, -1).gather(-1, ids[:, t, None]).squeeze(-1)
        for t, step in enumerate(out.logits)], dim=1)  # (N, T)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, processor.tokenizer.pad_token_id))
    texts = processor.batch_decode(ids, skip_special_tokens=True)
    return Rollout(rows=rows, completion_ids=ids, completion_mask=mask, logprobs=logprobs * mask,
                   texts=[t.strip() for t in texts], truncated=truncated)
