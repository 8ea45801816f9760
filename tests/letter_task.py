"""An easy task for trainer tests, loaded by import path (`task.name=letter_task:LetterTask`): the
reward is the share of the letter 'a' among the letters of the completion, so even a random tiny
model gets a learning signal from its first step."""

from __future__ import annotations

from PIL import Image

from vlmrl.tasks import Example, Task


class LetterTask(Task):
    name = "letters"
    description = "Write the letter a (reward: share of 'a' among the letters)."

    def _example(self, idx: int, split: str) -> Example:
        image = Image.new("RGB", (56, 56), (idx * 40 % 256, 90, 160))
        return Example(image=image, prompt="Write the letter a.", answer="a", meta={"idx": idx},
                       reference_completion="a a a a")

    def score(self, example: Example, completion: str) -> dict[str, float]:
        letters = [c for c in completion if c.isalpha()]
        share = sum(c == "a" for c in letters) / len(letters) if letters else 0.0
        return {"share": share, "total": share, "accuracy": float(share == 1.0)}


class ColorTask(Task):
    """Name the colour of the image: the answer is in the image alone, so a model that learns it
    must be reading the pixels (tests that images reach the model aligned with their prompts)."""

    name = "color"
    description = "Say red or blue for a solid-colour image."

    def _example(self, idx: int, split: str) -> Example:
        color = ("red", "blue")[self.rng(split, idx).random() < 0.5]
        image = Image.new("RGB", (56, 56), (220, 30, 30) if color == "red" else (30, 30, 220))
        return Example(image=image, prompt="Which colour?", answer=color, meta={"idx": idx},
                       reference_completion=color)

    def score(self, example: Example, completion: str) -> dict[str, float]:
        right = float(completion.strip() == example.answer)
        return {"total": right, "accuracy": right}

    def image_only_spans(self, example: Example) -> list[tuple[int, int]]:
        return [(0, len(example.reference_completion))]  # the colour: only the image tells it


class LookTask(LetterTask):
    """The letter task with a reference trajectory that zooms first (SFT on tool trajectories)."""

    name = "look"
    CALL = '<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 28, 28]}}\n</tool_call>'

    def _example(self, idx: int, split: str) -> Example:
        example = super()._example(idx, split)
        example.meta["reference_turns"] = [self.CALL, "a a a a"]
        return example


class SolutionTask(LetterTask):
    """The letter task with a data column, `solution`, that the rewards receive (as a dataset row's
    extra columns arrive: `example.meta["columns"]`)."""

    name = "solution"

    def _example(self, idx: int, split: str) -> Example:
        example = super()._example(idx, split)
        example.meta["columns"] = {"solution": "$" + "1" * (1 + idx % 3) + "$"}
        return example
