"""`census`: count many small shapes, some touching, with the CV tools (issue 52, "vision models as tools").

The original is an `image_size` x `image_size` picture (default 448), white, with min_count..max_count
small shapes (`kind`, default circles `shape_size` = 14 px across) of each colour of `colours` (colours
`find_objects` knows: vlmrl.tools.cv_tools.PALETTE). Shapes of one colour come in groups: each shape
after the first of its colour joins the group before it with probability `touch` (groups of at most
`max_cluster`), and the shapes of a group are a chain in a random direction, each overlapping the
next by `overlap` of its size, so they touch; separate groups (of any colour) stay `gap` pixels apart.
The model sees the original DOWNSCALED to `view_side` (default 112, box filter; a shape is 3.5 px
there and a touching pair a smudge): `Example.images` = [the view], `Example.originals` = [the original],
which the tools read.

Questions (`questions`): "count" (how many blue circles?) and "difference" (how many more red than
green circles?, always a positive number). The answer needs exact counts, which the view does not
carry, and the raw tool output alone is not the answer either: `find_objects` lists a touching group
as ONE region (shape class "other"), whose area is about k times one shape's. The prompt says what one
shape alone covers (`single_area`, measured as find_objects measures it); a region counts round(area /
single_area) shapes. Generation checks that this rule gives every asked colour's true count from the
tool's own output (else it draws the layout again), so the reference always holds.

Reference trajectory (`meta["reference_turns"]`, for SFT with `rollout.tools` holding find_objects): one
call per colour asked about, then the answer read from those calls' outputs:

    <think>Find the blue circles.</think>
    <tool_call>
    {"name": "find_objects", "arguments": {"colour": "blue"}}
    </tool_call>
    ... the tool's list: "5 blue regions ...", then one line per region with its area ...
    <think>blue: 5 regions; 1 of 2 circles: 5 + 1 = 6; 0 of 3: 6 + 0 = 6.</think> <answer>6</answer>

It says how many regions the tool listed, then, for each k from 2 to max_cluster, how many regions
hold k touching shapes (a region holds round(area / single_area) shapes) and adds the k - 1 shapes
each of them hides to the count so far, one small sum at a time. Why this form, measured on the
offline small model with the exact teacher (64 held-out scenes, greedy): a region by region walk
("1: 148 -> 1; 2: 290 -> 3; ...") needs each entry to find its own line's area in the list, which the
model had not learnt after 150 SFT steps (it wrote 148 for most regions; 67% of its answers right);
one sum at the end ("5 + 1 + 0 = 6") was right in 42% of the answers after 100 steps, where the
region count was copied right in 97% and the regions of 2 counted right in 53% (56% of answers
right). A difference ends "red: ... = 6. green: ... = 4. 6 - 4 = 2.". `reference_completion` is the
last turn.

`reading="total"` reads the count from `measure` instead: one call per colour asked about
(`{"name": "measure", "arguments": {"colour": "blue"}}`, the regions' count and area statistics), then the
total area over one shape's, in the tool's own words ("blue: total area 882 px / 148 px = 6."); generation
checks that round(total / single_area) gives the count. The trajectory is about 170 tokens against 300, but
the offline small model (64 held-out scenes, greedy) copied the total from the tool's answer in at most
20% of them after 200 SFT steps at lr 1e-3 or 3e-3 (it wrote a common total, then divided that right):
copying a number from a tool's answer is what it learns slowest. It does between steps 200 and 400 (lr 3e-3:
76.6% right at 400), and 10 GRPO steps then gave 100% of 64 held-out scenes; the demo (350 SFT steps, 15 GRPO
steps) goes from 61% to 100% of 200 (docs/results.md "The census demo").

The weak teacher (`teacher="regions"`): the same calls and the same form of answer, but it trusts the
raw region count: a region of touching shapes counts as one shape ("0 of 2 circles: 5 + 0 = 5; 0 of
3: 5 + 0 = 5"), except that it reads a share `teacher_reads` of those regions by their area (drawn
per region from the example's seed; 0, the default: never). Its answers are wrong where shapes of an asked colour touch
and it did not read them (for a difference: where the two colours' missed shapes differ), right
elsewhere: what RL has to fix. With 0 < teacher_reads < 1 the SFT data shows both readings of a
touching region, so the model it makes says the right one some of the time, which RL can then
reinforce (as shapes' `teacher_error`). The gold answer and the rewards are untouched.

Splits: a candidate belongs to "test" when a stable hash of the question and the layout falls below 0.5
(`base.in_split`), else to "train". "ood": the colour asked about (the larger one of a difference) has
ood_min..ood_max shapes, more than training ever shows.

Reward (total in [0, 1 + format_weight], the house rubric): "accuracy" (1 iff the single <answer> holds
exactly the number, an integer, whitespace around ignored) + format_weight (0.5) x "format" (the strict
<think>/<answer> layout with an integer answer). A tool-using rollout is scored on its final text
(`Task.score_trajectory`). Total for any string. No torch here.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from PIL import Image, ImageDraw

from vlmrl.rewards.verify import Rubric, extract_tag, think_answer_format
from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.tasks.shapes import KINDS, MAX_FILL, PLURALS, draw_shape, place_squares
from vlmrl.tools.cv_tools import CHROMATIC, PALETTE, find_regions

QUESTIONS = ("count", "difference")
TEACHERS = ("exact", "regions")
READINGS = ("regions", "total")
_INTEGER = re.compile(r"-?[0-9]{1,6}")
CALL_NAMES = {"regions": "find_objects", "total": "measure"}
"""The tool each reading calls, on the colour asked about."""


def chain(k: int, size: int, overlap: float, angle: float) -> list[tuple[int, int]]:
    """Top-left corners of `k` shapes in a chain at `angle` (radians), each (1 - overlap) * size from the
    last, shifted so that the chain's box starts at (0, 0)."""
    step = (1 - overlap) * size
    points = [(round(j * step * math.cos(angle)), round(j * step * math.sin(angle))) for j in range(k)]
    x0, y0 = min(p[0] for p in points), min(p[1] for p in points)
    return [(x - x0, y - y0) for x, y in points]


def chain_side(k: int, size: int, overlap: float) -> int:
    """Side of the square that holds a chain of `k` shapes in any direction."""
    return size + math.ceil((k - 1) * (1 - overlap) * size) + 1


def shapes_in(area: int, single: int) -> int:
    """How many shapes a region of `area` pixels holds when one shape alone covers `single`: round(area /
    single), at least 1."""
    return max(1, math.floor(area / single + 0.5))


def call_text(colour: str, reading: str = "regions") -> str:
    """The call `reading` makes on `colour` (find_objects or measure), in Qwen's native format."""
    call = {"name": CALL_NAMES[reading], "arguments": {"colour": colour}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


@dataclass
class CensusParams(TaskParams):
    """Parameters of the census task."""

    image_size: int = 448
    """Side of the original (what the tools read), in pixels."""
    view_side: int = 112
    """Side of the downscaled view the model is shown, in pixels (at most image_size)."""
    shape_size: int = 14
    """Side of every shape's box in the original, in pixels."""
    kind: str = "circle"
    """The shape drawn: circle, square or triangle."""
    colours: tuple[str, ...] = ("red", "green", "blue", "yellow")
    """Colours drawn (each in every image) and asked about: distinct names of find_objects' colours."""
    min_count: int = 3
    """Fewest shapes of each colour (train and test)."""
    max_count: int = 8
    """Most shapes of each colour (train and test)."""
    ood_min: int = 10
    """Fewest shapes of the colour asked about in the OOD split (must exceed max_count)."""
    ood_max: int = 14
    """Most shapes of the colour asked about in the OOD split."""
    touch: float = 0.3
    """Chance that a shape joins (touches) the group of the shape of its colour drawn before it."""
    max_cluster: int = 3
    """Most shapes in one touching group."""
    overlap: float = 0.15
    """How far touching shapes overlap, as a fraction of shape_size (they must overlap to merge)."""
    gap: int = 4
    """Least distance in pixels between two groups (and from the border)."""
    questions: tuple[str, ...] = QUESTIONS
    """Questions asked: count (how many blue circles?) and/or difference (how many more red than green?)."""
    reading: str = "regions"
    """How the reference reads the count: regions (find_objects' list: each region holds round(area / single
    area) shapes) or total (measure's area statistics: round(total area / single area) shapes)."""
    teacher: str = "exact"
    """Reference trajectories: exact (the areas read) or regions (the weak teacher: every region is one shape,
    wrong where shapes touch, except a share `teacher_reads`)."""
    teacher_reads: float = 0.0
    """The weak teacher's share of readings by area (the rest count the regions): drawn per touching-shape region
    (reading=regions) or per colour asked about (reading=total); only with teacher="regions"."""
    instructions: bool = True
    """Explain the view and the tool in the prompt; false: the question and the single shape's area only."""
    format_weight: float = 0.5
    """Weight of the strict <think>/<answer> format in the total."""

    def validate(self) -> None:
        super().validate()
        check(32 <= self.image_size <= 4096, f"image_size must be in 32..4096, got {self.image_size}")
        check(8 <= self.view_side <= self.image_size, f"need 8 <= view_side <= image_size, got {self.view_side}")
        check(6 <= self.shape_size <= self.image_size // 4, f"shape_size must be in 6..image_size/4, got "
              f"{self.shape_size}")
        check(self.kind in KINDS, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        known = [c for c in PALETTE if c in CHROMATIC]
        distinct = len(set(self.colours)) == len(self.colours)
        check(len(self.colours) >= 2 and distinct and all(c in known for c in self.colours),
              f"colours must be at least 2 distinct names from {', '.join(known)}, got {self.colours!r}")
        check(1 <= self.min_count <= self.max_count, f"need 1 <= min_count <= max_count, got {self.min_count}, "
              f"{self.max_count}")
        check(self.max_count < self.ood_min <= self.ood_max, f"need max_count < ood_min <= ood_max, got "
              f"{self.max_count}, {self.ood_min}, {self.ood_max}")
        check(0 <= self.touch <= 1, f"touch must be in [0, 1], got {self.touch}")
        check(1 <= self.max_cluster <= 4, f"max_cluster must be in 1..4, got {self.max_cluster}")
        check(0.05 <= self.overlap <= 0.4, f"overlap must be in 0.05..0.4 (touching shapes must merge and stay "
              f"countable by area), got {self.overlap}")
        check(self.gap >= 2, f"gap must be >= 2 (separate groups must not merge), got {self.gap}")
        check(len(self.questions) > 0 and set(self.questions) <= set(QUESTIONS),
              f"questions must be names from {', '.join(QUESTIONS)}, got {self.questions!r}")
        check("difference" not in self.questions or self.min_count < self.max_count, "a difference question needs two "
              f"colours of different counts: need min_count < max_count, got {self.min_count}, {self.max_count}")
        check(self.reading in READINGS, f"reading must be one of {', '.join(READINGS)}, got {self.reading!r}")
        check(self.teacher in TEACHERS, f"teacher must be one of {', '.join(TEACHERS)}, got {self.teacher!r}")
        check(0 <= self.teacher_reads <= 1, f"teacher_reads must be in [0, 1], got {self.teacher_reads}")
        check(self.teacher_reads == 0 or self.teacher == "regions", "teacher_reads is the weak teacher's "
              f"(teacher=regions); got teacher={self.teacher!r}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        most = self.ood_max + (len(self.colours) - 1) * self.max_count
        side = chain_side(self.max_cluster, self.shape_size, self.overlap)
        used = max(most * (self.shape_size + self.gap) ** 2, math.ceil(most / self.max_cluster) * (side + self.gap) ** 2)
        check(used <= MAX_FILL * self.image_size ** 2, f"{most} shapes of {self.shape_size} px (groups of up to "
              f"{self.max_cluster}) do not fit a {self.image_size} px image with room to spare; lower the counts, "
              "shape_size or max_cluster, or raise image_size")


@register_task
class CensusTask(Task):
    """Count small shapes of one colour, some touching, with find_objects' regions and their areas."""

    name = "census"
    description = ("count small shapes of a colour (or the difference of two colours), some touching, in a 112 px "
                   "view of a 448 px image: find_objects lists regions and areas, touching shapes merge into one "
                   "region; OOD: 10-14 of the colour asked about")
    Params = CensusParams
    params: CensusParams

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test", "ood")

    @cached_property
    def single_area(self) -> int:
        """Pixels one shape alone covers, as find_objects counts them (its region's area)."""
        p = self.params
        side = p.shape_size + 4
        image = Image.new("RGB", (side, side), "white")
        draw_shape(ImageDraw.Draw(image), p.kind, 2, 2, p.shape_size, PALETTE[p.colours[0]])
        regions, _ = find_regions(image, p.colours[0])
        return regions[0].area

    def _question(self, rng: random.Random, split: str) -> tuple[str, list[str], dict[str, int]]:
        """(question kind, the colours asked about in order, the count of every colour)."""
        p = self.params
        question = rng.choice(p.questions)
        counts = {c: rng.randint(p.min_count, p.max_count) for c in p.colours}
        asked = [rng.choice(p.colours)] if question == "count" else rng.sample(p.colours, 2)
        if split == "ood":
            counts[asked[0]] = rng.randint(p.ood_min, p.ood_max)
        if question == "difference":
            while counts[asked[0]] == counts[asked[1]]:
                counts[asked[1]] = rng.randint(p.min_count, p.max_count)
            asked.sort(key=lambda c: -counts[c])  # the larger first: a positive answer
        return question, asked, counts

    def _groups(self, rng: random.Random, counts: dict[str, int]) -> list[list[Any]]:
        """Touching groups as [colour, [(x, y) top-left corner of each shape]], placed apart."""
        p = self.params
        sizes: list[tuple[str, int]] = []  # (colour, shapes in the group)
        for colour, n in counts.items():
            for j in range(n):
                if j and sizes[-1][1] < p.max_cluster and rng.random() < p.touch:
                    sizes[-1] = (colour, sizes[-1][1] + 1)
                else:
                    sizes.append((colour, 1))
        rng.shuffle(sizes)
        chains = [chain(k, p.shape_size, p.overlap, rng.uniform(0, 2 * math.pi)) for _, k in sizes]
        sides = [max(max(x, y) for x, y in corners) + p.shape_size for corners in chains]
        placed = place_squares(rng, sides, p.image_size, p.gap)
        return [[colour, [(x0 + x, y0 + y) for x, y in corners]]
                for (colour, _), corners, (x0, y0) in zip(sizes, chains, placed)]

    def _draw(self, groups: list[list[Any]]) -> Image.Image:
        p = self.params
        image = Image.new("RGB", (p.image_size, p.image_size), "white")
        draw = ImageDraw.Draw(image)
        for colour, corners in groups:
            for x, y in corners:
                draw_shape(draw, p.kind, x, y, p.shape_size, PALETTE[colour])
        return image

    def _prompt(self, question: str, asked: list[str]) -> str:
        p = self.params
        plural = PLURALS[p.kind]
        ask = (f"How many {asked[0]} {plural} are there?" if question == "count" else
               f"How many more {asked[0]} {plural} than {asked[1]} {plural} are there?")
        alone = f"One {p.kind} alone covers {self.single_area} px."
        if not p.instructions:
            return f"{ask} {alone}"
        side, view = p.image_size, p.view_side
        tool = ("find_objects lists the regions of a colour with their boxes and areas" if p.reading == "regions" else
                "measure gives the count of a colour's regions and their total area")
        return (f"This picture is a {view}x{view} downscaled view of a {side}x{side} image of small {plural}, some "
                f"touching. {ask} {tool} in the original's pixels; touching {plural} make one region. {alone} For "
                f"example:\n{call_text(asked[0], p.reading)}\n"
                "Think inside <think> </think>, then give the number inside <answer> </answer>.")

    def _turns(self, rng: random.Random, question: str, asked: list[str], areas: dict[str, list[int]]) -> list[str]:
        """The reference turns: one call per colour asked about, then the answer from the regions' areas."""
        p = self.params
        plural = PLURALS[p.kind]
        calls = [f"<think>Find the {colour} {plural}.</think>\n{call_text(colour, p.reading)}" for colour in asked]
        read = self._read_total if p.reading == "total" else self._read_regions
        parts, totals = [], []
        for colour in asked:
            part, total = read(rng, colour, areas[colour])
            parts.append(part)
            totals.append(total)
        if question == "difference":
            parts.append(f"{totals[0]} - {totals[1]} = {totals[0] - totals[1]}.")
        said = totals[0] - totals[1] if question == "difference" else totals[0]
        return calls + [f"<think>{' '.join(parts)}</think> <answer>{said}</answer>"]

    def _weak(self, rng: random.Random) -> bool:
        """Whether the weak teacher counts a reading's regions rather than reading its areas (one draw)."""
        return self.params.teacher == "regions" and rng.random() >= self.params.teacher_reads

    def _read_total(self, rng: random.Random, colour: str, areas: list[int]) -> tuple[str, int]:
        """(the reading of one colour from measure's total area, the count it gives): "blue: total area 882 px /
        148 px = 6." (the tool's own words before the number, for the copy to follow: the offline model
        learns it between SFT steps 200 and 400, module docstring); the weak teacher's "blue: 5 regions." unless it reads this one."""
        if any(shapes_in(a, self.single_area) > 1 for a in areas) and self._weak(rng):
            return f"{colour}: {len(areas)} regions.", len(areas)
        count = shapes_in(sum(areas), self.single_area)
        return f"{colour}: total area {sum(areas)} px / {self.single_area} px = {count}.", count

    def _read_regions(self, rng: random.Random, colour: str, areas: list[int]) -> tuple[str, int]:
        """(the reading of one colour from find_objects' list, the count it gives): "blue: 5 regions; 1 of 2
        circles: 5 + 1 = 6; 0 of 3: 6 + 0 = 6."; the weak teacher counts a touching region it does not read
        as one shape."""
        p = self.params
        plural = PLURALS[p.kind]
        sizes = range(2, p.max_cluster + 1)
        held = {k: 0 for k in sizes}  # regions read as holding k shapes
        for area in areas:
            k = shapes_in(area, self.single_area)
            if k > 1 and not self._weak(rng):
                held[k] += 1
        total = len(areas)
        steps = [f"{colour}: {total} regions"]
        for k, n in held.items():  # each size of region adds the shapes it hides: one small sum at a time
            steps.append(f"{n} of {k}" + (f" {plural}" if k == 2 else "") + f": {total} + {(k - 1) * n} = "
                         f"{total + (k - 1) * n}")
            total += (k - 1) * n
        return "; ".join(steps) + ".", total

    def _readable(self, areas: list[int]) -> int:
        """The count the exact reading gives from one colour's region areas."""
        if self.params.reading == "total":
            return shapes_in(sum(areas), self.single_area)
        return sum(shapes_in(a, self.single_area) for a in areas)

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            question, asked, counts = self._question(rng, split)
            groups = self._groups(rng, counts)
            key = f"{question}|{','.join(asked)}|" + ";".join(f"{c}{g}" for c, g in groups)
            if not in_split(key, split):
                continue
            original = self._draw(groups)
            areas = {c: [r.area for r in find_regions(original, c)[0]] for c in asked}
            regions = {c: sum(colour == c for colour, _ in groups) for c in asked}
            if all(len(areas[c]) == regions[c] and self._readable(areas[c]) == counts[c]
                   for c in asked):  # the tool sees each group as one region, and the reading gives the count
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no layout landed in the split")
        view = original.resize((p.view_side, p.view_side), Image.Resampling.BOX)
        answer = counts[asked[0]] - counts[asked[1]] if question == "difference" else counts[asked[0]]
        turns = self._turns(rng, question, asked, areas)
        raw = {c: len(areas[c]) for c in asked}
        meta = {"idx": idx, "split": split, "question": question, "asked": asked, "counts": counts,
                "regions": raw, "count": answer, "single_area": self.single_area,
                "groups": [[c, [list(xy) for xy in g]] for c, g in groups], "view_side": p.view_side,
                "image_size": [p.view_side, p.view_side], "original_size": [p.image_size, p.image_size],
                "reference_turns": turns}
        return Example(images=[view], originals=[original], prompt=self._prompt(question, asked), answer=str(answer),
                       meta=meta, reference_completion=turns[-1])

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy + format_weight * format; total in [0, 1 + format_weight]. See the module docstring."""
        answer = extract_tag(completion, "answer")
        number = answer is not None and _INTEGER.fullmatch(answer) is not None
        exact = number and int(answer) == int(example.meta["count"])
        well_formed = float(number and think_answer_format(completion) == 1.0)
        return Rubric({"accuracy": 1.0, "format": self.params.format_weight})(
            {"accuracy": float(exact), "format": well_formed})
