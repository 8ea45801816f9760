"""Multi-turn trajectories as model inputs: the prompt, the model's turns and the tools' results.

A trajectory after the prompt is a list of `Segment`s: the model's sampled tokens (scored and
trained), and the text the chat template and a tool put between two model turns (context only:
the end of the model's turn, the tool's result as a user turn with its images and videos, the next
generation prompt; a tool's video is shown as a video where the family takes video, else as its
frames, each an image). A model turn is kept as the exact ids that were sampled, never re-tokenized;
a tool segment is tokenized alone by the processor (which expands its image placeholders), so the
ids of a whole trajectory are the prompt's, then each segment's, in order.

`encode_trajectories` turns a batch of them into the inputs of one forward (or of the next turn's
`generate`): input_ids left-padded, and the pixel inputs of every image and video of every
trajectory (the prompt's, then the tools', in order) from ONE processor call over the same texts,
so the layout of pixel inputs is the processor's own for any family (no per-architecture code). Qwen-VL's 3-D
rope positions are computed by the model from the ids and image grids, as for any prompt.

`pack_trajectories` (training/packing.py) computes each prompt (and its images) once per group in
the training forward: one sequence per prompt, [prompt, trajectory 1, trajectory 2, ...], under a
block attention mask, each trajectory's positions those it would have after its prompt alone
(Qwen-VL's 3-D rope from the model's own `_prepare_position_ids_for_generation`), exact against
one forward per trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL import Image

from vlmrl.models.token_inputs import per_token_keys
from vlmrl.models.video_processing import takes_video
from vlmrl.rollout.prompts import chat_messages, media_inputs, model_inputs, processor_inputs
from vlmrl.tasks import Example, Video

SENTINEL = "\u2063vlmrl-turn-end\u2063"
"""Stands for the model's turn while the chat template renders what follows it."""


@dataclass
class Segment:
    """A run of tokens after the prompt: the model's own, or context written by a tool/template."""

    ids: list[int]
    model: bool
    """True for tokens the model sampled (they get a loss); False for context."""
    logprobs: list[float] = field(default_factory=list)
    """Model segments of a rollout: the sampler's log-prob of each token (sampling.py); [] when not
    recorded (greedy decoding, reference turns)."""
    text: str = ""
    """Context segments: the template text, image placeholders unexpanded (for the pixel call)."""
    images: list[Image.Image] = field(default_factory=list)
    """Context segments: the images shown in it, in order."""
    videos: list[Video] = field(default_factory=list)
    """Context segments: the videos shown in it, in order."""
    extras: dict[str, list[int]] = field(default_factory=dict)
    """Context segments: the processor's other per-token inputs (e.g. mm_token_type_ids); the
    model's tokens are text (0)."""


def tool_turn(processor, example: Example, text: str, images: list[Image.Image],
              videos: list[Video] = ()) -> Segment:
    """The context after a model turn that ended in a tool call: the end of that turn, the tool's
    result (its videos, its `images`, then its `text`, inside <tool_response> tags) as a user turn,
    and the prompt of the next assistant turn, as the model's chat template writes them. A family
    that takes no video sees each video's frames as images, before the others."""
    if not takes_video(processor):
        images, videos = [frame for video in videos for frame in video.frames] + list(images), []
    media = [{"type": "video"} for _ in videos] + [{"type": "image"} for _ in images]
    result = {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *media,
                                          {"type": "text", "text": f"{text}\n</tool_response>"}]}
    turn = {"role": "assistant", "content": [{"type": "text", "text": SENTINEL}]}
    full = processor.apply_chat_template(chat_messages(example) + [turn, result], add_generation_prompt=True,
                                         tokenize=False)
    segment = full[full.index(SENTINEL) + len(SENTINEL):]
    encoded = model_inputs(processor(text=[segment], add_special_tokens=False, return_tensors="pt",
                                     **media_inputs(processor, [list(images)], list(videos))))
    extras = {k: encoded[k][0].tolist() for k in per_token_keys(encoded) if k not in ("input_ids", "attention_mask")}
    return Segment(ids=encoded["input_ids"][0].tolist(), model=False, text=segment, images=list(images),
                   videos=list(videos), extras=extras)


def prompt_text(processor, example: Example) -> str:
    """The prompt as the chat template writes it, generation prompt included."""
    return processor.apply_chat_template(chat_messages(example), add_generation_prompt=True, tokenize=False)


def encode_trajectories(processor, examples: list[Example], segments: list[list[Segment]],
                        device: torch.device) -> dict[str, torch.Tensor]:
    """Inputs of B prompts each followed by its segments, left-padded: input_ids (B, L),
    attention_mask (B, L), other per-token inputs (the prompt's, then each context segment's own,
    0 on the model's tokens), and the pixel inputs of every image of every row (prompt's, then the
    segments', in order)."""
    pixels = pixel_inputs(processor, examples, segments)
    prompts = [model_inputs(processor(text=[prompt_text(processor, ex)], return_tensors="pt",
                                      **processor_inputs(processor, [ex]))) for ex in examples]  # (1, P_i) each
    rows = [prompt["input_ids"][0].tolist() + [i for s in row for i in s.ids] for prompt, row in zip(prompts, segments)]
    length = max(len(r) for r in rows)  # L
    pad = processor.tokenizer.pad_token_id
    inputs = {"input_ids": torch.tensor([[pad] * (length - len(r)) + r for r in rows]),  # (B, L)
              "attention_mask": torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])}  # (B, L)
    for key in per_token_keys(prompts[0]):
        if key not in inputs:  # e.g. mm_token_type_ids: the prompt's, then each segment's (0 for the model's)
            values = [p[key][0].tolist() + [v for s in row for v in s.extras.get(key, [0] * len(s.ids))]
                      for p, row in zip(prompts, segments)]
            inputs[key] = torch.tensor([[0] * (length - len(v)) + v for v in values])  # (B, L)
    return {k: v.to(device) for k, v in (inputs | pixels).items()}


def pixel_inputs(processor, examples: list[Example], segments: list[list[Segment]]) -> dict[str, torch.Tensor]:
    """The processor's pixel inputs (everything that does not run along the tokens) of every image and
    video of each row: its example's, then its context segments', in order; one processor call, so the
    layout is the processor's own for any family."""
    texts = ["".join(s.text for s in row if not s.model) for row in segments]
    images = [[im for s in row for im in s.images] for row in segments]
    videos = [[video for s in row for video in s.videos] for row in segments]
    return pixels_of(processor, examples, texts, images, videos)


def pixels_of(processor, examples: list[Example], texts: list[str], images: list[list],
              videos: list[list] | None = None) -> dict[str, torch.Tensor]:
    """Pixel inputs of each example's prompt followed by `texts[i]` (context only) with `images[i]`
    and `videos[i]`."""
    encoded = model_inputs(processor(text=[prompt_text(processor, ex) + text for ex, text in zip(examples, texts)],
                                     return_tensors="pt", padding=True,
                                     **processor_inputs(processor, examples, images, videos)))
    along = set(per_token_keys(encoded))
    return {k: v for k, v in encoded.items() if k not in along}
