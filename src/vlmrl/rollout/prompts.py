"""How task examples become model inputs: the chat turn, the processor call, the image token.

Everything goes through the model's own chat template and processor, so any image-text-to-text
family works without per-architecture code. Generation (generation.py), log-probs (logprobs.py),
preflight and the attention maps all build their prompts here, so they see the same tokens.

Processor outputs that are not model inputs (`NOT_MODEL_INPUTS`: PaliGemma's processor always
returns `labels`, with which the forward computes a loss against the prompt) are dropped by
`model_inputs`, which every processor call that feeds the model goes through.
"""

from __future__ import annotations

import torch

from vlmrl.errors import VlmrlError
from vlmrl.tasks import Example


IMAGE_MARKER = "<image>"
"""Where a prompt places an image (EasyR1's, verl's and OpenRLHF's marker); one per image, else unused."""


def chat_messages(example: Example) -> list[dict]:
    """The system turn (when the example has one) and the user turn: each image at its `<image>`
    marker when the prompt has exactly one per image, else the images in order, then the question."""
    pieces = example.prompt.split(IMAGE_MARKER)
    if example.images and len(pieces) == len(example.images) + 1:
        content = []
        for text, _ in zip(pieces, example.images):
            content += ([{"type": "text", "text": text}] if text else []) + [{"type": "image"}]
        content += [{"type": "text", "text": pieces[-1]}] if pieces[-1] else []
    else:
        content = [*({"type": "image"} for _ in example.images), {"type": "text", "text": example.prompt}]
    system = [{"role": "system", "content": [{"type": "text", "text": example.system}]}] if example.system else []
    return [*system, {"role": "user", "content": content}]


NOT_MODEL_INPUTS = frozenset({"labels"})
"""Processor outputs the model must not be given: with `labels` its forward computes a loss (and fails
when the inputs are longer than the labels, as prompt + completion are)."""


def model_inputs(batch) -> dict[str, torch.Tensor]:
    """A processor's outputs (a `BatchFeature` or dict) without those that are not model inputs."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def encode_prompts(processor, examples: list[Example], device: torch.device) -> dict[str, torch.Tensor]:
    """Processor inputs (input_ids, attention_mask, pixel values, grids...) for a batch of examples,
    left-padded, each ending with the generation prompt; no `NOT_MODEL_INPUTS`."""
    texts = [processor.apply_chat_template(chat_messages(ex), add_generation_prompt=True, tokenize=False)
             for ex in examples]
    images = [list(ex.images) for ex in examples]
    batch = processor(images=images, text=texts, return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in model_inputs(batch).items()}


def image_token_id(processor, model_config=None) -> int:
    """Id of the image placeholder token: from the model config when given, else the processor.

    VlmrlError when neither names one (the model is not an image-text-to-text model).
    """
    candidates = []
    if model_config is not None:
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else None
        candidates += [getattr(model_config, "image_token_id", None), getattr(model_config, "image_token_index", None),
                       getattr(text_config, "image_token_id", None)]
    candidates.append(getattr(processor, "image_token_id", None))
    for value in candidates:
        if isinstance(value, int):
            return value
    token = getattr(processor, "image_token", None)
    if isinstance(token, str):
        found = processor.tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != processor.tokenizer.unk_token_id:
            return found
    raise VlmrlError("the model has no image token (no image_token_id in its config or processor): "
                     "it is not an image-text-to-text model")
