"""How many positions a model reads, and the one-line refusal of a generation that would go past them.

A model's config says the longest sequence it was built for: `max_position_embeddings` (of its text
config, for an image-text model). Past it a rotary model computes positions it never saw without a
word and writes text of no use, a learned position table fails with an index error deep in the
forward, and a static KV cache is allocated to the whole length first. The config bounds every length
far above any model (config.MAX_TOKENS); once the model is loaded, the preflight (`vlmrl train`, `sft`,
`check`), `vlmrl eval` and `vlmrl attention` hold the completion length to the model's own context.
"""

from __future__ import annotations

import torch

from vlmrl.errors import VlmrlError
from vlmrl.models.support import hf_model


def context_length(model: torch.nn.Module) -> int | None:
    """The positions the model reads (`max_position_embeddings` of its text config), or None where
    its config does not say."""
    config = hf_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = getattr(text, "max_position_embeddings", None)
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def check_generation_length(model: torch.nn.Module, name: str, new_tokens: int, prompt: int = 0,
                            prompts: str = "") -> None:
    """VlmrlError (one line) when `new_tokens` tokens (setting `name`) after a prompt of `prompt`
    tokens (the longest of `prompts`, e.g. "train") would pass the model's context."""
    context = context_length(model)
    if context is None or prompt + new_tokens <= context:
        return
    where = f" the model's context of {context} positions (max_position_embeddings in its config.json)"
    if prompt == 0:
        raise VlmrlError(f"{name}={new_tokens} is longer than{where}: set it to at most {context}")
    if prompt >= context:
        raise VlmrlError(f"the longest {prompts} prompt ({prompt} tokens) already fills{where}: use smaller "
                         "images or shorter questions")
    raise VlmrlError(f"{name}={new_tokens} after the longest {prompts} prompt ({prompt} tokens) would reach "
                     f"{prompt + new_tokens} positions, past{where}: set {name} to at most {context - prompt}")
