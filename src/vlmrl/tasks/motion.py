"""`motion`: which way does the square move? A video task that no single frame answers.

Each example is a short video: `frames` frames, `1 / fps` seconds apart, in which one to three
squares of different colours (red, blue, green) cross a white frame in straight lines, each left,
right, up or down. The question names one colour; the answer is that square's direction.

Built so that time is the only way in:
- a path is symmetric about a random centre: the square visits the same positions moving right as
  moving left, in the opposite order; the middle frame shows it at the centre either way, so one
  frame says nothing of the direction (the single-frame control takes that frame);
- the frames shuffled give another order of the same positions, and reversed ones the opposite
  direction: a model that reads the order is right on the video, wrong on the reversed video;
- the squares are large (`square`, a fraction of the side) and coloured, and the travel long, so a
  small model's random vision tower sees them as colours at coarse positions (no digits, no fine
  detail).

With `bounce=true` each square goes out along its direction and comes back to where it started
(at the far end in the middle frame); the answer is the way it went first. With `view_frames` the
model is shown only that many of the frames, spread from the first to the last, and the full video
stays for the `frames` tool (`Example.video_originals`): a bouncing square shown in 2 frames is in
the same place in both, so the answer needs a look at the first half (`meta["reference_turns"]`:
the call `frames(0, half the duration)`, then the answer, for SFT with `rollout.tools=[frames]`).

Reward (total in [0, 2], the `strict` rubric of the counting task): "format" (the strict
<think>/<answer> layout, 0 or 1) + "accuracy" (the single <answer> holds exactly one direction word,
the right one: "left right" or "left or right" scores 0). Train and test differ in content (the
stable hash of colour, direction, centre and cross position); no torch.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from PIL import Image, ImageDraw

from vlmrl.rewards.verify import Rubric, extract_tag, think_answer_format
from vlmrl.tasks.base import Example, Task, TaskParams, Video, check, in_split, register_task

DIRECTIONS = ("left", "right", "up", "down")
STEP = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
SIDES = {"left": ("right", "left"), "right": ("left", "right"), "up": ("bottom", "top"), "down": ("top", "bottom")}
"""Where a square moving each way starts and where it ends."""
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 160, 70)}
STRICT = Rubric({"format": 1.0, "accuracy": 1.0})
_WORD = re.compile(r"\s*([a-z]+)\s*\.?\s*")


@dataclass
class MotionParams(TaskParams):
    """Parameters of the motion task."""

    frames: int = 4
    """Frames per video."""
    fps: float = 2.0
    """Frames per second (the frames' times are k / fps)."""
    image_size: int = 112
    """Side of the square frames in pixels."""
    square: float = 0.25
    """Side of each moving square as a fraction of the frame's side."""
    travel: float = 0.5
    """How far a square moves from the first frame to the last, as a fraction of the frame's side."""
    objects: int = 1
    """Squares per video (1-3, each its own colour and direction); the question names one colour."""
    directions: tuple[str, ...] = DIRECTIONS
    """The directions a square may take (and the answers)."""
    bounce: bool = False
    """Each square goes out along its direction and comes back; the answer is the way it went first."""
    view_frames: int = 0
    """Frames the model is shown, spread from the first to the last (0: all of them); the whole video
    stays for the `frames` tool."""

    def validate(self) -> None:
        super().validate()
        check(2 <= self.frames <= 64, f"frames must be in 2..64, got {self.frames}")
        check(0 < self.fps <= 60, f"fps must be in (0, 60], got {self.fps}")
        check(32 <= self.image_size <= 1024, f"image_size must be in 32..1024, got {self.image_size}")
        check(0.05 <= self.square <= 0.4, f"square must be in [0.05, 0.4], got {self.square}")
        check(0 < self.travel <= 1 - self.square, f"travel must be in (0, 1 - square], got {self.travel}")
        check(1 <= self.objects <= len(COLOURS), f"objects must be in 1..{len(COLOURS)}, got {self.objects}")
        distinct = len(set(self.directions)) == len(self.directions) >= 2
        check(distinct and all(d in DIRECTIONS for d in self.directions),
              f"directions must be two or more distinct names from {', '.join(DIRECTIONS)}, got {self.directions!r}")
        check(self.view_frames == 0 or 2 <= self.view_frames <= self.frames,
              f"view_frames must be 0 (all) or in 2..frames ({self.frames}), got {self.view_frames}")


@dataclass(frozen=True)
class Path:
    """One square's straight path: its colour, direction, centre (x, y) of the path, in pixels."""

    colour: str
    direction: str
    centre: tuple[int, int]

    def corner(self, k: int, frames: int, side: int, travel: int, bounce: bool = False) -> tuple[int, int]:
        """Top-left corner of the square in frame k: from centre - travel/2 to centre + travel/2 (and,
        bouncing, back: at the far end in the middle frame)."""
        dx, dy = STEP[self.direction]
        along = 1 - abs(2 * k / (frames - 1) - 1) if bounce else k / (frames - 1)  # 0 at the start, 1 at the far end
        offset = round(travel * (along - 0.5))
        return self.centre[0] + dx * offset - side // 2, self.centre[1] + dy * offset - side // 2


@register_task
class MotionTask(Task):
    """Tell which way a square moves across a short video."""

    name = "motion"
    description = "which way (left, right, up, down) a coloured square moves across a short video"
    Params = MotionParams
    params: MotionParams

    def _paths(self, rng: random.Random) -> list[Path]:
        """`objects` paths of distinct colours, each within the frame at every step."""
        p = self.params
        side, travel = round(p.square * p.image_size), round(p.travel * p.image_size)
        low, high = side // 2 + travel // 2 + 1, p.image_size - side // 2 - travel // 2 - 1
        free_low, free_high = side // 2 + 1, p.image_size - side // 2 - 1
        paths = []
        for colour in rng.sample(sorted(COLOURS), p.objects):
            direction = rng.choice(p.directions)
            along, across = rng.randint(low, high), rng.randint(free_low, free_high)
            centre = (along, across) if STEP[direction][0] else (across, along)
            paths.append(Path(colour, direction, centre))
        return paths

    def frames(self, paths: list[Path]) -> list[Image.Image]:
        """The video's frames: every square at its place in frame k (later paths drawn on top)."""
        p = self.params
        side, travel = round(p.square * p.image_size), round(p.travel * p.image_size)
        frames = []
        for k in range(p.frames):
            frame = Image.new("RGB", (p.image_size, p.image_size), "white")
            draw = ImageDraw.Draw(frame)
            for path in paths:
                x, y = path.corner(k, p.frames, side, travel, p.bounce)
                draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[path.colour])
            frames.append(frame)
        return frames

    def _example(self, idx: int, split: str) -> Example:
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            paths = self._paths(rng)
            key = ";".join(f"{q.colour},{q.direction},{q.centre[0]},{q.centre[1]}" for q in paths)
            if in_split(key, split):
                break
        else:  # pragma: no cover - probability 2**-1000
            raise RuntimeError("no video landed in the split")
        asked = rng.choice(paths)
        full = Video(self.frames(paths), [k / p.fps for k in range(p.frames)])
        shown = full
        if p.view_frames:
            keep = [round(k * (p.frames - 1) / (p.view_frames - 1)) for k in range(p.view_frames)]
            shown = Video([full.frames[k] for k in keep], [full.timestamps[k] for k in keep])
        words = ", ".join(p.directions[:-1]) + f" or {p.directions[-1]}"
        prompt = (f"<video>In which direction does the {asked.colour} square move{' first' if p.bounce else ''}: "
                  f"{words}? Think step by step inside <think> </think>, then give the direction inside "
                  "<answer> </answer>.")
        start, end = SIDES[asked.direction]
        reference = (f"<think> The {asked.colour} square goes from the {start} to the {end}"
                     f"{' and back' if p.bounce else ''}. </think> <answer> {asked.direction} </answer>")
        call = ('<tool_call>\n' + json.dumps({"name": "frames", "arguments": {"start": 0, "end": full.timestamps[-1] / 2}})
                + '\n</tool_call>')
        meta = {"idx": idx, "split": split, "colour": asked.colour, "direction": asked.direction,
                "paths": [[q.colour, q.direction, *q.centre] for q in paths], "frames": p.frames, "fps": p.fps}
        if p.view_frames:
            meta["reference_turns"] = [call, reference]
        return Example(prompt=prompt, answer=asked.direction, meta=meta, reference_completion=reference,
                       videos=[shown], video_originals=[full])

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """Strict rubric, total in [0, 2]: format + accuracy (see the module docstring)."""
        answer = extract_tag(completion, "answer")
        word = _WORD.fullmatch(answer.lower()) if answer is not None else None
        right = word is not None and word.group(1) == example.meta["direction"]
        return STRICT({"format": think_answer_format(completion), "accuracy": float(right)})
