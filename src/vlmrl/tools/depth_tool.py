"""The model tool `depth(box=None, regions=None, image=0)`: monocular depth (Depth Anything, DPT) of a region.

    {"name": "depth", "arguments": {"box": [0, 0, 320, 240], "regions": [[10, 40, 60, 90], [200, 30, 260, 120]]}}

The model reads `box` (original pixels; default the whole image) of image number `image` and gives a depth
map of it (vlmrl/models/depth_model.py, in the crop's own pixels). What a model reasoning about a scene
needs from it is order, not numbers: which part is nearer. So `depth` returns, as text, depth RELATIVE to
the box, 0 at its nearest point and 1 at its farthest (relative checkpoints give inverse depth with an
unknown scale and shift, so the order is what they say, and equal steps are not equal distances; a
metric checkpoint's metres are given too): a head line (where, in which coordinates, the nearest and
the farthest point as [x, y] in the ORIGINAL image's pixels), a coarse grid of GRID x GRID cells (each
cell's median, 0 nearest to 9 farthest, rows top to bottom), and, for the `regions` asked about (up to
MAX_REGIONS boxes in original pixels, inside `box`), each one's median, nearest first: the answer to
"which is closer". AND the depth map as an image: the box's region, coloured (near bright yellow, far
dark), resized as `zoom` resizes it (longest side the context's `max_side`), with the regions drawn and
numbered (cv_tools' set-of-marks). A map without differences (a flat wall) says so.

A bad argument (a box or region of NaN, outside the image or the box, too many regions) raises ValueError:
a "bad_arguments" error turn; a model that raises or runs out of memory is a "raised" error turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmrl.tools.cv_tools import marks
from vlmrl.tools.image_tools import context_image, fit_side, pixel_box
from vlmrl.tools.model_tools import ModelTool, Prepared

GRID = 4
"""The text's grid: GRID x GRID cells over the box (fewer where the box is fewer pixels wide or high)."""
MAX_REGIONS = 8
"""Most regions one call compares."""
FLAT = 1e-3
"""A map whose range is below this share of its largest value has no depth differences to report (float noise
of the resize is about 1e-6 of it)."""
COLOURS = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], np.float32)
"""The colour map from far (0) to near (1), evenly spaced stops (inferno's): near is bright."""
PALETTE = np.stack([np.interp(np.linspace(0, 1, 256), np.linspace(0, 1, len(COLOURS)), COLOURS[:, c])
                    for c in range(3)], axis=-1).round().astype(np.uint8)
"""(256, 3) the colour of each of 256 levels of nearness."""


@dataclass
class Marked:
    """A region to draw on the map: its box in the drawn image's pixels (what `marks` reads)."""

    box: tuple[float, float, float, float]


def regions_of(regions: Any, where: tuple[int, int, int, int], size: tuple[int, int]) -> tuple:
    """The `regions` asked about, each [x1, y1, x2, y2] (original pixels) clamped to the image (`size`), rounded
    as zoom rounds, and cut to the box `where`: a tuple of boxes; ValueError for a bad one, or one that does
    not overlap the box."""
    if regions is None:
        return ()
    if not isinstance(regions, (list, tuple)) or not regions or len(regions) > MAX_REGIONS or not all(
            isinstance(region, (list, tuple)) for region in regions):
        raise ValueError(f"regions must be a list of 1 to {MAX_REGIONS} boxes [[x1, y1, x2, y2], ...]; got {regions!r}")
    out = []
    for number, region in enumerate(regions, 1):
        try:
            x1, y1, x2, y2 = pixel_box(region, *size)
        except ValueError as error:
            raise ValueError(f"region {number}: {error}") from None
        cut = (max(x1, where[0]), max(y1, where[1]), min(x2, where[2]), min(y2, where[3]))
        if cut[2] <= cut[0] or cut[3] <= cut[1]:
            raise ValueError(f"region {number} {list(region)} lies outside box {list(where)}, where the depth is read")
        out.append(cut)
    return tuple(out)


def relative_depth(depth: np.ndarray, metric: bool) -> np.ndarray | None:
    """(H, W) in [0, 1]: 0 at the map's nearest point, 1 at its farthest (a metric map: larger is farther;
    relative inverse depth: larger is nearer); None for a map without differences."""
    low, high = float(depth.min()), float(depth.max())
    if not high - low > FLAT * max(abs(high), abs(low), 1.0):
        return None
    share = (depth - low) / (high - low)
    return share if metric else 1.0 - share


def colour_map(relative: np.ndarray | None, size: tuple[int, int]) -> Image.Image:
    """The map as an RGB image of `size` (width, height): near bright, far dark (COLOURS, in 256 levels); a flat
    map mid-way."""
    if relative is None:
        relative = np.full((1, 1), 0.5, np.float32)
    shown = np.asarray(Image.fromarray(relative.astype(np.float32)).resize(size, Image.Resampling.BILINEAR))  # mode F
    levels = np.round(np.clip(1.0 - shown, 0.0, 1.0) * 255).astype(np.uint8)  # (h, w): 255 nearest
    return Image.fromarray(PALETTE[levels])  # (h, w, 3) uint8: RGB


def grid(relative: np.ndarray) -> list[list[int]]:
    """Each cell's median relative depth, 0 to 9, over GRID x GRID cells (rows top to bottom)."""
    rows = np.array_split(np.arange(relative.shape[0]), min(GRID, relative.shape[0]))
    columns = np.array_split(np.arange(relative.shape[1]), min(GRID, relative.shape[1]))
    return [[int(round(9 * float(np.median(relative[r[0]:r[-1] + 1, c[0]:c[-1] + 1])))) for c in columns]
            for r in rows]


def describe(call: Prepared, depth: np.ndarray, metric: bool) -> str:
    """depth's text for `call` from the crop's map `depth` (module docstring)."""
    x0, y0, x1, y1 = call.where
    relative = relative_depth(depth, metric)
    head = f"depth in box {list(call.where)} of image {call.image} ({call.original.width}x{call.original.height})"
    if relative is None:
        lines = [f"{head}: flat, the model sees no depth differences in this box"
                 + (f" (about {float(depth.mean()):.2f} m)" if metric else "")]
        if call.args:
            lines.append("regions: all at the same depth")
        return "\n".join(lines)
    near_y, near_x = np.unravel_index(int(np.argmin(relative)), relative.shape)
    far_y, far_x = np.unravel_index(int(np.argmax(relative)), relative.shape)
    scale = (f"metres from {float(depth.min()):.2f} to {float(depth.max()):.2f}" if metric else
             "from the model's inverse depth: the order holds, equal steps are not equal distances")
    lines = [f"{head}, relative to the box: 0 nearest, 1 farthest ({scale}); nearest point [{x0 + near_x}, "
             f"{y0 + near_y}], farthest [{x0 + far_x}, {y0 + far_y}] (original pixels)"]
    cells = grid(relative)
    width, height = (x1 - x0) / len(cells[0]), (y1 - y0) / len(cells)
    lines.append(f"{len(cells)}x{len(cells[0])} grid of {width:.0f}x{height:.0f} px cells, rows top to bottom, "
                 "0 nearest to 9 farthest:")
    lines += [" ".join(str(cell) for cell in row) for row in cells]
    if call.args:
        listed = []
        for number, (a, b, c, d) in enumerate(call.args, 1):
            part = (slice(b - y0, d - y0), slice(a - x0, c - x0))
            median = float(np.median(relative[part]))
            metres = f" ({float(np.median(depth[part])):.2f} m)" if metric else ""
            listed.append((median, number, f"{number} box {[a, b, c, d]} {median:.2f}{metres}"))
        lines.append("regions, nearest first (median relative depth): " + "; ".join(text for *_, text in sorted(listed)))
    return "\n".join(lines)


class DepthTool(ModelTool):
    """`depth(box=None, regions=None, image=0)` (module docstring); the runner's args are the call's regions
    (for the cache key: the runner reads the crop alone)."""

    name = "depth"
    model_types = ("depth_anything", "dpt")

    def prepare(self, context: Any, box: Any = None, regions: Any = None, image: Any = 0) -> Prepared:
        """The box, the image and the regions checked (ValueError for a bad one)."""
        original = context_image(context, image)
        where = pixel_box([0, 0, *original.size] if box is None else box, *original.size)  # as `prepared` reads it
        return self.prepared(context, regions_of(regions, where, original.size), box, image)

    def answer(self, call: Prepared, output: tuple) -> tuple[str, Image.Image]:
        """The text and the coloured map of the runner's (map in the crop's pixels, metric) for the call."""
        depth, metric = output
        x0, y0, x1, y1 = call.where
        size = fit_side(x1 - x0, y1 - y0, call.side)
        scale = call.side / max(x1 - x0, y1 - y0)  # as zoom and marks scale the box
        shown = colour_map(relative_depth(depth, metric), size)
        marked = [Marked(tuple((v - o) * scale for v, o in zip(region, (x0, y0, x0, y0)))) for region in call.args]
        return describe(call, depth, metric), marks(shown, marked, (0, 0, *size), call.side)
