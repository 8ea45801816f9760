"""`grounding`: give the bounding box of one coloured shape in a synthetic scene.

A scene holds the target (a unique colour + kind, e.g. the blue square) and distractors that may
share its colour or its kind but never both, placed without overlap. The answer is
"[x1, y1, x2, y2]" in integer pixels of `example.image`, the image as delivered (x to the right, y
down, x2/y2 exclusive). A processor that resizes the image does not change these coordinates: the
prompt states the size the box refers to; `meta` holds the box as a list and the image size.

Reward: "iou" in [0, 1] between the single box inside <answer> and the gold box, plus
format_weight x "format" (1 when the completion has the strict <think>/<answer> layout and the
answer parses as exactly one box); total in [0, 1 + format_weight]. "accuracy" = 1 when IoU >= 0.5.
A box is parsed only when the answer holds exactly one `[a, b, c, d]` and no other number
(`vlmrl.rewards.verify.parse_box`), so stuffing many boxes or numbers scores 0. The target is at most
max_size of the side, so a box covering the whole image has IoU of about max_size**2 at most.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.rewards.verify import Rubric, extract_tag, iou, parse_box, think_answer_format
from vlmrl.tasks.shapes import KINDS, RGB, draw_shape, fits, place_squares

COLORS = tuple(RGB)


@dataclass
class GroundingParams(TaskParams):
    """Parameters of the grounding task."""

    image_size: int = 168
    """Side of the square image in pixels; boxes are in these pixels."""
    min_distractors: int = 2
    """Fewest other shapes in train and test scenes."""
    max_distractors: int = 4
    """Most other shapes in train and test scenes."""
    ood_min_distractors: int = 5
    """Fewest other shapes in the OOD split (must exceed max_distractors)."""
    ood_max_distractors: int = 7
    """Most other shapes in the OOD split."""
    min_size: float = 0.12
    """Smallest shape side as a fraction of the image side."""
    max_size: float = 0.22
    """Largest shape side as a fraction of the image side (keep it small: IoU of a whole-image box
    is about max_size squared at most)."""
    ood_size_scale: float = 0.75
    """In the OOD split every shape is this much smaller."""
    gap: int = 2
    """Least distance in pixels between two shapes (and from the border)."""
    format_weight: float = 0.5
    """Weight of the format component in the total."""

    def validate(self) -> None:
        super().validate()
        check(32 <= self.image_size <= 4096, f"image_size must be in 32..4096, got {self.image_size}")
        check(0 <= self.min_distractors <= self.max_distractors, "need 0 <= min_distractors <= "
              f"max_distractors, got {self.min_distractors}, {self.max_distractors}")
        check(self.max_distractors < self.ood_min_distractors <= self.ood_max_distractors,
              "need max_distractors < ood_min_distractors <= ood_max_distractors, got "
              f"{self.max_distractors}, {self.ood_min_distractors}, {self.ood_max_distractors}")
        check(0 < self.min_size <= self.max_size <= 0.5,
              f"need 0 < min_size <= max_size <= 0.5, got {self.min_size}, {self.max_size}")
        check(0 < self.ood_size_scale <= 1, f"ood_size_scale must be in (0, 1], got {self.ood_size_scale}")
        check(round(self.min_size * self.ood_size_scale * self.image_size) >= 4,
              "OOD shapes would be smaller than 4 pixels: raise min_size, ood_size_scale or image_size")
        check(self.gap >= 0, f"gap must be >= 0, got {self.gap}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        side = round(self.max_size * self.image_size)
        ood_side = round(self.max_size * self.ood_size_scale * self.image_size)
        check(fits(1 + self.max_distractors, side, self.gap, self.image_size)
              and fits(1 + self.ood_max_distractors, ood_side, self.gap, self.image_size),
              "the shapes do not fit the image with room to spare; lower the distractor counts or "
              "max_size, or raise image_size")


@register_task
class GroundingTask(Task):
    """Box one shape among distractors."""

    name = "grounding"
    description = "give [x1, y1, x2, y2] of e.g. the blue square among distractors; OOD: more, smaller shapes"
    Params = GroundingParams
    params: GroundingParams

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test", "ood")

    def _scene(self, rng: random.Random, split: str) -> list[tuple[str, str, int, int, int]]:
        """(color, kind, x, y, size) for each shape; the first is the target."""
        p = self.params
        ood = split == "ood"
        n = rng.randint(p.ood_min_distractors, p.ood_max_distractors) if ood else \
            rng.randint(p.min_distractors, p.max_distractors)
        target = (rng.choice(COLORS), rng.choice(KINDS))
        others = [(color, kind) for color in COLORS for kind in KINDS if (color, kind) != target]
        items = [target] + [rng.choice(others) for _ in range(n)]
        scale = p.ood_size_scale if ood else 1.0
        lo = round(p.min_size * scale * p.image_size)
        hi = max(lo, round(p.max_size * scale * p.image_size))
        sizes = [rng.randint(lo, hi) for _ in items]
        corners = place_squares(rng, sizes, p.image_size, p.gap)
        return [(c, k, x, y, s) for (c, k), (x, y), s in zip(items, corners, sizes)]

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            scene = self._scene(rng, split)
            if in_split(";".join(",".join(map(str, item)) for item in scene), split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no scene landed in the split")
        image = Image.new("RGB", (p.image_size, p.image_size), "white")
        draw = ImageDraw.Draw(image)
        for color, kind, x, y, size in reversed(scene):
            draw_shape(draw, kind, x, y, size, RGB[color])
        color, kind, x, y, size = scene[0]
        box = [x, y, x + size, y + size]
        answer = f"[{box[0]}, {box[1]}, {box[2]}, {box[3]}]"
        side = p.image_size
        prompt = (f"Give the bounding box of the {color} {kind} in the image as [x1, y1, x2, y2]: pixel "
                  f"coordinates in this {side}x{side} image, x from the left edge, y from the top edge. "
                  "Think inside <think> </think>, then write only the box inside <answer> </answer>.")
        reference = (f"<think> I find the {color} {kind}. Its left edge is at x={box[0]} and its right edge at "
                     f"x={box[2]}; its top edge is at y={box[1]} and its bottom edge at y={box[3]}. </think> "
                     f"<answer> {answer} </answer>")
        meta = {"idx": idx, "split": split, "target": f"{color} {kind}", "box": box,
                "image_size": [side, side], "n_distractors": len(scene) - 1,
                "shapes": [list(item) for item in scene]}
        return Example(image=image, prompt=prompt, answer=answer, meta=meta, reference_completion=reference)

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """iou in [0, 1] + format_weight * format; total in [0, 1 + format_weight]."""
        answer = extract_tag(completion, "answer")
        box = parse_box(answer) if answer is not None else None
        overlap = iou(box, example.meta["box"]) if box is not None else 0.0
        well_formed = float(box is not None and think_answer_format(completion) == 1.0)
        rubric = Rubric({"iou": 1.0, "format": self.params.format_weight})
        return rubric({"iou": overlap, "format": well_formed, "accuracy": float(overlap >= 0.5)})
