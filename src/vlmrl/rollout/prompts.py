"""How task examples become model inputs: the chat turn, the processor call, the image token.

Everything goes through the model's own chat template and processor, so any image-text-to-text
family works without per-architecture code. Generation (generation.py), log-probs (logprobs.py),
preflight and the attention maps all build their prompts here, so they see the same tokens.

Processor outputs that are not model inputs (`NOT_MODEL_INPUTS`: PaliGemma's processor always
returns `labels`, with which the forward computes a loss against the prompt) are dropped by
`model_inputs`, which every processor call that feeds the model goes through.

Image and video tokens are never cut: a prompt longer than a limit (`rollout.max_prompt_length`) is
a bad row, never trained on cut nor past the limit. `encode_prompts` with a `limit` raises
`PromptTooLong` for a batch holding one (the caller then finds which row, safety/bad_rows.py), and
`length_problem` says how long a prompt is and how many of its tokens are image and video tokens.
"""

from __future__ import annotations

import torch

from vlmrl.errors import VlmrlError
from vlmrl.models.video_processing import metadata, takes_video
from vlmrl.tasks import Example


IMAGE_MARKER = "<image>"
"""Where a prompt places an image (EasyR1's, verl's and OpenRLHF's marker); one per image, else unused."""


VIDEO_MARKER = "<video>"
"""Where a prompt places a video (the same convention); one per video, else the videos come first."""


def split_at(content: list[dict], marker: str, kind: str) -> list[dict]:
    """`content` with every text part cut at `marker`, a `kind` part in each cut."""
    out = []
    for part in content:
        if part["type"] != "text":
            out.append(part)
            continue
        pieces = part["text"].split(marker)
        for k, piece in enumerate(pieces):
            out += ([{"type": kind}] if k else []) + ([{"type": "text", "text": piece}] if piece else [])
    return out


def chat_messages(example: Example) -> list[dict]:
    """The system turn (when the example has one) and the user turn: each video at its `<video>`
    marker and each image at its `<image>` marker when the prompt has exactly one per video (image);
    else the videos, then the images, in order before the question."""
    content, first = [{"type": "text", "text": example.prompt}], []
    for marker, kind, count in ((VIDEO_MARKER, "video", len(example.videos)),
                                (IMAGE_MARKER, "image", len(example.images))):
        if count and example.prompt.count(marker) == count:
            content = split_at(content, marker, kind)
        else:
            first += [{"type": kind} for _ in range(count)]
    system = [{"role": "system", "content": [{"type": "text", "text": example.system}]}] if example.system else []
    return [*system, {"role": "user", "content": first + content}]


NOT_MODEL_INPUTS = frozenset({"labels"})
"""Processor outputs the model must not be given: with `labels` its forward computes a loss (and fails
when the inputs are longer than the labels, as prompt + completion are)."""


def model_inputs(batch) -> dict[str, torch.Tensor]:
    """A processor's outputs (a `BatchFeature` or dict) without those that are not model inputs."""
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}


def processor_inputs(processor, examples: list[Example], more_images: list[list] | None = None,
                     more_videos: list[list] | None = None) -> dict:
    """The media arguments of a processor call for `examples`: each example's images, then
    `more_images[i]` (a trajectory's tool images), and each example's videos, then `more_videos[i]`
    (its tool videos); see `media_inputs`."""
    images = [list(ex.images) + list(more_images[i] if more_images else []) for i, ex in enumerate(examples)]
    videos = [video for i, ex in enumerate(examples) for video in [*ex.videos, *(more_videos[i] if more_videos else [])]]
    return media_inputs(processor, images, videos)


def media_inputs(processor, images: list[list], videos: list) -> dict:
    """The media arguments of a processor call: `images` (one list per text) where any text has one,
    and `videos` (in the order of the texts' video markers) with their frame times (`video_metadata`)
    where there is one. VlmrlError when a video meets a processor that takes none (its family has no
    video processor in vlmrl: `vlmrl models`)."""
    media = {"images": images} if any(images) else {}
    if videos:
        if not takes_video(processor):
            raise VlmrlError(f"an example has a video, and the model's processor ({type(processor).__name__}) "
                             "takes none: `vlmrl models` lists the families that take video")
        media["videos"] = [list(video.frames) for video in videos]
        media["videos_kwargs"] = {"video_metadata": [metadata(video) for video in videos]}
    return media


class PromptTooLong(ValueError):
    """A batch holds a prompt longer than the limit `encode_prompts` was given. Not a user's message:
    the trainer encodes the batch's examples alone to name the bad row (safety/bad_rows.py)."""


class Encoded(list):
    """Examples whose prompts are already encoded (`encode_prompts` on the CPU, `prompt`): generation
    uses that encoding instead of running the processor again (training/prefetch.py runs it ahead)."""

    def __init__(self, examples: list[Example], prompt: dict[str, torch.Tensor]):
        super().__init__(examples)
        self.prompt = prompt  # the processor's inputs, (B, P) each


def encode_prompts(processor, examples: list[Example], device: torch.device,
                   limit: int | None = None) -> dict[str, torch.Tensor]:
    """Processor inputs (input_ids, attention_mask, pixel values, grids...) for a batch of examples,
    left-padded, each ending with the generation prompt; no `NOT_MODEL_INPUTS`. With `limit`,
    `PromptTooLong` when a prompt is longer (nothing is ever cut)."""
    texts = [processor.apply_chat_template(chat_messages(ex), add_generation_prompt=True, tokenize=False)
             for ex in examples]
    batch = processor(text=texts, return_tensors="pt", padding=True, **processor_inputs(processor, examples))
    if limit is not None:
        lengths = batch["attention_mask"].sum(-1)  # (B,)
        if int(lengths.max()) > limit:
            raise PromptTooLong(f"a prompt of {int(lengths.max())} tokens > max_prompt_length={limit}")
    return {k: v.to(device) for k, v in model_inputs(batch).items()}


def vision_tokens(processor, ids: torch.Tensor, model_config=None, video_texts: list[str] | None = None
                  ) -> tuple[int, int]:
    """(image tokens, video tokens) among a prompt's ids (P,): the model config's image token (Gemma 3's
    processor names its BOI) and the processor's video token; 0 for a kind the model has no token of.
    With `video_texts` (the text the family wrote for each video), a video's tokens are the vision
    tokens of its text, whichever token it uses (SmolVLM's frames are image tokens)."""
    try:
        image_id = image_token_id(processor, model_config)
    except VlmrlError:
        image_id = None
    video_id = getattr(processor, "video_token_id", None) if takes_video(processor) else None
    vision = torch.tensor([token for token in (image_id, video_id) if token is not None], dtype=torch.long)
    n_vision = int(torch.isin(ids, vision).sum())
    if video_texts is None:
        n_video = int((ids == video_id).sum()) if video_id is not None else 0
    else:
        n_video = sum(int(torch.isin(torch.tensor(processor.tokenizer(text, add_special_tokens=False).input_ids),
                                     vision).sum()) for text in video_texts)
    return n_vision - n_video, n_video


def length_problem(processor, ids: torch.Tensor, limit: int, model_config=None,
                   video_texts: list[str] | None = None) -> str | None:
    """`is 72 tokens (16 of them image tokens) > rollout.max_prompt_length=64` for a prompt's ids (P,)
    longer than `limit` (the video tokens named when it has some: `vision_tokens`); None within it."""
    if len(ids) <= limit:
        return None
    n_image, n_video = vision_tokens(processor, ids, model_config, video_texts)
    of_them = f"{n_image} of them image tokens" + (f", {n_video} video tokens" if n_video else "")
    return f"is {len(ids)} tokens ({of_them}) > rollout.max_prompt_length={limit}"


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
