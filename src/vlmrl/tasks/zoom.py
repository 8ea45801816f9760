"""`zoom`: read a code too small to see until the model zooms in (issue 15, "thinking with images").

The original is an `image_size` x `image_size` picture (default 448), white, with a few large pale
shapes (distractors) and small coloured "tags": rectangles tag_min..tag_max pixels high (20..26)
with a code of `digits` digits (default 2, no leading zero) filling them. One tag has the colour the
question names (the target); `distractor_tags` others (default 2) have other colours and other
codes; tag colours are red, green, blue, yellow, purple by default (hues at least 40 degrees apart;
the downscaled view keeps each tag's hue). Nothing overlaps, and every tag has tag_max/2 pixels of
free space around it (so the reference zoom shows that tag alone). The model first sees the original
DOWNSCALED to `view_side` (default 112, box filter): `Example.images` = [the view], where tag
colours show but a 20-26 px tag is 5-7 px and its digits are blobs; `Example.originals` = [the
original], which the zoom tool (`vlmrl.tools`) reads. The prompt gives both sizes, names the tag
colour, shows the call

    <tool_call>
    {"name": "zoom", "arguments": {"box": [x1, y1, x2, y2]}}
    </tool_call>

with the box in ORIGINAL pixels, and asks for the code inside <answer> </answer>.

Reference (SFT) convention: the reference trajectory is two assistant turns with the tool's result
between them. `meta["reference_turns"]` holds the assistant texts in order: first the call
("<think>The red tag is near the top left.</think>" + newline + the call above, with the target's
box padded by half the tag height, kept inside the image), then the final answer
("<think>The red tag reads 47.</think> <answer>47</answer>"), which is also
`reference_completion`. The SFT code runs the tool on the call to get the image between the turns.

Layout "panels" (`layout`, what `vlmrl demo --preset zoom` uses): the original is a 2 x 2 board of
panels shaded from white to grey (`PANEL_SHADES`, top left, top right, bottom left, bottom right),
each tag alone in its own panel, no shapes. A panel's shade tells where a tag is from the tag's
own surroundings, for a model whose image features carry colour but no position (the random-weight
vision tower of the offline model; its language model sees positions only through rotary phases).
Measured on the offline model it was not enough: 125-300 SFT steps never found the named tag's
panel (zoom credit at chance), hence `hint`. The reference call zooms on the target's whole panel
(`zoom_window` 0, 2, 6 or 8, or the panel's box), shown at `tool_image_side / (image_size / 2)` of
the original's scale; pick tag sizes readable there and not in the view (`code_size` < 1 makes the
tag a large card around small digits). `instructions=false` shortens the prompt to the question,
`hint=true` adds where the tag is (see the fields).

Codes of patterns (`symbols="patterns"`, what the demo uses): a tag is `digits` square patches side
by side, each filled with one of PATTERNS (lines across, lines down, a checkerboard, lines at 45
degrees) in the tag's colour on white, stripes half a view pixel wide (period image_size /
view_side), every tag on the view's pixel grid. The box filter averages each period x period block
to the same half tint, so the view is the same image whatever the codes (tested), while a zoom
shows the lines. The answer names the patterns left to right ("checkered", "vertical diagonal"),
case and spacing ignored. On the offline model the patterns are read from the zoom at 97% after
75 SFT steps, where a 1-digit code stayed at chance through 200: the random vision tower's pooled
features separate the patterns linearly (a ridge probe: 100%), not the digits (14%, chance 11%).

Splits: a candidate belongs to "test" when a stable hash of (code, colour, the target's centre cell
on a 4 x 4 grid of the original) falls below 0.5 (`content_key`, `base.in_split`), else to "train":
a test example never repeats a train example's code in the same colour and place. "ood": codes of
`ood_digits` digits (default 3) or patterns, a longer code than training ever shows.

Rewards (components in [0, 1] unless said):

- `score(example, text)`, a plain final text: "accuracy" (1 iff the single <answer> holds exactly
  the code, whitespace around ignored; patterns: the names in order, case and spacing ignored) +
  format_weight (0.5) x "format" (the strict <think>/<answer> layout with an answer of ASCII digits
  only; patterns: of pattern names only). Total in [0, 1 + format_weight].
- `score_trajectory(example, trajectory)`, a tool-using rollout: accuracy and format as above on
  `trajectory.final_text`, + zoom_weight (0.5) x "zoom" (1 when some call that ran without error
  zoomed on a box which, clipped to the original, covers at least min_cover (0.9) of the target
  tag's box and at most max_zoom_area (1/4) of the original), - "charge" = call_cost (0.1) x (calls
  beyond the first free_calls (2) + calls that failed, `trajectory.errors`), capped at max_charge
  (1.0). Also reported, outside the total: "calls" and "errors" (counts). Total in
  [-max_charge, 1 + format_weight + zoom_weight] = [-1, 2] by default, finite for any trajectory
  (no turns, garbage calls, boxes of strings or huge numbers).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.rewards.verify import Rubric, extract_tag, think_answer_format
from vlmrl.tasks.shapes import KINDS, MAX_FILL, RGB, draw_shape, place_squares
from vlmrl.tools.image_tools import WINDOW_GRID, window_box
from vlmrl.tools.trajectory import Trajectory

ZOOM_TOOLS = ("zoom", "crop", "zoom_window")
"""Tool names whose calls count as zooming (`crop` is the tool's alias)."""
SHAPE_SIZES = (0.15, 0.3)
"""Side of a large distractor shape as a fraction of the image side (smallest, largest)."""
PALE = 0.75
"""Distractor shapes are a tag colour mixed with this much white (never mistaken for a tag)."""
GRID = 4
"""The target's centre cell on a GRID x GRID grid is part of the split key."""
PANEL_SHADES = (255, 224, 192, 160)
"""Grey level of each panel of the "panels" layout: top left, top right, bottom left, bottom right."""
PANEL_NAMES = ("top left", "top right", "bottom left", "bottom right")
PATTERNS = ("horizontal", "vertical", "checkered", "diagonal")
"""The patterns of `symbols="patterns"`: lines across, lines down, a checkerboard, lines at 45 degrees."""
SYMBOLS = ("digits", "patterns")
_DIGITS = re.compile(r"[0-9]+")
_ROWS, _COLUMNS = ("top", "middle", "bottom"), ("left", "centre", "right")
LAYOUTS = ("free", "panels")


@functools.lru_cache(maxsize=64)
def tag_font(height: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """The font of a tag `height` pixels high: digits about 0.7 of the height."""
    return ImageFont.load_default(size=height)


def code_font_size(height: int, code_size: float) -> int:
    """Font size of the code on a tag `height` pixels high (`ZoomParams.code_size`)."""
    return max(1, round(code_size * height))


def tag_width(n_digits: int, height: int, code_size: float = 1.0, symbols: str = "digits") -> int:
    """Width in pixels of a tag `height` high holding `n_digits` digits: the digits plus a margin of a
    quarter of their font size on each side, and at least `height` (a square card around small digits).
    With symbols="patterns": `n_digits` square patches side by side."""
    if symbols == "patterns":
        return n_digits * height
    size = code_font_size(height, code_size)
    return max(height, math.ceil(tag_font(size).getlength("0" * n_digits)) + 2 * max(2, round(0.25 * size)))


def pattern_mask(pattern: str, width: int, height: int, period: int) -> np.ndarray:
    """(height, width) bool, True where a patch of `pattern` (PATTERNS) has its colour: stripes
    period/2 pixels wide, so that every period x period block, wherever it starts, is half coloured."""
    v, u = np.mgrid[0:height, 0:width]  # (height, width) each: row and column of every pixel
    half = period // 2
    phase = {"horizontal": v // half, "vertical": u // half, "checkered": u // half + v // half,
             "diagonal": (u + v) // half}[pattern]
    return phase % 2 == 0


def on_grid(rng: random.Random, lo: int, hi: int, grid: int) -> int:
    """A random whole multiple of `grid` in [lo, hi] (for grid 1, exactly rng.randint(lo, hi))."""
    return grid * rng.randint(-(-lo // grid), hi // grid)


def text_color(color: str) -> tuple[int, int, int]:
    """Black digits on a light tag (yellow, orange), white on a dark one."""
    r, g, b = RGB[color]
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 150 else (255, 255, 255)


def pale(color: str) -> tuple[int, int, int]:
    """`color` mixed with PALE white."""
    return tuple(round(PALE * 255 + (1 - PALE) * c) for c in RGB[color])  # type: ignore[return-value]


def content_key(code: str, color: str, box: list[int], side: int) -> str:
    """What the split hashes: the code, its colour and the cell of the tag's centre."""
    col = min(GRID - 1, (box[0] + box[2]) * GRID // (2 * side))
    row = min(GRID - 1, (box[1] + box[3]) * GRID // (2 * side))
    return f"{code}|{color}|{col},{row}"


def where(box: list[int], side: int) -> str:
    """Where a box's centre is, in words: "top left", "centre", "bottom", ..."""
    col = _COLUMNS[min(2, (box[0] + box[2]) * 3 // (2 * side))]
    row = _ROWS[min(2, (box[1] + box[3]) * 3 // (2 * side))]
    if row == "middle":
        return "centre" if col == "centre" else col
    return row if col == "centre" else f"{row} {col}"


def call_text(box: list[int]) -> str:
    """The zoom call on `box`, in Qwen's native format."""
    return "<tool_call>\n" + json.dumps({"name": "zoom", "arguments": {"box": box}}) + "\n</tool_call>"


def window_call_text(window: int) -> str:
    """The coarse zoom call on window number `window` (vlmrl.tools.zoom_window)."""
    return "<tool_call>\n" + json.dumps({"name": "zoom_window", "arguments": {"window": window}}) + "\n</tool_call>"


def panel_of(box: list[int], side: int) -> int:
    """The panel (0..3: top left, top right, bottom left, bottom right) holding `box`'s centre."""
    col = min(1, (box[0] + box[2]) // side)
    row = min(1, (box[1] + box[3]) // side)
    return 2 * row + col


def panel_box(panel: int, side: int) -> list[int]:
    """Box [x1, y1, x2, y2] of panel `panel` (0..3) of a `side` x `side` board."""
    half = side // 2
    row, col = divmod(panel, 2)
    return [col * half, row * half, side if col else half, side if row else half]


def panel_window(panel: int) -> int:
    """The zoom_window number (0..8) that is panel `panel` (0..3): the corner windows 0, 2, 6, 8."""
    row, col = divmod(panel, 2)
    return 2 * WINDOW_GRID * row + 2 * col


def best_window(box: list[int], side: int) -> int:
    """The window (0..8) that holds `box` whole with its centre nearest the box's centre."""
    inside = [w for w in range(WINDOW_GRID ** 2) if _holds(window_box(side, side, w), box)]
    centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)

    def distance(w: int) -> float:
        x1, y1, x2, y2 = window_box(side, side, w)
        return ((x1 + x2) / 2 - centre[0]) ** 2 + ((y1 + y2) / 2 - centre[1]) ** 2

    return min(inside, key=distance)


def _holds(outer: list[float], inner: list[int]) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and inner[2] <= outer[2] and inner[3] <= outer[3]


def padded(box: list[int], pad: int, side: int) -> list[int]:
    """`box` grown by `pad` on every side, kept inside a `side` x `side` image."""
    return [max(0, box[0] - pad), max(0, box[1] - pad), min(side, box[2] + pad), min(side, box[3] + pad)]


def number(value: Any) -> float | None:
    """`value` as a finite float when it is an int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        result = float(value)
    except OverflowError:
        return None
    return result if math.isfinite(result) else None


def zoom_box(call: Any, side: int) -> tuple[float, float, float, float] | None:
    """The box of a zoom, crop or zoom_window call on the first image (`side` x `side` pixels), or
    None for any other call or argument."""
    if getattr(call, "name", None) not in ZOOM_TOOLS:
        return None
    arguments = getattr(call, "arguments", None)
    if not isinstance(arguments, dict):
        return None
    image = arguments.get("image", 0)
    if not (type(image) is int and image == 0):
        return None
    if call.name == "zoom_window":
        window = arguments.get("window")
        if type(window) is not int or not 0 <= window < WINDOW_GRID ** 2:
            return None
        return tuple(window_box(side, side, window))
    box = arguments.get("box")
    if not isinstance(box, (list, tuple)) or len(box) != 4:
        return None
    values = tuple(number(v) for v in box)
    if any(v is None for v in values):
        return None
    return values  # type: ignore[return-value]


def covers(zoom: tuple[float, float, float, float], target: list[int], side: int,
           max_area: float, min_cover: float) -> bool:
    """Whether `zoom`, clipped to the image, holds at least `min_cover` of the target box's area
    while covering at most `max_area` of the image's."""
    x1, y1 = min(max(zoom[0], 0.0), side), min(max(zoom[1], 0.0), side)
    x2, y2 = min(max(zoom[2], 0.0), side), min(max(zoom[3], 0.0), side)
    if x2 <= x1 or y2 <= y1 or (x2 - x1) * (y2 - y1) > max_area * side * side:
        return False
    tx1, ty1, tx2, ty2 = target
    inter = max(0.0, min(x2, tx2) - max(x1, tx1)) * max(0.0, min(y2, ty2) - max(y1, ty1))
    return inter >= min_cover * (tx2 - tx1) * (ty2 - ty1)


def turns_of(trajectory: Any) -> list[Any]:
    """The trajectory's turns as a list (none when it has no list of turns)."""
    turns = getattr(trajectory, "turns", None)
    return list(turns) if isinstance(turns, (list, tuple)) else []


def final_text(turns: list[Any]) -> str:
    """The last assistant turn's text ("" when there is none or it is not text)."""
    for turn in reversed(turns):
        if getattr(turn, "role", None) == "assistant":
            text = getattr(turn, "text", "")
            return text if isinstance(text, str) else ""
    return ""


def tool_use(turns: list[Any], target: list[int], side: int, params: ZoomParams) -> tuple[int, int, bool]:
    """(parsed calls, failed calls, whether a call that ran without error zoomed on the target)."""
    calls = errors = 0
    zoomed = False
    for i, turn in enumerate(turns):
        if getattr(turn, "role", None) == "tool" and getattr(turn, "error", None) is not None:
            errors += 1
        call = getattr(turn, "call", None)
        if call is None:
            continue
        calls += 1
        after = turns[i + 1] if i + 1 < len(turns) else None
        ran = getattr(after, "role", None) == "tool" and getattr(after, "error", None) is None
        box = zoom_box(call, side) if ran else None
        zoomed = zoomed or (box is not None and covers(box, target, side, params.max_zoom_area, params.min_cover))
    return calls, errors, zoomed


@dataclass
class ZoomParams(TaskParams):
    """Parameters of the zoom task."""

    image_size: int = 448
    """Side of the square original in pixels; zoom boxes are in these pixels."""
    view_side: int = 112
    """Side of the downscaled view the model first sees."""
    digits: int = 2
    """Digits of a code in train and test (no leading zero); with symbols="patterns", patterns."""
    ood_digits: int = 3
    """Digits (patterns) of a code in the OOD split (must differ from digits)."""
    symbols: str = "digits"
    """What a code is made of: "digits" printed on the tag, or "patterns": the tag is `digits` square
    patches side by side, each one of PATTERNS in the tag's colour on white, stripes half a view pixel
    wide (period image_size / view_side, a whole even number), tags on the view's pixel grid. The
    view's box filter then turns every patch into the same flat tint: the view does not depend on
    the code at all, and a zoom shows it plainly. The answer names the patterns left to right."""
    distractor_tags: int = 2
    """Tags of other colours with other codes."""
    distractor_shapes: int = 3
    """Large pale shapes drawn around the tags."""
    tag_min: int = 20
    """Smallest tag height in original pixels."""
    tag_max: int = 26
    """Largest tag height in original pixels."""
    code_size: float = 1.0
    """Font size of the code as a share of the tag height (the digits are ~0.7 of the font size):
    1 fills the tag; smaller makes the tag a larger coloured card around small digits, easy to find
    in the view and still unreadable there (the demo: 0.45)."""
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple")
    """Tag colours (the target's and the distractor tags' are distinct). Orange is left out by
    default: its hue is only 20 degrees from red's and yellow's, too close in a 5-pixel blob."""
    gap: int = 4
    """Least distance in pixels between two things drawn (and from the border)."""
    layout: str = "free"
    """Where the tags go: "free" (anywhere among the large pale shapes) or "panels" (each tag alone in
    one panel of a 2 x 2 board shaded from white to grey, no shapes; needs distractor_tags <= 3 and
    distractor_shapes = 0). See the module docstring."""
    instructions: bool = True
    """Whether the prompt explains the view, the zoom call (with an example) and the answer format;
    False: it only names the tag ("Read the 1-digit code of the red tag."), for a model that learns
    the call by SFT (the offline demo: a prompt a sixth as long makes each SFT step ~2x cheaper)."""
    hint: bool = False
    """Whether the question also says where the tag is ("the red tag, in the top left panel,"): the
    model then needs the zoom to read the code but not to find the tag (the offline demo, whose
    random-weight model does not learn to find it; see the module docstring)."""
    call_style: str = "box"
    """How the prompt and the reference zoom: "box" (zoom on [x1, y1, x2, y2] in original pixels) or
    "window" (zoom_window on one of 9 overlapping windows, a choice rather than four coordinates:
    easier for a small model; the run needs rollout.tools=[zoom_window])."""
    format_weight: float = 0.5
    """Weight of the format component in the total."""
    zoom_weight: float = 0.5
    """Weight of the zoom component in a trajectory's total."""
    call_cost: float = 0.1
    """Charge per call beyond free_calls and per failed call."""
    free_calls: int = 2
    """Calls a trajectory makes before each further one is charged."""
    max_charge: float = 1.0
    """Largest total charge of one trajectory."""
    max_zoom_area: float = 0.25
    """A zoom box covering more than this share of the original earns no zoom credit."""
    min_cover: float = 0.9
    """Share of the target tag's box a zoom box must cover to earn the zoom credit."""

    def validate(self) -> None:
        super().validate()
        check(64 <= self.image_size <= 4096, f"image_size must be in 64..4096, got {self.image_size}")
        check(8 <= self.view_side <= self.image_size, f"need 8 <= view_side <= image_size, got {self.view_side}")
        check(1 <= self.digits <= 6 and 1 <= self.ood_digits <= 6 and self.digits != self.ood_digits,
              f"need digits and ood_digits in 1..6 and different, got {self.digits}, {self.ood_digits}")
        check(self.symbols in SYMBOLS, f"symbols must be one of {', '.join(SYMBOLS)}, got {self.symbols!r}")
        distinct = len(set(self.colors)) == len(self.colors) and all(c in RGB for c in self.colors)
        check(distinct and 0 <= self.distractor_tags < len(self.colors), "colors must be distinct names from "
              f"{', '.join(RGB)}, more than distractor_tags={self.distractor_tags}; got {self.colors!r}")
        check(self.distractor_shapes >= 0, f"distractor_shapes must be >= 0, got {self.distractor_shapes}")
        check(8 <= self.tag_min <= self.tag_max <= self.image_size,  # a taller tag fits no image (nor a font)
              f"need 8 <= tag_min <= tag_max <= image_size, got {self.tag_min}, {self.tag_max}")
        check(0.1 <= self.code_size <= 1, f"code_size must be in 0.1..1, got {self.code_size}")
        check(self.gap >= 0, f"gap must be >= 0, got {self.gap}")
        check(self.layout in LAYOUTS, f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        check(self.call_style in ("box", "window"), f"call_style must be box or window, got {self.call_style!r}")
        if self.symbols == "patterns":
            self._validate_patterns()
        self._validate_rewards()
        self._validate_fit()

    @property
    def grid(self) -> int:
        """Pixels of the original per view pixel when tags sit on the view's grid (patterns), else 1."""
        return self.image_size // self.view_side if self.symbols == "patterns" else 1

    def _validate_patterns(self) -> None:
        ratio = self.image_size // self.view_side
        check(self.image_size % self.view_side == 0 and ratio % 2 == 0, "symbols=patterns draws stripes half a "
              "view pixel wide: image_size must be view_side times an even number, got "
              f"{self.image_size} and {self.view_side}")
        check(self.tag_min >= ratio and (self.layout == "panels" or self.tag_max // 2 >= ratio),
              f"symbols=patterns puts tags on the view's {ratio} px grid: need tag_min >= {ratio} (and, in the "
              f"free layout, tag_max >= {2 * ratio}), got {self.tag_min}, {self.tag_max}")
        codes = len(PATTERNS) ** min(self.digits, self.ood_digits)
        check(1 + self.distractor_tags <= codes, f"{codes} codes of {min(self.digits, self.ood_digits)} "
              f"pattern(s) cannot tell {1 + self.distractor_tags} tags apart; lower distractor_tags")

    def _validate_rewards(self) -> None:
        weights = (self.format_weight, self.zoom_weight, self.call_cost, self.max_charge)
        check(all(w >= 0 for w in weights), "format_weight, zoom_weight, call_cost and max_charge must be "
              f">= 0, got {weights}")
        check(self.free_calls >= 0, f"free_calls must be >= 0, got {self.free_calls}")
        check(0 < self.max_zoom_area <= 1 and 0 < self.min_cover <= 1,
              f"max_zoom_area and min_cover must be in (0, 1], got {self.max_zoom_area}, {self.min_cover}")

    def _validate_fit(self) -> None:
        side = self.image_size
        tag = tag_width(max(self.digits, self.ood_digits), self.tag_max, self.code_size, self.symbols)
        if self.layout == "panels":
            check(self.distractor_tags <= 3 and self.distractor_shapes == 0, "layout=panels puts each tag in "
                  "its own of 4 panels and draws no shapes: need distractor_tags <= 3 and distractor_shapes=0, "
                  f"got {self.distractor_tags} and {self.distractor_shapes}")
            check(max(tag, self.tag_max) + 2 * self.gap <= side // 2, f"a tag ({tag} x {self.tag_max} px) "
                  f"does not fit a {side // 2} px panel with gap {self.gap}; lower tag_max or raise image_size")
            return
        used = self.distractor_shapes * (round(SHAPE_SIZES[1] * side) + self.gap) ** 2
        used += (1 + self.distractor_tags) * (tag + 2 * (self.tag_max // 2) + self.gap) ** 2
        wide = (f" (with symbols=patterns a tag is {max(self.digits, self.ood_digits)} squares wide: lower digits or "
                "ood_digits)" if self.symbols == "patterns" else "")
        check(used <= MAX_FILL * side * side, "the shapes and tags do not fit the image with room to spare; "
              f"lower distractor_shapes, distractor_tags or tag_max, or raise image_size{wide}")


@register_task
class ZoomTask(Task):
    """Read the code of one small coloured tag in a downscaled view, by zooming on the original."""

    name = "zoom"
    description = ("read the code of a small coloured tag, unreadable in the downscaled view (112 px): zoom on "
                   "the original (448 px) with a tool call; OOD: 3-digit codes instead of 2")
    Params = ZoomParams
    params: ZoomParams

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test", "ood")

    def _layout(self, rng: random.Random, split: str) -> tuple[list[list[Any]], list[list[Any]]]:
        """(tags, shapes): tags as [color, code, x1, y1, x2, y2], the target first; shapes as
        [kind, color, x, y, size]."""
        p = self.params
        n = p.ood_digits if split == "ood" else p.digits
        count = 1 + p.distractor_tags
        colors = rng.sample(p.colors, count)
        if p.symbols == "patterns":
            codes = [" ".join(c) for c in rng.sample(list(itertools.product(PATTERNS, repeat=n)), count)]
        else:
            codes = [str(c) for c in rng.sample(range(10 ** (n - 1), 10 ** n), count)]
        heights = [h - h % p.grid for h in (rng.randint(p.tag_min, p.tag_max) for _ in range(count))]
        widths = [tag_width(n, h, p.code_size, p.symbols) for h in heights]
        if p.layout == "panels":
            return self._panel_tags(rng, colors, codes, widths, heights), []
        kinds = [rng.choice(KINDS) for _ in range(p.distractor_shapes)]
        tints = [rng.choice(tuple(RGB)) for _ in kinds]
        lo, hi = round(SHAPE_SIZES[0] * p.image_size), round(SHAPE_SIZES[1] * p.image_size)
        sizes = [rng.randint(lo, hi) for _ in kinds]
        # Each tag sits in the middle of a free square slot, tag_max // 2 wider on every side.
        slots = [max(w, h) + 2 * (p.tag_max // 2) for w, h in zip(widths, heights)]
        corners = place_squares(rng, sizes + slots, p.image_size, p.gap)
        shapes = [[k, t, x, y, s] for k, t, (x, y), s in zip(kinds, tints, corners, sizes)]
        tags = []
        for c, code, (x, y), slot, w, h in zip(colors, codes, corners[len(sizes):], slots, widths, heights):
            x1, y1 = x + (slot - w) // 2, y + (slot - h) // 2
            x1, y1 = x1 - x1 % p.grid, y1 - y1 % p.grid  # on the view's grid (patterns), within the slot
            tags.append([c, code, x1, y1, x1 + w, y1 + h])
        return tags, shapes

    def _panel_tags(self, rng: random.Random, colors: list[str], codes: list[str], widths: list[int],
                    heights: list[int]) -> list[list[Any]]:
        """Tags of the "panels" layout: each in its own panel, anywhere inside it `gap` from its edges."""
        p, tags = self.params, []
        for color, code, w, h, panel in zip(colors, codes, widths, heights, rng.sample(range(4), len(colors))):
            x0, y0, x1, y1 = panel_box(panel, p.image_size)
            x, y = on_grid(rng, x0 + p.gap, x1 - p.gap - w, p.grid), on_grid(rng, y0 + p.gap, y1 - p.gap - h, p.grid)
            tags.append([color, code, x, y, x + w, y + h])
        return tags

    def _draw(self, tags: list[list[Any]], shapes: list[list[Any]]) -> Image.Image:
        """The full-resolution original."""
        side = self.params.image_size
        image = Image.new("RGB", (side, side), "white")
        draw = ImageDraw.Draw(image)
        if self.params.layout == "panels":
            for panel, shade in enumerate(PANEL_SHADES):
                x1, y1, x2, y2 = panel_box(panel, side)
                draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=(shade, shade, shade))
        for kind, tint, x, y, size in shapes:
            draw_shape(draw, kind, x, y, size, pale(tint))
        for color, code, x1, y1, x2, y2 in tags:
            if self.params.symbols == "patterns":
                image.paste(self._patterned(color, code.split(), y2 - y1), (x1, y1))
                continue
            draw.rectangle((x1, y1, x2 - 1, y2 - 1), fill=RGB[color])
            draw.text(((x1 + x2) / 2, (y1 + y2) / 2), code,
                      font=tag_font(code_font_size(y2 - y1, self.params.code_size)), fill=text_color(color),
                      anchor="mm")
        return image

    def _patterned(self, color: str, patterns: list[str], height: int) -> Image.Image:
        """A tag of `patterns` (square patches left to right) in `color` on white."""
        period = self.params.image_size // self.params.view_side
        mask = np.concatenate([pattern_mask(name, height, height, period) for name in patterns], axis=1)  # (h, n*h)
        pixels = np.where(mask[..., None], np.array(RGB[color], dtype=np.uint8), np.uint8(255))  # (h, n*h, 3)
        return Image.fromarray(pixels, "RGB")

    def _texts(self, color: str, code: str, box: list[int]) -> tuple[str, list[str]]:
        """The prompt and the reference assistant turns (the call, then the answer)."""
        verb = "shows" if self.params.symbols == "patterns" else "reads"
        turns = [f"<think>{self._location(color, box)}</think>\n{self._reference_call(box)}",
                 f"<think>The {color} tag {verb} {code}.</think> <answer>{code}</answer>"]
        return self._prompt(color, code, box), turns

    def _prompt(self, color: str, code: str, box: list[int]) -> str:
        """The question: the full instructions, or only the tag (`instructions`), with its place (`hint`)."""
        p = self.params
        n, patterns = len(code.split()), p.symbols == "patterns"
        if not p.instructions:
            place = f", {self._place(box)}" if p.hint else ""
            if patterns:
                return f"Name the {'pattern' if n == 1 else f'{n} patterns, left to right,'} of the {color} tag{place}."
            return f"Read the {len(code)}-digit code of the {color} tag{place}."
        side, view, half = p.image_size, p.view_side, p.image_size // 2
        how = (f"Zoom in with a box in pixels of the {side}x{side} image, e.g. its top-left quarter:\n"
               f"{call_text([0, 0, half, half])}" if p.call_style == "box" else
               "Zoom in on one of 9 overlapping windows (0-8, rows of 3 from the top left), e.g. the centre:\n"
               f"{window_call_text(4)}")
        place = f", {self._place(box)}," if p.hint else " in it"
        if patterns:
            what = (f"is filled with {'a pattern' if n == 1 else f'{n} patterns side by side'} "
                    f"({', '.join(PATTERNS[:-1])} or {PATTERNS[-1]}), too fine to see here")
            give = f"the pattern{'s, left to right,' if n > 1 else ''}"
        else:
            what, give = f"holds a {len(code)}-digit code, too small to read here", "the code"
        return (f"This picture is a {view}x{view} downscaled view of a {side}x{side} image. A small {color} "
                f"tag{place} {what}. {how}\nThink inside <think> </think>, then give {give} inside <answer> </answer>.")

    def _place(self, box: list[int]) -> str:
        """Where the target is, in words: "in the top left panel" (panels) or "near the top left"."""
        side = self.params.image_size
        if self.params.layout == "panels":
            return f"in the {PANEL_NAMES[panel_of(box, side)]} panel"
        return f"near the {where(box, side)}"

    def _location(self, color: str, box: list[int]) -> str:
        """Where the reference's first turn says the target is."""
        return f"The {color} tag is {self._place(box)}."

    def _reference_call(self, box: list[int]) -> str:
        """The reference zoom: the target padded by half its height (free layout) or its panel (panels)."""
        p, side = self.params, self.params.image_size
        if p.layout == "panels":
            panel = panel_of(box, side)
            return call_text(panel_box(panel, side)) if p.call_style == "box" else window_call_text(panel_window(panel))
        return call_text(padded(box, (box[3] - box[1]) // 2, side)) if p.call_style == "box" else \
            window_call_text(best_window(box, side))

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            tags, shapes = self._layout(rng, split)
            color, code, *box = tags[0]
            if in_split(content_key(code, color, box, p.image_size), split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no layout landed in the split")
        original = self._draw(tags, shapes)
        view = original.resize((p.view_side, p.view_side), Image.Resampling.BOX)
        prompt, turns = self._texts(color, code, box)
        meta = {"idx": idx, "split": split, "box": box, "code": code, "color": color,
                "distractors": [{"color": c, "code": k, "box": b} for c, k, *b in tags[1:]],
                "shapes": shapes, "view_side": p.view_side, "image_size": [p.view_side, p.view_side],
                "original_size": [p.image_size, p.image_size], "reference_turns": turns}
        return Example(images=[view], originals=[original], prompt=prompt, answer=code, meta=meta,
                       reference_completion=turns[-1])

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy + format_weight * format; total in [0, 1 + format_weight]. See the module docstring."""
        answer = extract_tag(completion, "answer")
        if self.params.symbols == "patterns":
            words = [] if answer is None else answer.lower().split()
            exact = " ".join(words) == example.meta["code"]
            symbols = bool(words) and all(word in PATTERNS for word in words)
        else:
            exact = answer is not None and answer == example.meta["code"]
            symbols = answer is not None and _DIGITS.fullmatch(answer) is not None
        well_formed = float(symbols and think_answer_format(completion) == 1.0)
        return Rubric({"accuracy": 1.0, "format": self.params.format_weight})(
            {"accuracy": float(exact), "format": well_formed})

    def score_trajectory(self, example: Example, trajectory: Trajectory) -> dict[str, float]:
        """score() of the final text + zoom_weight * zoom - charge; total in
        [-max_charge, 1 + format_weight + zoom_weight]. See the module docstring."""
        p = self.params
        turns = turns_of(trajectory)
        scores = self.score(example, final_text(turns))
        calls, errors, zoomed = tool_use(turns, example.meta["box"], example.meta["original_size"][0], p)
        charge = min(p.max_charge, p.call_cost * (max(0, calls - p.free_calls) + errors))
        rubric = Rubric({"accuracy": 1.0, "format": p.format_weight, "zoom": p.zoom_weight, "charge": -1.0})
        return rubric({"accuracy": scores["accuracy"], "format": scores["format"], "zoom": float(zoomed),
                       "charge": charge, "calls": float(calls), "errors": float(errors)})
