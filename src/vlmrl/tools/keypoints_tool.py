"""The model tool `keypoints(box=None, image=0)`: body keypoints of the person in a box (ViTPose: COCO's 17, named
"Nose", "L_Eye", ... "R_Ankle") or the interest points of a region (SuperPoint: corners and blobs, unnamed).

    {"name": "keypoints", "arguments": {"box": [120, 40, 220, 300]}}

`keypoints` returns, as text, the points found for `box` (original pixels, [x1, y1, x2, y2]; default the whole
image) of image number `image`: a number, the point's name ("point" where the model names none), x and y in
the ORIGINAL image's pixels (the column and row of the pixel it lies in, as `zoom` counts them) and a score,
best first, only those above the model's threshold (SCORE_THRESHOLDS) and inside the image, at most
MAX_POINTS; AND an overlay image: the box (grown to hold every listed point), each point drawn and numbered,
and the skeleton's edges between listed points where the model has one (ViTPose). Nothing above the threshold
is an answer ("no keypoints ..."), not an error. A bad argument (a box of NaN, a number for the box, a box
wholly outside the image) raises ValueError: a "bad_arguments" error turn.

ViTPose is a top-down model: the box IS its input, the person it reads the pose of; it sees the box at its
input's aspect, enlarged by a quarter about its centre (context around the person), so the whole image is
handed to the runner (vlmrl/models/keypoint_model.py), with the box as the call's argument, and the points
may lie a little outside the box. SuperPoint reads the box alone, resized to its input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vlmrl.tools.image_tools import context_image, fit_side, pixel_box
from vlmrl.tools.model_tools import CACHE_SIZE, ModelTool, Prepared

SCORE_THRESHOLDS = {"vitpose": 0.3, "superpoint": 0.015}
"""Lowest score a point is listed with, by model type: ViTPose's heatmap peak (mmpose's and the HF demo's 0.3);
SuperPoint's point probability (Magic Leap's demo's 0.015)."""
MAX_POINTS = 20
"""Most points one call lists and draws (best scores first): ViTPose's 17 all fit."""
MARGIN = 4
"""Pixels of the original the overlay keeps around the box and the points."""


@dataclass
class Point:
    """One point listed: its name, its pixel in the original (column x, row y), its score, its index in the
    runner's output (for the skeleton's edges)."""

    name: str
    x: int
    y: int
    score: float
    index: int


def listed_points(output: Any, origin: tuple[int, int], size: tuple[int, int], threshold: float) -> list[Point]:
    """The points to list from the runner's `output` (xy (N, 2) in the crop's pixels, pixel centres at integers;
    scores (N,); names): above `threshold`, placed at `origin` (x, y) of the original, rounded to the pixel they
    lie in and inside its `size` (width, height), best first, at most MAX_POINTS."""
    xy = np.asarray(output.xy, np.float64).reshape(-1, 2) + np.array(origin, np.float64)  # (N, 2)
    scores = np.asarray(output.scores, np.float64).reshape(-1)  # (N,)
    finite = np.isfinite(xy).all(axis=1) & np.isfinite(scores)
    pixel = np.floor(np.where(finite[:, None], xy, -1.0) + 0.5)  # the nearest pixel centre
    inside = finite & (pixel[:, 0] >= 0) & (pixel[:, 0] < size[0]) & (pixel[:, 1] >= 0) & (pixel[:, 1] < size[1])
    keep = np.flatnonzero(inside & (scores > threshold))
    keep = keep[np.argsort(-scores[keep], kind="stable")][:MAX_POINTS]
    return [Point(output.names[k] or "point", int(pixel[k, 0]), int(pixel[k, 1]), round(float(scores[k]), 3), int(k))
            for k in keep]


def describe(found: list[Point], box: tuple, image: int, size: tuple[int, int], threshold: float) -> str:
    """keypoints' text: a head line (how many, where, in which coordinates) and one line per point."""
    head = f"in box {list(box)} of image {image} ({size[0]}x{size[1]})"
    if not found:
        return f"no keypoints found {head} (nothing scored above {threshold:g})"
    lines = [f"{len(found)} keypoint{'s' if len(found) != 1 else ''} {head}; x, y: the pixel's column and row in the "
             f"original image, scores above {threshold:g}, best first"]
    lines += [f"{n} {p.name} x {p.x} y {p.y} score {p.score:.2f}" for n, p in enumerate(found, 1)]
    return "\n".join(lines)


def overlay(original: Image.Image, found: list[Point], box: tuple[int, int, int, int], edges: tuple,
            max_side: int) -> Image.Image:
    """The box of `original`, grown to hold every point (and MARGIN), resized as zoom resizes (LANCZOS, longest
    side `max_side`), with the skeleton's `edges` between listed points, each point a dot with its number on a
    white tag, and the box's outline where the view was grown past it."""
    xs, ys = [box[0], box[2]] + [p.x for p in found], [box[1], box[3]] + [p.y for p in found]
    view = (max(0, min(xs) - MARGIN), max(0, min(ys) - MARGIN),
            min(original.width, max(xs) + 1 + MARGIN), min(original.height, max(ys) + 1 + MARGIN))
    if not found:
        view = box
    scale = max_side / max(view[2] - view[0], view[3] - view[1])
    size = fit_side(view[2] - view[0], view[3] - view[1], max_side)
    shown = original.crop(view).convert("RGB").resize(size, Image.Resampling.LANCZOS)
    draw = ImageDraw.Draw(shown)
    at = lambda x, y: ((x + 0.5 - view[0]) * scale, (y + 0.5 - view[1]) * scale)  # noqa: E731 - a pixel's centre
    if view != box:
        draw.rectangle(((box[0] - view[0]) * scale, (box[1] - view[1]) * scale, (box[2] - view[0]) * scale - 1,
                        (box[3] - view[1]) * scale - 1), outline=(255, 255, 255), width=1)
    by_index = {p.index: p for p in found}
    for i, j in edges:
        if i in by_index and j in by_index:
            draw.line((*at(by_index[i].x, by_index[i].y), *at(by_index[j].x, by_index[j].y)), fill=(255, 255, 0), width=2)
    font = ImageFont.load_default(size=max(10, max_side // 32))
    radius = max(2, max_side // 112)
    for number, point in enumerate(found, start=1):
        x, y = at(point.x, point.y)
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=(255, 0, 0), outline=(0, 0, 0))
        left, top, right, bottom = draw.textbbox((0, 0), str(number), font=font)
        tag_x = min(max(x + radius, 0), size[0] - (right - left) - 2)
        tag_y = min(max(y - radius - (bottom - top) - 2, 0), size[1] - (bottom - top) - 2)
        draw.rectangle((tag_x, tag_y, tag_x + right - left + 2, tag_y + bottom - top + 2), fill=(255, 255, 255),
                       outline=(0, 0, 0))
        draw.text((tag_x + 1 - left, tag_y + 1 - top), str(number), fill=(0, 0, 0), font=font)
    return shown


class KeypointsTool(ModelTool):
    """`keypoints(box=None, image=0)` (module docstring); the runner reads the whole image, its args are (box,)."""

    name = "keypoints"
    model_types = tuple(SCORE_THRESHOLDS)

    def __init__(self, folder: Path, cache_size: int = CACHE_SIZE):
        super().__init__(folder, cache_size)
        self.threshold = SCORE_THRESHOLDS[json.loads((Path(folder) / "config.json").read_text())["model_type"]]
        """The lowest score a point is listed with (SCORE_THRESHOLDS of the folder's model type, which
        `tool_model_folder` checked)."""

    def prepare(self, context: Any, box: Any = None, image: Any = 0) -> Prepared:
        """The image and the box checked (ValueError for a bad one); the call reads the whole image."""
        original = context_image(context, image)
        where = pixel_box([0, 0, *original.size] if box is None else box, *original.size)
        return self.prepared(context, (where,), None, image)

    def answer(self, call: Prepared, output: Any) -> tuple[str, Image.Image]:
        """The points of the runner's output for the call's crop (the whole image), listed and drawn."""
        [box] = call.args
        found = listed_points(output, call.where[:2], call.original.size, self.threshold)
        return (describe(found, box, call.image, call.original.size, self.threshold),
                overlay(call.original, found, box, tuple(output.edges), call.side))
