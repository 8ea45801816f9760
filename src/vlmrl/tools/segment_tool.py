"""The model tool `segment(box=None, point=None, image=0)`: a SAM-family mask (SAM, SAM-HQ) for a box, a point,
or both.

    {"name": "segment", "arguments": {"box": [40, 20, 120, 90]}}
    {"name": "segment", "arguments": {"point": [75, 52], "image": 1}}

`box` is [x1, y1, x2, y2] and `point` is [x, y], both in the ORIGINAL image's pixels (as `zoom` takes boxes):
the box is clamped to the image as zoom clamps it, and the point must lie inside the image. The model reads
the whole image (a box is a prompt, not a crop). `segment` returns, as text, the mask's area (pixels of the
original), its box [x1, y1, x2, y2] (original pixels, x2 and y2 exclusive, as zoom takes it) and the model's
score (its predicted intersection over union, about 0 to 1); AND the overlay image: the original resized as
zoom resizes it, the mask tinted over it, the mask's box drawn in black, the prompt in white. An empty mask
is an answer ("no mask ..."), not an error. A bad argument (a box of NaN, a point outside the image, a
string where a box is wanted, neither prompt) raises ValueError: a "bad_arguments" error turn. The model
runner (vlmrl/models/segment_model.py) gives each call's mask in the image's own pixels (through the
processor's resize of the longest side and its pad), and computes the image embedding once per image:
calls of one turn on the same image with different prompts share one pass of the vision encoder.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from vlmrl.tools.image_tools import context_image, fit_side, pixel_box
from vlmrl.tools.model_tools import ModelTool, Prepared

TINT = (255, 0, 160)
"""The colour the mask is tinted with on the overlay."""
TINT_ALPHA = 0.5
"""How much of the tint a masked pixel takes."""


def point_of(point: Any, width: int, height: int) -> tuple[float, float]:
    """`point` = [x, y], two finite numbers inside a width x height image (0 <= x <= width, 0 <= y <= height);
    ValueError otherwise."""
    if not isinstance(point, (list, tuple)) or len(point) != 2 or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in point):
        raise ValueError(f"point must be 2 numbers [x, y] in the original image's pixels; got {point!r}")
    x, y = float(point[0]), float(point[1])
    if not (0 <= x <= width and 0 <= y <= height):
        raise ValueError(f"point {list(point)} is outside the {width}x{height} image")
    return x, y


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    """[x1, y1, x2, y2] (x2, y2 exclusive) of the True pixels of `mask` (H, W); None for an empty mask."""
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not len(rows):
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def overlay(original: Image.Image, mask: np.ndarray, box: tuple | None, prompt: tuple, side: int) -> Image.Image:
    """`original` resized as zoom resizes it (longest side `side`), `mask` (H, W) tinted over it, the mask's `box`
    drawn in black (1 px outside) and the prompt (box, point) in white."""
    size = fit_side(*original.size, side)
    scale = size[0] / original.width
    shown = original.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    covered = Image.fromarray(mask).resize(size, Image.Resampling.NEAREST).convert("L")  # 255 where masked
    shown = Image.composite(Image.blend(shown, Image.new("RGB", size, TINT), TINT_ALPHA), shown, covered)
    draw = ImageDraw.Draw(shown)
    if box is not None:
        a, b, c, d = (v * scale for v in box)
        draw.rectangle((a - 1, b - 1, c, d), outline=(0, 0, 0), width=1)
    given_box, point = prompt
    if given_box is not None:
        draw.rectangle(tuple(v * scale for v in given_box), outline=(255, 255, 255), width=1)
    if point is not None:
        x, y = point[0] * scale, point[1] * scale
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=(255, 255, 255), outline=(0, 0, 0))
    return shown


def describe(call: Prepared, mask: np.ndarray, score: float) -> str:
    """segment's text: what was asked of which image, then the mask's area, box and score."""
    box, point = call.args
    asked = " and ".join(part for part in (box is not None and f"box {list(box)}",
                                           point is not None and f"point {[round(v, 1) for v in point]}") if part)
    width, height = call.original.size
    head = f"for {asked} of image {call.image} ({width}x{height})"
    found = mask_box(mask)
    if found is None:
        return f"no mask {head}: the model's mask is empty (score {score:.2f})"
    area = int(mask.sum())
    return (f"mask {head}: area {area} pixels ({100 * area / (width * height):.1f}% of the image), box {list(found)}, "
            f"score {score:.2f} (the model's predicted IoU); area and box in the original image's pixels")


class SegmentTool(ModelTool):
    """`segment(box=None, point=None, image=0)` (module docstring); the runner's args are (box, point) in the
    image's pixels, either None."""

    name = "segment"
    model_types = ("sam", "sam_hq")

    def prepare(self, context: Any, box: Any = None, point: Any = None, image: Any = 0) -> Prepared:
        """The prompts checked against image number `image` (ValueError for a bad one, or for neither)."""
        width, height = context_image(context, image).size
        if box is None and point is None:
            raise ValueError("segment needs a box [x1, y1, x2, y2] or a point [x, y] (or both), in the original "
                             "image's pixels")
        args = (None if box is None else pixel_box(box, width, height),
                None if point is None else point_of(point, width, height))
        return self.prepared(context, args, None, image)

    def answer(self, call: Prepared, output: tuple) -> tuple[str, Image.Image]:
        """The text and the overlay of the runner's (mask (H, W) bool, score) for the whole image."""
        mask, score = output
        return describe(call, mask, score), overlay(call.original, mask, mask_box(mask), call.args, call.side)
