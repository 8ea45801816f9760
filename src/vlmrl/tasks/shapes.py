"""`shapes`: count the red triangles, blue circles or green squares in a synthetic image.

The shape-counting task of the chapter: each image holds min_count..max_count of every kind (the
OOD split has ood_min..ood_max of the kind asked about), placed without overlap so every shape
stays countable. Two rubrics:

- `chapter` (total in [0, 1.7]): +1.0 "correct" when the last number in the completion is the count,
  +0.5 "describes_shape" when it names the target by a keyword (circle/circles/circular/round/blue,
  ...), +0.2 "reasoning" when it uses a reasoning phrase (therefore, so, total, the count is, the
  answer is). "accuracy" = correct.
- `strict` (total in [0, 2]): "format" (the strict <think>/<answer> layout, 0 or 1) + "accuracy"
  (the single <answer> holds only the count, digits, 0 or 1).

A weak teacher (`teacher_error`, for studies of RL against imitation): the reference completions
are wrong in that share of examples the way a weaker counter is wrong, not at random. It counts
one short where two shapes of the asked kind stand closest together (it sees them as one): the
examples whose closest pair of target shapes is nearer than the `teacher_error` quantile of that
distance over a fixed sample of train layouts (`TEACHER_SAMPLE`, drawn from the seed). Images with
one target shape are never miscounted, crowded ones most often, so imitation learns the bias
itself; the gold answer, the rewards and the test splits are untouched.

The placement and drawing helpers here are shared with the grounding task.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from functools import cached_property

from PIL import Image, ImageDraw

from vlmrl.errors import VlmrlError
from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.rewards.verify import Rubric, extract_tag, last_number, think_answer_format

KINDS = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
SHAPE_COLORS = {"circle": "blue", "square": "green", "triangle": "red"}
RGB = {"red": (220, 40, 40), "green": (40, 160, 70), "blue": (40, 70, 220), "yellow": (230, 190, 20),
       "purple": (140, 60, 190), "orange": (240, 130, 30)}
KEYWORDS = {
    "circle": ("circle", "circles", "circular", "round", "blue"),
    "square": ("square", "squares", "green"),
    "triangle": ("triangle", "triangles", "triangular", "red"),
}
REASONING_PHRASES = ("therefore", "so", "total", "the count is", "the answer is")
_KEYWORD_RE = {kind: re.compile(r"\b(?:" + "|".join(words) + r")\b") for kind, words in KEYWORDS.items()}
_REASONING_RE = re.compile(r"\b(?:" + "|".join(REASONING_PHRASES) + r")\b")
_DIGITS = re.compile(r"\d{1,6}")
CHAPTER = Rubric({"correct": 1.0, "describes_shape": 0.5, "reasoning": 0.2})
STRICT = Rubric({"format": 1.0, "accuracy": 1.0})
MAX_FILL = 0.4
"""Largest share of the image the shapes' padded boxes may cover (placement stays fast)."""
TEACHER_SAMPLE = 2000
"""Train layouts the weak teacher's crowding threshold is taken from (the same for every worker)."""


def place_squares(rng: random.Random, sizes: list[int], canvas: int, gap: int,
                  tries: int = 300, restarts: int = 100) -> list[tuple[int, int]]:
    """Top-left corners for squares of the given sides inside a `canvas` x `canvas` image, at least
    `gap` pixels apart (and from the border), by rejection sampling.

    If one square cannot be placed in `tries` draws, the layout restarts (deterministically, from
    the same generator). Never returns fewer squares than asked: VlmrlError after `restarts`.
    """
    for _ in range(restarts):
        placed: list[tuple[int, int, int]] = []
        for size in sizes:
            high = canvas - gap - size
            if high < gap:
                break
            for _ in range(tries):
                x, y = rng.randint(gap, high), rng.randint(gap, high)
                if all(x + size + gap <= px or px + ps + gap <= x or y + size + gap <= py or py + ps + gap <= y
                       for px, py, ps in placed):
                    placed.append((x, y, size))
                    break
            else:
                break
        if len(placed) == len(sizes):
            return [(x, y) for x, y, _ in placed]
    raise VlmrlError(f"could not place {len(sizes)} shapes in a {canvas}x{canvas} image; "
                     "lower the counts or the shape sizes")


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, x: int, y: int, size: int, color: tuple[int, int, int]) -> None:
    """Fill a shape whose pixels lie exactly in [x, x+size) x [y, y+size)."""
    right, bottom = x + size - 1, y + size - 1
    if kind == "circle":
        draw.ellipse((x, y, right, bottom), fill=color)
    elif kind == "square":
        draw.rectangle((x, y, right, bottom), fill=color)
    else:
        draw.polygon([(x + (size - 1) / 2, y), (x, bottom), (right, bottom)], fill=color)


def closest_pair(shapes: list[tuple[str, int, int, int]], target: str) -> float:
    """The smallest distance, in pixels, between the centres of two `target` shapes (inf with fewer
    than two)."""
    centres = [(x + size / 2, y + size / 2) for kind, x, y, size in shapes if kind == target]
    return min((math.dist(a, b) for i, a in enumerate(centres) for b in centres[i + 1:]), default=math.inf)


def fits(n_shapes: int, max_side: int, gap: int, canvas: int) -> bool:
    """Whether `n_shapes` squares of side `max_side` (plus gap) cover at most MAX_FILL of the image."""
    return n_shapes * (max_side + gap) ** 2 <= MAX_FILL * canvas * canvas


@dataclass
class ShapesParams(TaskParams):
    """Parameters of the shape-counting task."""

    min_count: int = 1
    """Fewest shapes of each kind in train and test images."""
    max_count: int = 5
    """Most shapes of each kind in train and test images."""
    ood_min: int = 6
    """Fewest shapes of the asked-about kind in the OOD split (must exceed max_count)."""
    ood_max: int = 7
    """Most shapes of the asked-about kind in the OOD split."""
    image_size: int = 168
    """Side of the square image in pixels."""
    rubric: str = "chapter"
    """Reward: "chapter" (last number, shape keyword, reasoning phrase; total 0..1.7) or "strict"
    (<think>/<answer> format + exact count; total 0..2)."""
    targets: tuple[str, ...] = KINDS
    """Kinds the question may ask about."""
    distractors: bool = True
    """Also draw min_count..max_count shapes of each other kind (False: only the asked-about kind,
    an easier image)."""
    min_size: float = 0.08
    """Smallest shape side as a fraction of the image side."""
    max_size: float = 0.13
    """Largest shape side as a fraction of the image side."""
    gap: int = 2
    """Least distance in pixels between two shapes (and from the border)."""
    teacher_error: float = 0.0
    """Share of examples whose reference completion (SFT data) counts one short, the most crowded
    ones (see the module docstring); 0: every reference completion is right."""

    def validate(self) -> None:
        super().validate()
        check(1 <= self.min_count <= self.max_count, f"need 1 <= min_count <= max_count, got "
              f"min_count={self.min_count}, max_count={self.max_count}")
        check(self.max_count < self.ood_min <= self.ood_max, f"need max_count < ood_min <= ood_max, got "
              f"max_count={self.max_count}, ood_min={self.ood_min}, ood_max={self.ood_max}")
        check(32 <= self.image_size <= 4096, f"image_size must be in 32..4096, got {self.image_size}")
        check(self.rubric in ("chapter", "strict"), f"rubric must be 'chapter' or 'strict', got {self.rubric!r}")
        distinct = len(set(self.targets)) == len(self.targets)
        check(len(self.targets) > 0 and all(t in KINDS for t in self.targets) and distinct,
              f"targets must be distinct names from {', '.join(KINDS)}, got {self.targets!r}")
        check(0 < self.min_size <= self.max_size <= 0.5,
              f"need 0 < min_size <= max_size <= 0.5, got {self.min_size}, {self.max_size}")
        check(self.gap >= 0, f"gap must be >= 0, got {self.gap}")
        check(0 <= self.teacher_error < 1, f"teacher_error must be in [0, 1), got {self.teacher_error}")
        check(round(self.min_size * self.image_size) >= 4, "shapes would be smaller than 4 pixels: "
              "raise min_size or image_size")
        most = max(self.ood_max, self.max_count) + (2 * self.max_count if self.distractors else 0)
        check(fits(most, round(self.max_size * self.image_size), self.gap, self.image_size),
              f"{most} shapes of up to {self.max_size:g} of the side do not fit a {self.image_size}px image "
              "with room to spare; lower the counts or max_size, or raise image_size")


@register_task
class ShapesTask(Task):
    """Count shapes of one kind."""

    name = "shapes"
    description = "count red triangles, blue circles or green squares; OOD split has 6-7 of a kind"
    Params = ShapesParams
    params: ShapesParams

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test", "ood")

    def _layout(self, rng: random.Random, split: str) -> tuple[str, dict[str, int], list[tuple[str, int, int, int]]]:
        p = self.params
        target = rng.choice(p.targets)
        counts = {kind: rng.randint(p.min_count, p.max_count) for kind in KINDS}
        if split == "ood":
            counts[target] = rng.randint(p.ood_min, p.ood_max)
        if not p.distractors:
            counts = {kind: count if kind == target else 0 for kind, count in counts.items()}
        kinds = [kind for kind in KINDS for _ in range(counts[kind])]
        rng.shuffle(kinds)
        lo, hi = round(p.min_size * p.image_size), round(p.max_size * p.image_size)
        sizes = [rng.randint(lo, hi) for _ in kinds]
        corners = place_squares(rng, sizes, p.image_size, p.gap)
        return target, counts, [(k, x, y, s) for k, (x, y), s in zip(kinds, corners, sizes)]

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            target, counts, shapes = self._layout(rng, split)
            key = target + "|" + ";".join(f"{k},{x},{y},{s}" for k, x, y, s in shapes)
            if in_split(key, split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no layout landed in the split")
        image = Image.new("RGB", (p.image_size, p.image_size), "white")
        draw = ImageDraw.Draw(image)
        for kind, x, y, size in shapes:
            draw_shape(draw, kind, x, y, size, RGB[SHAPE_COLORS[kind]])
        count, plural, color = counts[target], PLURALS[target], SHAPE_COLORS[target]
        prompt = (f"How many {plural} are in the image? Think step by step inside <think> </think>, "
                  "then give the number inside <answer> </answer>.")
        said = count - 1 if closest_pair(shapes, target) < self.teacher_threshold else count
        reference = (f"<think> I count the {color} {plural}: there are {said}, so the answer is {said}. </think> "
                     f"<answer> {said} </answer>")
        meta = {"idx": idx, "split": split, "target": target, "count": count, "counts": counts,
                "shapes": [list(s) for s in shapes], "image_size": [p.image_size, p.image_size],
                "teacher_count": said}
        return Example(image=image, prompt=prompt, answer=str(count), meta=meta, reference_completion=reference)

    @cached_property
    def teacher_threshold(self) -> float:
        """The weak teacher counts one short below this closest-pair distance (pixels): the
        `teacher_error` quantile of it over TEACHER_SAMPLE train layouts; -inf for a perfect teacher."""
        if self.params.teacher_error == 0:
            return -math.inf
        layouts = (self._layout(self.rng("teacher", i), "train") for i in range(TEACHER_SAMPLE))
        distances = sorted(closest_pair(shapes, target) for target, _, shapes in layouts)
        return distances[int(self.params.teacher_error * TEACHER_SAMPLE)]

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """Chapter rubric: total in [0, 1.7]; strict: total in [0, 2]. See the module docstring."""
        count, target = int(example.meta["count"]), example.meta["target"]
        if self.params.rubric == "strict":
            answer = extract_tag(completion, "answer")
            exact = answer is not None and _DIGITS.fullmatch(answer) is not None and int(answer) == count
            return STRICT({"format": think_answer_format(completion), "accuracy": float(exact)})
        number = last_number(completion)
        correct = float(number is not None and number == count)
        text = completion.lower()
        return CHAPTER({"correct": correct,
                        "describes_shape": float(_KEYWORD_RE[target].search(text) is not None),
                        "reasoning": float(_REASONING_RE.search(text) is not None),
                        "accuracy": correct})
