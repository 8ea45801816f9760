"""The built-in image tools: `zoom` (alias `crop`) and `zoom_window`.

`zoom` returns the region `box` of an example image, in the pixels of the ORIGINAL image
(`Example.originals`, the full-resolution images tools read), resized so that its longest side is
`ToolContext.max_side` (small regions are enlarged: that is the point of zooming). `zoom_window` is
a coarse zoom on one of 9 windows, a choice rather than four coordinates. A bad box or image number
is a ValueError, which the call turns into a "bad_arguments" error turn.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from vlmrl.tools.contract import ToolContext


def _number(value: Any) -> float:
    """`value` as a finite float; ValueError for anything else (bools, strings, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"box must be 4 numbers [x1, y1, x2, y2]; got {value!r} in it")
    return float(value)


def pixel_box(box: Any, width: int, height: int) -> tuple[int, int, int, int]:
    """`box` = [x1, y1, x2, y2] clamped to a width x height image and rounded to whole pixels."""
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        raise ValueError(f"box must be 4 numbers [x1, y1, x2, y2]; got {box!r}")
    x1, y1, x2, y2 = (_number(v) for v in box)
    x1, x2 = (round(min(max(x, 0.0), width)) for x in (x1, x2))
    y1, y2 = (round(min(max(y, 0.0), height)) for y in (y1, y2))
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"box {list(box)} is empty inside the {width}x{height} image "
                         f"(clamped: [{x1}, {y1}, {x2}, {y2}]); it needs x2 > x1 and y2 > y1")
    return x1, y1, x2, y2


_pixel_box = pixel_box  # its name before tools/ (vlmrl.tasks.tools re-exports it)


def context_image(context: ToolContext, image: Any) -> Image.Image:
    """Image number `image` of the context (its full-resolution original); ValueError for a bad number."""
    count = len(context.images)
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < count:
        raise ValueError(f"image must be a whole number from 0 to {count - 1} (the example has {count} "
                         f"image{'s' if count != 1 else ''}); got {image!r}")
    return context.images[image]


def fit_side(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) scaled, aspect kept, so that the longest side is `max_side` (others at least 1)."""
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def zoom(context: ToolContext, box: list[float], image: int = 0) -> Image.Image:
    """Region `box` = [x1, y1, x2, y2] of image number `image`, in the pixels of the full-resolution
    original, clamped to the image, as an RGB image resized (LANCZOS, aspect kept) so that its longest
    side is `context.max_side`: small regions are enlarged. ValueError for a bad box or image number."""
    original = context_image(context, image)
    x1, y1, x2, y2 = pixel_box(box, *original.size)
    region = original.crop((x1, y1, x2, y2)).convert("RGB")
    return region.resize(fit_side(x2 - x1, y2 - y1, context.max_side), Image.Resampling.LANCZOS)


WINDOW_GRID = 3
"""`zoom_window` offers WINDOW_GRID x WINDOW_GRID windows."""


def window_box(width: int, height: int, window: int) -> list[float]:
    """Box [x1, y1, x2, y2] of window `window` (0..8, row-major): half the image's width and height,
    starting at 0, 1/4 and 1/2 of each side, so any region up to a quarter of the image's width and
    height lies wholly inside at least one window."""
    row, col = divmod(window, WINDOW_GRID)
    x1, y1 = col * width / 4, row * height / 4
    return [x1, y1, x1 + width / 2, y1 + height / 2]


def zoom_window(context: ToolContext, window: int, image: int = 0) -> Image.Image:
    """`zoom` on window number `window` (0..8, `window_box`) of image number `image`: a coarse zoom
    whose argument is a choice among 9, not four coordinates (easier for a small model).
    ValueError for a window outside 0..8 or a bad image number."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window < WINDOW_GRID ** 2:
        raise ValueError(f"window must be a whole number from 0 to {WINDOW_GRID ** 2 - 1}; got {window!r}")
    if isinstance(image, bool) or not isinstance(image, int) or not 0 <= image < len(context.images):
        return zoom(context, [0, 0, 1, 1], image)  # zoom's own message about the image number
    return zoom(context, window_box(*context.images[image].size, window), image)
