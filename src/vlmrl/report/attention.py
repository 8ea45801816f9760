"""Where the model looks: per-token attention heatmaps over the image, and the share of attention
that falls on image tokens.

`vlmrl attention MODEL --image IMG --prompt TEXT` builds the prompt exactly as training does
(`vlmrl.rollout.encode_prompts`), generates greedily, then runs one forward pass over prompt +
completion with attention weights returned. Generated token t is shown with the attention of the
position that produced it (query position P-1+t, the row Hugging Face's
`generate(output_attentions=True)` reports at step t) to the image-placeholder tokens, averaged
over the heads of one layer and laid out on the image's token grid. The grid comes from the
processor's own outputs (`image_grid_thw` / merge size, the Qwen2-VL family); a family without
them gets a square grid when the count allows. Each frame is normalised to its own maximum; the
caption gives the token's share of attention on the image, so frames stay comparable.

The trainer calls `completion_image_attention` every N steps for one float, the mean share of
attention that completion tokens put on image tokens: a policy that stops looking at the image
shows it here first. Attention weights need the eager implementation; the model is switched to it
for that one forward pass and back. Colours are drawn by hand (numpy + PIL), no matplotlib.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

from vlmrl.errors import VlmrlError
from vlmrl.logprobs import join_prompt_and_completion
from vlmrl.rollout import encode_prompts
from vlmrl.tasks import Example

# Anchor colours of matplotlib's "inferno" (dark = little attention, bright yellow = most).
INFERNO = np.array([[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66],
                    [245, 125, 21], [250, 193, 39], [252, 255, 164]], dtype=np.float32)
MIN_SIDE, MAX_SIDE = 320, 1024  # longest side of a frame, in pixels
FRAME_MS = 600  # GIF frame duration
ALPHA = 0.6  # weight of the heat colours over the grey image


# ---------------------------------------------------------------- pure tensor math


def image_heatmaps(attention: torch.Tensor, queries: torch.Tensor, image_positions: torch.Tensor,
                   grid: tuple[int, int]) -> torch.Tensor:
    """Head-averaged attention of each query to the image tokens, on the image's token grid.

    attention: (H, S, S) one layer's weights for one sequence; queries: (n,) query positions;
    image_positions: (N,) key positions of the image tokens, in the processor's (row-major) order;
    grid: (rows, cols) with rows * cols == N. Returns (n, rows, cols); its sums are the shares.
    """
    rows, cols = grid
    if rows * cols != image_positions.numel():
        raise VlmrlError(f"cannot lay {image_positions.numel()} image tokens on a {rows}x{cols} grid")
    mean = attention.float().mean(0)  # (S, S) averaged over heads
    picked = mean[queries][:, image_positions]  # (n, N)
    return picked.reshape(len(queries), rows, cols)  # (n, rows, cols)


def image_attention_share(attentions, input_ids: torch.Tensor, image_token_id: int,
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
    keys = (input_ids == image_token_id)  # (B, S)
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


# ---------------------------------------------------------------- model plumbing


def image_token_id(model, processor) -> int:
    """Id of the image placeholder token, from the model config or else the processor."""
    config = model.config
    for value in (getattr(config, "image_token_id", None),
                  getattr(config.get_text_config(), "image_token_id", None),
                  getattr(processor, "image_token_id", None)):
        if isinstance(value, int):
            return value
    token = getattr(processor, "image_token", None)
    if isinstance(token, str):
        found = processor.tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != processor.tokenizer.unk_token_id:
            return found
    raise VlmrlError(f"{type(model).__name__} has no image token (no image_token_id in its config "
                     "or processor): it is not an image-text-to-text model")


def token_grid(inputs: dict[str, torch.Tensor], processor, model, n_tokens: int) -> tuple[int, int]:
    """(rows, cols) of the image tokens: `image_grid_thw` over the merge size, else a square."""
    grid_thw = inputs.get("image_grid_thw")
    if grid_thw is not None:
        merge = (getattr(processor.image_processor, "merge_size", None)
                 or getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", None) or 1)
        t, h, w = (int(v) for v in grid_thw[0])
        if t * (h // merge) * (w // merge) == n_tokens:
            return t * (h // merge), w // merge
    side = math.isqrt(n_tokens)
    if side * side == n_tokens:
        return side, side
    raise VlmrlError(f"cannot tell the layout of the {n_tokens} image tokens of this model "
                     "(no image_grid_thw from the processor and not a square)")


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
def completion_image_attention(model, processor, rows: list[Example], completion_ids: torch.Tensor,
                               completion_mask: torch.Tensor, layer: int | None = None,
                               max_rows: int = 4) -> float:
    """Mean share of attention that completion tokens put on image tokens, for the trainer's log.

    Takes what a `Rollout` holds (rows, completion_ids (N, T), completion_mask (N, T)) and uses
    its first `max_rows` rows: one extra forward pass with eager attention, all layers held at
    once, so keep `max_rows` small on a big model. layer=None averages over layers.
    """
    n = min(max_rows, len(rows))
    length = max(int(completion_mask[:n].sum(-1).max()), 1)  # drop padding past the longest
    ids, mask = completion_ids[:n, :length], completion_mask[:n, :length]  # (n, T')
    attentions, inputs, query_mask = attention_forward(model, processor, rows[:n], ids, mask)
    return image_attention_share(attentions, inputs["input_ids"], image_token_id(model, processor),
                                 query_mask, layer=layer)


# ---------------------------------------------------------------- drawing


def colormap(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1], any shape -> uint8 RGB of shape (..., 3), by linear interpolation."""
    x = np.clip(values, 0.0, 1.0) * (len(INFERNO) - 1)
    low = np.floor(x).astype(int).clip(0, len(INFERNO) - 2)
    frac = (x - low)[..., None]
    return (INFERNO[low] * (1 - frac) + INFERNO[low + 1] * frac).round().astype(np.uint8)


def display_size(width: int, height: int) -> tuple[int, int]:
    """Image size in a frame: the longest side scaled into [MIN_SIDE, MAX_SIDE]."""
    longest = max(width, height)
    scale = MIN_SIDE / longest if longest < MIN_SIDE else min(1.0, MAX_SIDE / longest)
    return max(1, round(width * scale)), max(1, round(height * scale))


def caption_height(width: int) -> int:
    return max(28, width // 10)


def heatmap_frame(image: Image.Image, heat: np.ndarray, caption: str) -> Image.Image:
    """The image with `heat` (rows, cols; any scale) upsampled over it, and a caption band below.

    Colours run from 0 (dark) to the map's own maximum (bright yellow); a scale sits at the right
    of the caption.
    """
    width, height = display_size(*image.size)
    gray = image.convert("L").resize((width, height), Image.BICUBIC)  # grey, so the colours read
    base = np.asarray(gray, dtype=np.float32)[..., None]  # (height, width, 1)
    top = float(heat.max())
    norm = heat / top if top > 0 else np.zeros_like(heat)
    cells = Image.fromarray(norm.astype(np.float32), mode="F").resize((width, height), Image.NEAREST)
    level = np.asarray(cells, dtype=np.float32).clip(0, 1)  # (height, width), one block per token
    blended = base * (1 - ALPHA) + colormap(level).astype(np.float32) * ALPHA
    band = caption_height(width)
    frame = Image.new("RGB", (width, height + band), (24, 24, 24))
    frame.paste(Image.fromarray(blended.round().astype(np.uint8)), (0, 0))
    draw = ImageDraw.Draw(frame)
    font = ImageFont.load_default(size=int(band * 0.5))
    draw.text((8, height + band // 2), caption, fill=(240, 240, 240), font=font, anchor="lm")
    scale_w, scale_h = max(24, width // 8), max(4, band // 4)  # colour scale: 0 .. max
    ramp = colormap(np.tile(np.linspace(0, 1, scale_w, dtype=np.float32), (scale_h, 1)))
    small = ImageFont.load_default(size=max(8, int(band * 0.35)))
    right = width - 8 - int(draw.textlength("max", font=small)) - 4
    left = right - scale_w
    frame.paste(Image.fromarray(ramp), (left, height + band // 2 - scale_h // 2))
    draw.text((left - 4, height + band // 2), "0", fill=(200, 200, 200), font=small, anchor="rm")
    draw.text((right + 4, height + band // 2), "max", fill=(200, 200, 200), font=small, anchor="lm")
    return frame


def visible(token: str, limit: int = 24) -> str:
    """A token as it can be printed in a caption: whitespace escaped, quoted, cut to `limit`."""
    text = token.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return "'" + (text if len(text) <= limit else text[:limit - 1] + "…") + "'"


def safe_name(token: str) -> str:
    """A token as a file-name part: letters, digits, - and _ only."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", token.strip()).strip("_")[:32]
    return name or "tok"


# ---------------------------------------------------------------- the command


@dataclass
class TokenAttention:
    """One generated token and where it looked."""

    index: int
    token: str
    token_id: int
    image_share: float  # share of the (head-averaged) attention on image tokens, in [0, 1]
    file: str


@dataclass
class AttentionMaps:
    """What `attention_maps` wrote."""

    tokens: list[TokenAttention]
    completion: str
    layer: int  # 0-based index of the layer shown
    layers: int  # layers in the language model
    grid: tuple[int, int]  # (rows, cols) of image tokens
    out_dir: Path


def load_image(path: str | Path) -> Image.Image:
    """An RGB image from disk, or a one-line VlmrlError."""
    path = Path(path)
    if not path.is_file():
        raise VlmrlError(f"image file {str(path)!r} does not exist")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise VlmrlError(f"cannot read image {str(path)!r}: {error}")


def attention_maps(model_path: str, image: str | Path, prompt: str, *, layer: int = -1,
                   out_dir: str | Path = "runs/attention", max_new_tokens: int = 32,
                   device: str = "auto") -> AttentionMaps:
    """Generate greedily, then write one heatmap PNG per generated token, a GIF and index.json.

    Returns the tokens with their image shares (see `format_summary`). Frames of an earlier run in
    `out_dir` (files named NNN_*.png) are replaced.
    """
    from vlmrl.models import load_policy
    from vlmrl.rollout import GenerationSettings, generate_groups

    if max_new_tokens < 1:
        raise VlmrlError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    picture = load_image(image)
    model, processor = load_policy(model_path, device=device, attn_implementation="eager")
    model.eval()
    n_layers = model.config.get_text_config().num_hidden_layers
    layer_index = resolve_layer(layer, n_layers)
    image_id = image_token_id(model, processor)
    example = Example(image=picture, prompt=prompt, answer="")

    rollout = generate_groups(model, processor, [example],
                              GenerationSettings(group_size=1, max_new_tokens=max_new_tokens, greedy=True))
    length = int(rollout.lengths[0])
    ids, mask = rollout.completion_ids[:, :length], rollout.completion_mask[:, :length]  # (1, T)
    attentions, inputs, query_mask = attention_forward(model, processor, [example], ids, mask)
    image_positions = (inputs["input_ids"][0] == image_id).nonzero().squeeze(-1)  # (N,)
    if image_positions.numel() == 0:
        raise VlmrlError("the prompt holds no image tokens: the processor did not insert the image")
    grid = token_grid(inputs, processor, model, image_positions.numel())
    queries = query_mask[0].nonzero().squeeze(-1)  # (T,)
    heat = image_heatmaps(attentions[layer_index][0], queries, image_positions, grid).cpu()  # (T, rows, cols)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("[0-9][0-9][0-9]*_*.png"):
        stale.unlink()
    width = max(3, len(str(length - 1)))
    tokens, frames = [], []
    for t in range(length):
        token_id = int(ids[0, t])
        text = processor.tokenizer.decode([token_id], skip_special_tokens=False)
        share = float(heat[t].sum().clamp(0.0, 1.0))
        name = f"{t:0{width}d}_{safe_name(text)}.png"
        caption = f"{t + 1}/{length}   {visible(text)}   {share:.0%} on image"
        frame = heatmap_frame(picture, heat[t].numpy(), caption)
        frame.save(out / name)
        frames.append(frame)
        tokens.append(TokenAttention(index=t, token=text, token_id=token_id, image_share=share, file=name))
    frames[0].save(out / "attention.gif", save_all=True, append_images=frames[1:], duration=FRAME_MS,
                   loop=0)
    (out / "index.json").write_text(json.dumps({
        "model": str(model_path), "prompt": prompt, "completion": rollout.texts[0],
        "layer": layer_index, "layers": n_layers, "grid": list(grid), "gif": "attention.gif",
        "query": "attention of the position that produced each token, averaged over heads",
        "tokens": [vars(token) for token in tokens],
    }, indent=2, ensure_ascii=False))
    return AttentionMaps(tokens=tokens, completion=rollout.texts[0], layer=layer_index, layers=n_layers,
                         grid=grid, out_dir=out)


def format_summary(maps: AttentionMaps) -> str:
    """Per token, the share of its attention on image tokens; then where the files are."""
    tokens = maps.tokens
    rows, cols = maps.grid
    lines = [f"completion: {maps.completion!r}",
             f"layer {maps.layer} of {maps.layers} (heads averaged), image grid {rows}x{cols} tokens",
             "  #  token                       on image"]
    lines += [f"{t.index:>3}  {visible(t.token):<26}  {t.image_share:>7.1%}" for t in tokens]
    mean = sum(t.image_share for t in tokens) / len(tokens)
    lines.append(f"mean share on image: {mean:.1%}")
    lines.append(f"wrote {len(tokens)} heatmaps, attention.gif and index.json to {maps.out_dir}")
    return "\n".join(lines)
