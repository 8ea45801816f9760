"""Where the model looks: per-token attention heatmaps over the image.

`vlmrl attention MODEL --image IMG --prompt TEXT` builds the prompt exactly as training does
(`rollout.prompts.encode_prompts`), generates greedily, then runs one forward pass over prompt +
completion with attention weights returned. Generated token t is shown with the attention of the
position that produced it (query position P-1+t, the row Hugging Face's
`generate(output_attentions=True)` reports at step t) to the image-placeholder tokens, averaged
over the heads of one layer and laid out on the image's token grid. The grid comes from the
processor's own outputs (`image_grid_thw` / merge size, the Qwen2-VL family); a family without
them gets a square grid when the count allows. Each frame is normalised to its own maximum; the
caption gives the token's share of attention on the image, so frames stay comparable.

The share of attention on the image, and the eager forward that returns the weights, live in
attention.py (the trainer logs the same share). Colours are drawn by hand (numpy + PIL), no
matplotlib.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

from vlmrl.disk import output_folder, write_file, write_text
from vlmrl.errors import VlmrlError, one_line
from vlmrl.evaluation.attention import attention_forward, image_grids, resolve_layer
from vlmrl.rollout.prompts import encode_prompts, image_token_id
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


# ---------------------------------------------------------------- model plumbing


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
    image_shares: list[float] | None = None  # the share on each image, in order


@dataclass
class AttentionMaps:
    """What `attention_maps` wrote."""

    tokens: list[TokenAttention]
    completion: str
    layer: int  # 0-based index of the layer shown
    layers: int  # layers in the language model
    grid: tuple[int, int]  # (rows, cols) of the first image's tokens
    out_dir: Path
    grids: list[tuple[int, int]] | None = None  # (rows, cols) of every image's tokens


def load_image(path: str | Path) -> Image.Image:
    """An RGB image from disk, or a one-line VlmrlError: its size is read (lazily, from the header)
    and refused over PIL's decompression-bomb limit before any pixel is decoded."""
    path = Path(path)
    if not path.is_file():
        raise VlmrlError(f"image file {str(path)!r} does not exist")
    try:
        with warnings.catch_warnings():  # the size is checked below, against the limit itself
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                limit = Image.MAX_IMAGE_PIXELS
                if limit and width * height > limit:
                    raise VlmrlError(f"image {str(path)!r} is {width}x{height} ({width * height / 1e6:.0f} "
                                     f"megapixels), more than the {limit / 1e6:.0f} megapixels PIL decodes safely; "
                                     "downscale it first")
                return image.convert("RGB")
    except Image.DecompressionBombError as error:  # PIL refuses at open beyond twice its limit
        raise VlmrlError(f"image {str(path)!r} is too large to decode safely ({error}); downscale it first") from error
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as error:
        raise VlmrlError(f"cannot read image {str(path)!r}: {type(error).__name__}: {error}") from error


def check_prompt(processor, example: Example) -> None:
    """One line when the prompt writes a special token (an image placeholder: image tokens would no
    longer match image features) or the processor refuses the image (too thin, too small)."""
    specials = [token.content for token in processor.tokenizer.added_tokens_decoder.values() if token.special]
    written = [token for token in specials if token in example.prompt]
    if written:
        raise VlmrlError(f"the prompt contains the model's special token {written[0]!r}: image tokens would no "
                         "longer match the image; remove it (the image is placed by --image)")
    try:
        encode_prompts(processor, [example], torch.device("cpu"))
    except Exception as error:  # noqa: BLE001 - the processor's own reason, in one line
        sizes = ", ".join(f"{image.width}x{image.height}" for image in example.images)
        reason = f"{type(error).__name__}: {one_line(error)}"
        raise VlmrlError(f"the model's processor cannot take the image ({sizes}): {reason}") from error


def attention_maps(model_path: str, image: str | Path | Image.Image | list, prompt: str, *, layer: int = -1,
                   out_dir: str | Path = "runs/attention", max_new_tokens: int = 32,
                   device: str = "auto") -> AttentionMaps:
    """Generate greedily, then write one heatmap PNG per generated token (one panel per image when
    the prompt has several), a GIF and index.json. `image`: files, or PIL images (a task's).

    Returns the tokens with their image shares (see `format_summary`). Frames of an earlier run in
    `out_dir` (files named NNN_*.png) are replaced.
    """
    from vlmrl.models import load_policy
    from vlmrl.models.context import check_generation_length
    from vlmrl.models.loading import resolve_device

    if max_new_tokens < 1:
        raise VlmrlError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    resolve_device(device, "--device")  # a device this machine lacks: one line, before any work
    output_folder(out_dir, "the attention maps")  # a bad --out in one line, before any work
    pictures = [path.convert("RGB") if isinstance(path, Image.Image) else load_image(path)
                for path in (image if isinstance(image, (list, tuple)) else [image])]
    model, processor = load_policy(model_path, device=device, attn_implementation="eager")
    check_generation_length(model, "--max-new-tokens", max_new_tokens)
    model.eval()
    n_layers = model.config.get_text_config().num_hidden_layers
    layer_index = resolve_layer(layer, n_layers)
    example = Example(prompt=prompt, answer="", images=pictures)
    check_prompt(processor, example)
    ids, text, heats, grids = _heats(model, processor, example, layer_index, max_new_tokens)
    tokens = _write_frames(processor, pictures, ids, heats, Path(out_dir))
    write_text(Path(out_dir) / "index.json", "the attention index", json.dumps({
        "model": str(model_path), "prompt": prompt, "completion": text,
        "layer": layer_index, "layers": n_layers, "grid": list(grids[0]), "grids": [list(g) for g in grids],
        "gif": "attention.gif", "query": "attention of the position that produced each token, averaged over heads",
        "tokens": [vars(token) for token in tokens],
    }, indent=2, ensure_ascii=False))  # last: a folder with an index.json is a whole one
    return AttentionMaps(tokens=tokens, completion=text, layer=layer_index, layers=n_layers, grid=grids[0],
                         out_dir=Path(out_dir), grids=grids)


def _heats(model, processor, example: Example, layer: int, max_new_tokens: int):
    """Greedy completion ids (T,), its text, each image's heatmaps (T, rows, cols) and grids."""
    from vlmrl.config import GenerationSettings
    from vlmrl.rollout.generation import generate_groups

    rollout = generate_groups(model, processor, [example],
                              GenerationSettings(group_size=1, max_new_tokens=max_new_tokens, temperature=0))
    length = int(rollout.lengths[0])
    ids, mask = rollout.completion_ids[:, :length], rollout.completion_mask[:, :length]  # (1, T)
    attentions, inputs, query_mask = attention_forward(model, processor, [example], ids, mask)
    positions = (inputs["input_ids"][0] == image_token_id(processor, model.config)).nonzero().squeeze(-1)  # (N,)
    if positions.numel() == 0:
        raise VlmrlError("the prompt holds no image tokens: the processor did not insert the image")
    grids = image_grids(inputs, processor, model, len(example.images), positions.numel())
    queries = query_mask[0].nonzero().squeeze(-1)  # (T,)
    spans = torch.split(positions, [r * c for r, c in grids])  # each image's token positions
    heats = [image_heatmaps(attentions[layer][0], queries, span, grid).cpu() for span, grid in zip(spans, grids)]
    return ids[0], rollout.texts[0], heats, grids


def _write_frames(processor, pictures: list[Image.Image], ids: torch.Tensor, heats: list[torch.Tensor],
                  out: Path) -> list[TokenAttention]:
    """One PNG per token (the images' heatmaps side by side) and the GIF; returns the tokens."""
    for stale in [*out.glob("[0-9][0-9][0-9]*_*.png"), out / "index.json"]:  # an earlier run's, if any
        stale.unlink(missing_ok=True)
    length = len(ids)
    width = max(3, len(str(length - 1)))
    tokens, frames = [], []
    for t in range(length):
        token_id = int(ids[t])
        text = processor.tokenizer.decode([token_id], skip_special_tokens=False)
        shares = [float(heat[t].sum().clamp(0.0, 1.0)) for heat in heats]
        share = min(sum(shares), 1.0)
        name = f"{t:0{width}d}_{safe_name(text)}.png"
        caption = f"{t + 1}/{length}   {visible(text)}   {share:.0%} on image"
        panels = [heatmap_frame(picture, heat[t].numpy(), caption if i == 0 else f"image {i + 1}: {s:.0%}")
                  for i, (picture, heat, s) in enumerate(zip(pictures, heats, shares))]
        frame = side_by_side(panels)
        write_file(out / name, "a heatmap", lambda temporary, frame=frame: frame.save(temporary, format="PNG"))
        frames.append(frame)
        tokens.append(TokenAttention(index=t, token=text, token_id=token_id, image_share=share, file=name,
                                     image_shares=shares))
    write_file(out / "attention.gif", "the attention GIF", lambda temporary: frames[0].save(
        temporary, format="GIF", save_all=True, append_images=frames[1:], duration=FRAME_MS, loop=0))
    return tokens


def side_by_side(panels: list[Image.Image]) -> Image.Image:
    """The panels in a row, top-aligned, on a dark background (one panel: itself)."""
    if len(panels) == 1:
        return panels[0]
    frame = Image.new("RGB", (sum(p.width for p in panels), max(p.height for p in panels)), (24, 24, 24))
    x = 0
    for panel in panels:
        frame.paste(panel, (x, 0))
        x += panel.width
    return frame


def format_summary(maps: AttentionMaps) -> str:
    """Per token, the share of its attention on image tokens; then where the files are."""
    tokens = maps.tokens
    rows, cols = maps.grid
    lines = [f"completion: {maps.completion!r}",
             f"layer {maps.layer} of {maps.layers} (heads averaged), image grid "
             + ", ".join(f"{r}x{c}" for r, c in (maps.grids or [maps.grid])) + " tokens",
             "  #  token                       on image"]
    lines += [f"{t.index:>3}  {visible(t.token):<26}  {t.image_share:>7.1%}" for t in tokens]
    mean = sum(t.image_share for t in tokens) / len(tokens)
    lines.append(f"mean share on image: {mean:.1%}")
    lines.append(f"wrote {len(tokens)} heatmaps, attention.gif and index.json to {maps.out_dir}")
    return "\n".join(lines)
