"""Offline computer-vision tools, built in, no weights: `find_objects` and `measure` (OpenCV).

A model that sees a downscaled view cannot count or measure small shapes exactly; these tools do it
on the ORIGINAL image (`ToolContext.images`, `Example.originals`), in its pixels, as `zoom` reads it:

    {"name": "find_objects", "arguments": {"colour": "blue", "box": [0, 0, 224, 224]}}
    {"name": "measure", "arguments": {"ids": [2, 5], "colour": "blue", "box": [0, 0, 224, 224]}}

`find_objects(colour=None, shape=None, box=None, image=0)`: the connected regions (8-connected) of
one colour of PALETTE, or of every chromatic colour (CHROMATIC) when none is named, inside `box`
(default: the whole image), each with an id, its box [x1, y1, x2, y2] in the original image's pixels
(x2, y2 exclusive: exactly the box `zoom` takes to show it), its area in pixels, and its shape class
(SHAPES, from the region's geometry: `shape_class`). Ids count from 1 in reading order (top edge,
then left edge, then colour): the same arguments always give the same ids, so a later call can name
them. It returns the list as text (at most MAX_LISTED lines, then how many more) AND the set-of-marks
image: the region, resized like zoom's output (longest side `ToolContext.max_side`), with each listed
region's box drawn and numbered.

`measure(ids=None, boxes=None, colour=None, shape=None, box=None, image=0)`: numbers, as text. Items
are regions named by the ids `find_objects` gave with the same colour, shape, box and image (it is
stateless: the regions are found again, the same way), then `boxes` (each box stands for itself).
For a region: area, box, centroid, the long and short side of its smallest rotated rectangle and the
angle of the long side; for a box: width, height, area, diagonal and centre; for every pair of items
(at most MAX_MEASURED items): the distance between their centres and the direction from the first
to the second. Without ids and boxes: the count and area statistics (total, smallest, median,
largest) of every region find_objects would list. Lengths are in original pixels; angles in
degrees counter-clockwise from the +x axis as the image is seen (y up on the screen).

Colours: a pixel belongs to the PALETTE colour nearest to it (RGB distance) when that distance is at
most COLOUR_TOLERANCE; anti-aliased edges blended with the background fall outside every colour and
belong to no region. PALETTE holds the colours the built-in tasks draw with (tasks/shapes.py's RGB:
tests/test_cv_tools.py holds the two equal) plus black, white and grey, which are found only when
named (they are the usual backgrounds and outlines).

Bad arguments (a box that is not 4 finite numbers or empty inside the image, a colour or shape the
tool does not know or given as a number, an id that is not among the regions, an image number out of
range, a box of more than MAX_PIXELS pixels or holding more than MAX_REGIONS regions) raise ValueError,
which `run_tool` turns into a "bad_arguments" error turn. Boxes mean what they mean for `zoom`:
they are read by image_tools' `pixel_box`, as zoom reads them. No torch here.

Repeated calls: the G completions of a group often ask the same colour of the same image, so each of
the two keeps its last CV_CACHE_SIZE answers (`find_objects.answer_cache`, `measure.answer_cache`:
cache.py's AnswerCache, one per process) keyed by the image's content, the arguments as written, and
for find_objects the overlay's side; a repeated call is computed once and each caller gets its own
copy of the image. The answers are the same with the cache as without it. A measure of boxes alone
(no regions to find: a fraction of a millisecond) is computed every time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vlmrl.tools.cache import CV_CACHE_SIZE, AnswerCache, argument_key, image_key
from vlmrl.tools.image_tools import context_image, fit_side, pixel_box

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 160, 70), "blue": (40, 70, 220), "yellow": (230, 190, 20),
    "purple": (140, 60, 190), "orange": (240, 130, 30), "black": (0, 0, 0), "white": (255, 255, 255),
    "grey": (128, 128, 128)}
"""Colour names the tools know, and their RGB; the first six are tasks/shapes.py's RGB."""
CHROMATIC = ("red", "green", "blue", "yellow", "purple", "orange")
"""The colours find_objects looks for when no colour is named (not the backgrounds)."""
ALIASES = {"gray": "grey", "violet": "purple"}
"""Other names of PALETTE colours."""
COLOUR_TOLERANCE = 130
"""Largest RGB distance from a pixel to its PALETTE colour: pure (0, 255, 0) is 124 from green; a pixel
nearer white or grey than to any chromatic colour (a pale tint, an anti-aliased edge) is never one."""
SHAPES = ("circle", "square", "rectangle", "triangle", "other")
"""Shape classes, `shape_class`."""
MIN_AREA = 5
"""Smallest region, in pixels, that counts (fewer: noise, specks of anti-aliasing)."""
MAX_LISTED = 30
"""Most regions listed in find_objects' text and drawn on its image; it says how many more there are."""
MAX_REGIONS = 2000
"""Most regions one call examines; a box holding more is refused (ask with a smaller box or a colour)."""
MAX_PIXELS = 4096 * 4096
"""Largest box, in pixels of the original, one call examines (its cost grows with the pixels)."""
MAX_MEASURED = 8
"""Most items (ids and boxes) one measure call takes; every pair of them is measured."""


def _cv2() -> Any:
    """OpenCV, imported on first use (a core dependency; importing it costs about 0.2 s, paid only by runs
    that call these tools)."""
    import cv2

    return cv2


# --------------------------------------------------------------------------- arguments


def _colours(colour: Any) -> tuple[str, ...]:
    """The PALETTE names to look for: CHROMATIC for None, else the one named (any case, ALIASES too)."""
    if colour is None:
        return CHROMATIC
    known = ", ".join(PALETTE)
    if not isinstance(colour, str):
        raise ValueError(f"colour must be a colour's name, one of {known}; got {colour!r}")
    name = colour.strip().lower()
    name = ALIASES.get(name, name)
    if name not in PALETTE:
        raise ValueError(f"unknown colour {colour!r}; known colours: {known}")
    return (name,)


def _shape(shape: Any) -> str | None:
    """The shape class asked for, or None for any."""
    if shape is None:
        return None
    name = shape.strip().lower() if isinstance(shape, str) else None
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {shape!r}")
    return name


# --------------------------------------------------------------------------- regions


@dataclass
class Region:
    """One connected region of one colour, in the original image's pixels."""

    colour: str
    box: tuple[int, int, int, int]
    """[x1, y1, x2, y2], x2 and y2 exclusive (the box zoom takes to show it)."""
    area: int
    centre: tuple[float, float]
    """The centroid (x, y) of its pixels, each pixel counted at its centre."""
    shape: str
    mask: np.ndarray
    """(y2 - y1, x2 - x1) bool: which pixels of its box are its own."""


LEVELS = 64
"""Levels per channel at which `colour_labels` reads a pixel (its table has LEVELS ** 3 entries)."""


@functools.lru_cache(maxsize=1)
def _nearest_table() -> np.ndarray:
    """(LEVELS ** 3,) int8: for each colour read to LEVELS levels a channel (the middle of its bin), the index
    in PALETTE's order of the nearest PALETTE colour within COLOUR_TOLERANCE, else -1. Made once (ms)."""
    step = 256 // LEVELS
    middles = np.arange(LEVELS, dtype=np.float32) * step + (step - 1) / 2  # (LEVELS,)
    grid = np.stack(np.meshgrid(middles, middles, middles, indexing="ij"), axis=-1).reshape(-1, 3)  # (L^3, 3)
    palette = np.array(list(PALETTE.values()), np.float32)  # (K, 3)
    distance = ((grid[:, None, :] - palette[None, :, :]) ** 2).sum(axis=2)  # (L^3, K)
    nearest = distance.argmin(axis=1)  # (L^3,)
    inside = distance[np.arange(len(grid)), nearest] <= COLOUR_TOLERANCE ** 2
    return np.where(inside, nearest, -1).astype(np.int8)


@functools.lru_cache(maxsize=64)
def _kept_table(names: tuple[str, ...]) -> np.ndarray:
    """(LEVELS ** 3,) int8: `_nearest_table` with every colour not in `names` read as -1."""
    keep = np.zeros(len(PALETTE) + 1, bool)  # index -1 reads the last entry: never kept
    keep[[list(PALETTE).index(name) for name in names]] = True
    nearest = _nearest_table()
    return np.where(keep[nearest], nearest, -1).astype(np.int8)


def colour_labels(pixels: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """(H, W) int8: for each pixel of `pixels` (H, W, 3) uint8, the index in PALETTE's order of its nearest
    PALETTE colour when that is one of `names` within COLOUR_TOLERANCE, else -1 (every PALETTE colour
    competes; the pixel is read to LEVELS levels a channel, through a table made once per `names`)."""
    bits = LEVELS.bit_length() - 1  # 6 bits a channel
    levels = pixels >> (8 - bits)  # (H, W, 3) uint8
    index = levels[..., 0].astype(np.int32) << (2 * bits)  # (H, W): one int32 array, not (H, W, 3) of them
    index |= levels[..., 1].astype(np.int32) << bits
    index |= levels[..., 2]
    return _kept_table(tuple(names))[index]


def shape_class(mask: np.ndarray) -> str:
    """The shape class of a region's `mask` (h, w) bool, from how much of a fitted figure it fills: its
    smallest rotated rectangle (>= 0.88: square when the sides are within 20%, else rectangle), its
    smallest enclosing circle (>= 0.8: circle), its smallest enclosing triangle (>= 0.85: triangle);
    else (two touching discs, a ring, a blob, fewer than 12 pixels) "other"."""
    cv2 = _cv2()
    area = int(mask.sum())
    if area < 12:
        return "other"
    padded = np.pad(mask, 1).astype(np.uint8)  # (h + 2, w + 2)
    contours, _ = cv2.findContours(padded, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    points = max(contours, key=len).astype(np.float32)  # (N, 1, 2), pixel centres
    # the outline through pixel centres misses half a pixel all round: grow the fitted figures by it
    (_, _), (side_a, side_b), _ = cv2.minAreaRect(points)
    if area / ((side_a + 1) * (side_b + 1)) >= 0.88:
        return "square" if max(side_a + 1, side_b + 1) <= 1.2 * min(side_a + 1, side_b + 1) else "rectangle"
    _, radius = cv2.minEnclosingCircle(points)
    if area / (math.pi * (radius + 0.5) ** 2) >= 0.8:
        return "circle"
    triangle_area, _ = cv2.minEnclosingTriangle(points)
    perimeter = cv2.arcLength(points, True)
    if area / (triangle_area + 0.5 * perimeter) >= 0.85:
        return "triangle"
    return "other"


def _components(labels: np.ndarray, index: int, origin: tuple[int, int], name: str) -> list[Region]:
    """The regions of colour number `index` in `labels` (the box's pixels), placed at `origin` (x, y)."""
    cv2 = _cv2()
    count, components, stats, centroids = cv2.connectedComponentsWithStats(
        (labels == index).astype(np.uint8), connectivity=8)
    regions = []
    for k in range(1, count):
        x, y, w, h, area = (int(v) for v in stats[k])
        if area < MIN_AREA:
            continue
        if len(regions) >= MAX_REGIONS:
            raise ValueError(f"the box holds more than {MAX_REGIONS} {name} regions; ask with a smaller box")
        mask = components[y:y + h, x:x + w] == k
        box = (origin[0] + x, origin[1] + y, origin[0] + x + w, origin[1] + y + h)
        centre = (origin[0] + float(centroids[k][0]) + 0.5, origin[1] + float(centroids[k][1]) + 0.5)
        regions.append(Region(name, box, area, centre, shape_class(mask), mask))
    return regions


def find_regions(original: Image.Image, colour: Any = None, shape: Any = None,
                 box: Any = None) -> tuple[list[Region], tuple[int, int, int, int]]:
    """(the regions of `colour` and `shape` inside `box` of `original`, in id order; the box in pixels).
    Ids are positions in the list + 1: reading order (top, left, then PALETTE's order of colours)."""
    names, wanted = _colours(colour), _shape(shape)
    width, height = original.size
    x1, y1, x2, y2 = pixel_box([0, 0, width, height] if box is None else box, width, height)
    if (x2 - x1) * (y2 - y1) > MAX_PIXELS:
        raise ValueError(f"box [{x1}, {y1}, {x2}, {y2}] holds {(x2 - x1) * (y2 - y1)} pixels; the limit is "
                         f"{MAX_PIXELS}: ask with a smaller box")
    pixels = np.asarray(original.crop((x1, y1, x2, y2)).convert("RGB"))  # (y2 - y1, x2 - x1, 3)
    labels = colour_labels(pixels, names)
    regions = [region for name in names
               for region in _components(labels, list(PALETTE).index(name), (x1, y1), name)]
    regions = [region for region in regions if wanted is None or region.shape == wanted]
    order = list(PALETTE)
    regions.sort(key=lambda r: (r.box[1], r.box[0], order.index(r.colour), r.box[3], r.box[2]))
    return regions, (x1, y1, x2, y2)


def _what(colour: Any, shape: Any) -> str:
    """"blue circle" / "region": what the call looked for, in words."""
    words = [] if colour is None else [_colours(colour)[0]]
    return " ".join(words + [shape.strip().lower() if shape is not None else "region"])


# --------------------------------------------------------------------------- find_objects


def marks(original: Image.Image, regions: list[Region], box: tuple[int, int, int, int], max_side: int) -> Image.Image:
    """The box of `original`, resized as zoom resizes (LANCZOS, longest side `max_side`), with each
    region's box drawn (black, 1 px outside the region) and its id on a white tag at its top-left."""
    x1, y1, x2, y2 = box
    scale = max_side / max(x2 - x1, y2 - y1)
    size = fit_side(x2 - x1, y2 - y1, max_side)
    shown = original.crop(box).convert("RGB").resize(size, Image.Resampling.LANCZOS)
    draw = ImageDraw.Draw(shown)
    font = ImageFont.load_default(size=max(10, max_side // 32))
    for number, region in enumerate(regions, start=1):
        a, b, c, d = ((v - o) * scale for v, o in zip(region.box, (x1, y1, x1, y1)))
        draw.rectangle((a - 1, b - 1, c, d), outline=(0, 0, 0), width=1)
        left, top, right, bottom = draw.textbbox((0, 0), str(number), font=font)
        tag_x = min(max(a - 1, 0), size[0] - (right - left) - 2)
        tag_y = b - 1 - (bottom - top) - 2 if b - 1 - (bottom - top) - 2 >= 0 else d + 1
        draw.rectangle((tag_x, tag_y, tag_x + right - left + 2, tag_y + bottom - top + 2), fill=(255, 255, 255),
                       outline=(0, 0, 0))
        draw.text((tag_x + 1 - left, tag_y + 1 - top), str(number), fill=(0, 0, 0), font=font)
    return shown


def find_objects(context: Any, colour: Any = None, shape: Any = None, box: Any = None, image: Any = 0) -> list:
    """The regions of `colour` (a PALETTE name; None: every CHROMATIC colour) and `shape` (a SHAPES class;
    None: any) inside `box` [x1, y1, x2, y2] (original pixels; None: the whole image) of image number
    `image`, as text (id, colour, shape, box in original pixels, area in pixels; at most MAX_LISTED) and
    the set-of-marks image (`marks`). ValueError for a bad argument (module docstring). A repeated call
    is answered from `find_objects.answer_cache`."""
    original = context_image(context, image)
    arguments = argument_key([colour, shape, box, image])
    key = None if arguments is None else (image_key(original), arguments, context.max_side)
    return find_objects.answer_cache.answer(  # type: ignore[attr-defined]
        key, lambda: _find_objects(original, colour, shape, box, image, context.max_side))


def _find_objects(original: Image.Image, colour: Any, shape: Any, box: Any, image: Any, max_side: int) -> list:
    """find_objects' answer, computed: [text, set-of-marks image of longest side `max_side`]."""
    regions, where = find_regions(original, colour, shape, box)
    listed = regions[:MAX_LISTED]
    head = (f"{len(regions)} {_what(colour, shape)}{'' if len(regions) == 1 else 's'} in box {list(where)} of "
            f"image {image} ({original.width}x{original.height}); boxes [x1, y1, x2, y2] and areas in the "
            f"original image's pixels")
    lines = [head] + [f"{n} {r.colour} {r.shape} box {list(r.box)} area {r.area}" for n, r in enumerate(listed, 1)]
    if len(regions) > len(listed):
        lines.append(f"... and {len(regions) - len(listed)} more (ids {len(listed) + 1} to {len(regions)}): "
                     "ask with a smaller box, a colour or a shape")
    return ["\n".join(lines), marks(original, listed, where, max_side)]


find_objects.answer_cache = AnswerCache(CV_CACHE_SIZE)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- measure


def _angle(dx: float, dy: float) -> float:
    """Degrees counter-clockwise from +x as the image is seen (image y grows downwards), in (-180, 180]."""
    degrees = math.degrees(math.atan2(-dy, dx))
    return 180.0 if degrees == -180.0 else degrees + 0.0


def _describe_region(label: str, region: Region) -> str:
    """A region's numbers: area, box, centroid, its rotated rectangle's long and short side and the
    long side's angle (in [0, 180))."""
    cv2 = _cv2()
    ys, xs = np.nonzero(region.mask)
    points = np.stack([xs, ys], axis=1).astype(np.float32)  # (area, 2)
    (_, _), (side_a, side_b), _ = cv2.minAreaRect(points)
    box_points = cv2.boxPoints(cv2.minAreaRect(points))  # (4, 2)
    edges = [box_points[(k + 1) % 4] - box_points[k] for k in range(2)]
    long_edge = max(edges, key=lambda e: float(np.hypot(*e)))
    angle = _angle(float(long_edge[0]), float(long_edge[1])) % 180.0
    long_side, short_side = max(side_a, side_b) + 1, min(side_a, side_b) + 1
    return (f"{label}: {region.colour} {region.shape}, area {region.area} px, box {list(region.box)}, "
            f"centre ({region.centre[0]:.1f}, {region.centre[1]:.1f}), length {long_side:.1f} px, "
            f"width {short_side:.1f} px, long side at {angle:.1f} deg")


def _describe_box(label: str, box: tuple[int, int, int, int]) -> str:
    """A box's numbers: width, height, area, diagonal and centre."""
    x1, y1, x2, y2 = box
    w, h = x2 - x1, y2 - y1
    return (f"{label}: box {list(box)}, width {w} px, height {h} px, area {w * h} px, "
            f"diagonal {math.hypot(w, h):.1f} px, centre ({(x1 + x2) / 2:.1f}, {(y1 + y2) / 2:.1f})")


def _items(original: Image.Image, ids: Any, boxes: Any, found: tuple[list[Region], Any]) -> list[tuple[str, Any]]:
    """(label, Region or box) for each id (in `found`'s regions) then each box; ValueError for a bad one."""
    regions, where = found
    id_list = [] if ids is None else ids if isinstance(ids, (list, tuple)) else [ids]
    box_list = [] if boxes is None else boxes
    if not isinstance(box_list, (list, tuple)) or (len(box_list) == 4 and not isinstance(box_list[0], (list, tuple))):
        box_list = [box_list]  # one box given bare: [x1, y1, x2, y2]
    if len(id_list) + len(box_list) > MAX_MEASURED:
        raise ValueError(f"measure takes at most {MAX_MEASURED} ids and boxes together; got "
                         f"{len(id_list) + len(box_list)}")
    items: list[tuple[str, Any]] = []
    for value in id_list:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= len(regions):
            raise ValueError(f"id {value!r} is not among the {len(regions)} regions find_objects lists with these "
                             f"arguments in box {list(where)} (ids 1 to {len(regions)}); ids are whole numbers")
        items.append((f"id {value}", regions[value - 1]))
    for value in box_list:
        items.append((f"box {len(items) + 1}", pixel_box(value, *original.size)))
    return items


def _summary(regions: list[Region], what: str, where: Any) -> str:
    """The count and area statistics of `regions`."""
    if not regions:
        return f"0 {what}s in box {list(where)}: nothing to measure"
    areas = sorted(r.area for r in regions)
    return (f"{len(regions)} {what}{'' if len(regions) == 1 else 's'} in box {list(where)}: total area {sum(areas)} px, "
            f"smallest {areas[0]} px, median {float(np.median(areas)):g} px, largest {areas[-1]} px")


def measure(context: Any, ids: Any = None, boxes: Any = None, colour: Any = None, shape: Any = None,
            box: Any = None, image: Any = 0) -> str:
    """Numbers, as text (module docstring): the regions `ids` (as find_objects numbers them with the same
    colour, shape, box and image) and the `boxes` (original pixels), each described, then every pair's
    distance between centres and direction; without ids and boxes, the count and area statistics of
    the regions. ValueError for a bad argument. A repeated call that finds regions is answered from
    `measure.answer_cache`."""
    original = context_image(context, image)
    arguments = argument_key([ids, boxes, colour, shape, box, image])
    finds = ids is not None or boxes is None  # else boxes alone: nothing worth keeping
    key = None if arguments is None or not finds else (image_key(original), arguments)
    return measure.answer_cache.answer(  # type: ignore[attr-defined]
        key, lambda: _measure(original, ids, boxes, colour, shape, box, image))


def _measure(original: Image.Image, ids: Any, boxes: Any, colour: Any, shape: Any, box: Any, image: Any) -> str:
    """measure's answer, computed (its text)."""
    _colours(colour), _shape(shape), box is None or pixel_box(box, *original.size)  # checked even when unused
    found = find_regions(original, colour, shape, box) if ids is not None or boxes is None else ([], None)
    if ids is None and boxes is None:
        return _summary(found[0], _what(colour, shape), found[1])
    items = _items(original, ids, boxes, found)
    if not items:
        raise ValueError("give ids (from find_objects) or boxes [x1, y1, x2, y2] to measure, or neither for "
                         "the area statistics")
    lines = [f"measured in image {image}'s original pixels; angles in degrees counter-clockwise from +x (right)"]
    centres = []
    for label, item in items:
        if isinstance(item, Region):
            lines.append(_describe_region(label, item))
            centres.append(item.centre)
        else:
            lines.append(_describe_box(label, item))
            centres.append(((item[0] + item[2]) / 2, (item[1] + item[3]) / 2))
    for a in range(len(items)):
        for b in range(a + 1, len(items)):
            dx, dy = centres[b][0] - centres[a][0], centres[b][1] - centres[a][1]
            lines.append(f"{items[a][0]} -> {items[b][0]}: distance {math.hypot(dx, dy):.1f} px, "
                         f"direction {_angle(dx, dy):.1f} deg")
    return "\n".join(lines)


measure.answer_cache = AnswerCache(CV_CACHE_SIZE)  # type: ignore[attr-defined]
