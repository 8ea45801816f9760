"""Bar charts for `vlmrl data bars OUT`: "Which colour is the tallest bar?", the worked example of
bringing your own data (docs/own-data.md).

Each chart has `bars` bars of distinct colours (drawn from PALETTE, in a random order) on a white
background above a grey baseline; the tallest stands at least `margin` of the plot height above the
next. The answer is the tallest bar's colour name. A chart is a pure function of (seed, split,
idx): any worker draws chart 12345 without drawing the first 12344, and train and test are
different draws. No torch here: the rows are plain Python and PIL.

A weak teacher (`teacher_confuses="red/orange"`): the worked solutions of the train split are
written by a teacher that cannot tell the two colours apart: where the tallest bar is one of them,
it names one of the two by a coin drawn with the chart, so it is wrong on half of those charts; the
gold answer and the test split stay true. SFT on the solutions learns the guess; RL paid on the
gold answer can go past it (the shapes weak-teacher study in docs/results.md, on your own data).

Why this question: the offline small model's vision tower keeps its random weights, and what such
a tower passes on is mostly colour (digits and fine positions it does not separate); with bars of
one width the tallest bar is also the colour covering the most of the chart, so a model that reads
colour shares can learn the answer, and a model that does not look at the chart cannot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from vlmrl.errors import VlmrlError

PALETTE = {"red": (220, 40, 40), "green": (40, 160, 70), "blue": (40, 70, 220), "yellow": (230, 190, 20),
           "purple": (140, 60, 190), "orange": (240, 130, 30)}
"""The colours a bar can have, by the name the answer uses."""
QUESTION = "<image>Which colour is the tallest bar?"
"""The prompt of every row (TRL's layout: the `<image>` marker where the chart goes)."""
BASELINE = (150, 150, 150)
"""Colour of the axis line under the bars."""


@dataclass(frozen=True)
class BarsParams:
    """How the charts are drawn."""

    image_size: int = 112
    """Side of the square chart in pixels (64 to 1024)."""
    bars: int = 4
    """Bars per chart (2 to len(PALETTE)), each of its own colour."""
    margin: float = 0.25
    """The tallest bar stands at least this share of the plot height above the next (0 to 0.5).
    The offline small model learns 0.25 in about 100 SFT steps (99% held out); 0.1 reached 45%."""
    teacher_confuses: str = ""
    """Two colours "a/b" the train split's worked solutions cannot tell apart (a weak teacher that
    names one of the two at random where the tallest bar is either); "": a teacher that does not err."""

    def confused(self) -> tuple[str, ...]:
        """The two colours of teacher_confuses, or () for a teacher that does not err."""
        return tuple(self.teacher_confuses.split("/")) if self.teacher_confuses else ()

    def validate(self) -> None:
        """VlmrlError (one line) for a value of the wrong type or out of its range."""
        for name, kind, words in (("image_size", int, "an integer"), ("bars", int, "an integer"),
                                  ("margin", (int, float), "a number")):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise VlmrlError(f"{name} must be {words}, got {value!r}")
        if not 64 <= self.image_size <= 1024:
            raise VlmrlError(f"image_size must be in [64, 1024], got {self.image_size}")
        if not 2 <= self.bars <= len(PALETTE):
            raise VlmrlError(f"bars must be in [2, {len(PALETTE)}], got {self.bars}")
        if not 0 <= self.margin <= 0.5:
            raise VlmrlError(f"margin must be in [0, 0.5], got {self.margin}")
        pair = self.confused() if isinstance(self.teacher_confuses, str) else None
        if pair is None or (pair and (len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(PALETTE))):
            raise VlmrlError(f"teacher_confuses must be two colours a/b of {', '.join(PALETTE)}, "
                             f"got {self.teacher_confuses!r}")


@dataclass(frozen=True)
class Chart:
    """One bar chart and what a row says about it."""

    image: Image.Image
    colors: list[str]
    """The bars' colours, left to right."""
    heights: list[float]
    """The bars' heights as shares of the plot height, left to right."""
    coin: float = 0.0
    """A draw in [0, 1) of the chart's own: which of two confused colours a weak teacher names."""

    @property
    def answer(self) -> str:
        """The tallest bar's colour."""
        return self.colors[self.heights.index(max(self.heights))]

    def teacher_answer(self, confused: tuple[str, ...] = ()) -> str:
        """The answer of a teacher that cannot tell the `confused` colours apart: one of the two, by
        the chart's coin, where the tallest bar is either."""
        if self.answer not in confused:
            return self.answer
        return confused[0] if self.coin < 0.5 else confused[1]

    def solution(self, confused: tuple[str, ...] = ()) -> str:
        """The teacher's worked solution in the `<think>`/`<answer>` layout (what `vlmrl sft` imitates)."""
        said = self.teacher_answer(confused)
        return f"<think> The tallest bar is {said}. </think> <answer> {said} </answer>"


def chart(seed: int, split: str, idx: int, params: BarsParams = BarsParams()) -> Chart:
    """Chart `idx` of `split`, drawn from (seed, split, idx) alone."""
    rng = random.Random(f"bars:{seed}:{split}:{idx}")
    colors = rng.sample(sorted(PALETTE), params.bars)
    tallest = rng.uniform(0.45 + params.margin, 0.95)
    others = [rng.uniform(0.15, tallest - params.margin) for _ in range(params.bars - 1)]
    heights = others[:]
    heights.insert(rng.randrange(params.bars), tallest)
    heights = [round(h, 3) for h in heights]
    return Chart(image=draw(colors, heights, params.image_size), colors=colors, heights=heights, coin=rng.random())


def draw(colors: list[str], heights: list[float], side: int) -> Image.Image:
    """The chart: equal bars, equal gaps, a baseline; heights as shares of the plot height."""
    image = Image.new("RGB", (side, side), "white")
    pen = ImageDraw.Draw(image)
    pad = side // 16
    base, top = side - pad, pad
    slot = (side - 2 * pad) / len(colors)
    width = max(1, round(slot * 0.7))
    for i, (color, height) in enumerate(zip(colors, heights)):
        left = round(pad + i * slot + (slot - width) / 2)
        pen.rectangle((left, round(base - height * (base - top)), left + width - 1, base - 1), fill=PALETTE[color])
    pen.line((pad // 2, base, side - pad // 2, base), fill=BASELINE, width=max(1, side // 112))
    return image
