"""Bad data met mid-run: a train example the task cannot make, whose image the model's processor
cannot encode, or whose prompt is longer than `rollout.max_prompt_length`, found after the preflight
(which makes and encodes only the first batch).

Without this, a bad image at row 50 of a data file (one the loader could not catch: an image
with `check_images=false`, or one that decodes but that the processor refuses, such as a 2 x 1000
strip past Qwen's aspect-ratio limit) crashed the run at the step that reached it, with no
checkpoint. `RowGuard` follows the task's `on_bad_row` (tasks without one: "error"):
- "skip": the bad example is replaced by the next good one of the split not already drawn with
  it (index + 1, + 2, ...), with a warning the first time; the count of replaced examples is each step's `bad_rows_skipped`
  metric. The replacement depends only on the data, so a resumed run draws what an uninterrupted
  one does;
- "error": the step still completes its draw (every process reaches the same collectives), then
  the trainer saves a checkpoint of the last finished step and stops with one line naming the row.

The fixed held-out set of each eval split is made and encoded once before step 1 (`checked`), so
a bad held-out example stops the run before it starts, or is replaced, never met at an evaluation.
Task errors are caught when an example is made. In RL, processor errors are found lazily: a batch
whose encoding fails (before anything is computed) has each of its examples encoded alone, so the
happy path costs nothing; a failure that no single example reproduces is not the data's and keeps
its traceback. A prompt past `rollout.max_prompt_length` (a larger image, a longer video, a longer
question than the first batch's) is found the same way: the rollout's encoding raises `PromptTooLong`
(rollout/prompts.py) and the row is bad, never trained on cut nor past the limit; it used to be
trained on whole, past the limit the preflight's memory estimate counted on, with nothing said. SFT
cannot redo an update once a micro-batch has run, so it encodes each data-file row alone the first
time it is drawn, its length checked too (procedural examples, drawn by vlmrl's own tasks, are not:
that would be one more processor call every step, 47 ms for 16 motion videos on this CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.errors import VlmrlError, one_line, warn
from vlmrl.rollout.prompts import encode_prompts, length_problem
from vlmrl.tasks import Example, Task

MAX_REPLACEMENTS = 100
"""Bad examples in a row after one that are looked past before the split counts as unusable."""


def make_example(task: Task, idx: int, split: str) -> Example:
    """task.example(idx, split); a failure other than a VlmrlError is told with the split and index."""
    try:
        return task.example(idx, split)
    except VlmrlError:
        raise
    except Exception as error:  # noqa: BLE001 - a task of the user's own: say where it failed
        raise VlmrlError(f"task {task.name!r} cannot make {split} example {idx}: "
                         f"{type(error).__name__}: {error}") from error


def describe(example: Example, idx: int, split: str) -> str:
    """`train example 7` plus where it came from (a data row), its images' sizes and modes and its videos'."""
    where = ""
    if "row" in example.meta:
        where = f" (row {example.meta['row']} of split {example.meta.get('source_split', split)!r})"
    images = ", ".join(f"{image.width}x{image.height} {image.mode}" for image in example.images)
    videos = "".join(f", video of {len(v.frames)} frames {v.frames[0].width}x{v.frames[0].height}" for v in example.videos)
    return f"{split} example {idx}{where}, image {images or 'none'}{videos}"


def row_problem(processor, example: Example, idx: int, split: str, limit: int | None = None) -> str | None:
    """Why example `idx` of `split` is a bad row for this model, one line: the processor cannot encode
    it alone (its own error), or its prompt is longer than `limit` tokens; None for a good one."""
    try:
        ids = encode_prompts(processor, [example], torch.device("cpu"))["input_ids"][0]  # (P,)
    except Exception as error:  # noqa: BLE001 - the processor's own message is what is wrong
        return (f"the processor cannot encode {describe(example, idx, split)}: "
                f"{type(error).__name__}: {one_line(error)}")
    problem = length_problem(processor, ids, limit) if limit is not None else None
    return f"the prompt of {describe(example, idx, split)} {problem}: image and video tokens are never cut" \
        if problem else None


@dataclass
class RowGuard:
    """Draws train examples for a run and follows `on_bad_row` on the bad ones (see the module doc)."""

    task: Task
    processor: object
    split: str = "train"
    limit: int | None = None
    """rollout.max_prompt_length: a longer prompt is a bad row (None: no limit)."""
    bad: dict[int, str] = field(default_factory=dict)
    """Example index -> what is wrong with it: every bad example met so far on this process."""
    screened: dict = field(default_factory=dict)
    """(source split, row) -> what `checked(data_rows_only=True)` found encoding it (None: fine)."""
    stop: str | None = None
    """With on_bad_row=error: the first bad example met, as the one-line reason to stop."""

    @property
    def skips(self) -> bool:
        return getattr(getattr(self.task, "params", None), "on_bad_row", "error") == "skip"

    def draw(self, indices: list[int]) -> tuple[list[int], list[Example]]:
        """The examples at `indices`, a bad one replaced by the next good one; (indices used, examples):
        where the two lists of indices differ, a bad example was replaced."""
        used, examples, taken = [], [], set(indices)
        for idx in indices:
            made = self._made(idx)
            if made is None:
                idx, made = self._replacement(idx, taken)
                taken.add(idx)
            used.append(idx)
            examples.append(made)
        return used, examples

    def checked(self, indices: list[int], data_rows_only: bool = False) -> tuple[list[int], list[Example]]:
        """`draw`, with each example also encoded alone first: every one (the preflight's first batch,
        the held-out sets: nothing next to loading the model), or with `data_rows_only` each row of a
        data file (meta "row") the first time it is drawn (SFT, whose update cannot be redone once a
        micro-batch has run: one extra processor call per row, in the first epoch only)."""
        used, examples = self.draw(indices)
        problems = [self._screened(example, idx) if data_rows_only else self._problem(example, idx)
                    for idx, example in zip(used, examples)]
        if not any(problems):
            return used, examples
        for idx, problem in zip(used, problems):
            if problem:
                self._mark(idx, problem)
        return self.draw(used)

    def after_encoding_failure(self, indices: list[int], examples: list[Example],
                               error: Exception) -> tuple[list[int], list[Example]]:
        """A batch failed to encode with `error`: encode each example alone; those that fail are bad
        rows and are replaced, as are those longer than `limit` (`error` is then `PromptTooLong`).
        Re-raises `error` when every example is good alone (not the data's fault)."""
        problems = {idx: self._problem(example, idx) for idx, example in zip(indices, examples)}
        if not any(problems.values()):
            raise error
        for idx, problem in problems.items():
            if problem:
                self._mark(idx, problem)
        return self.draw(indices)

    def _problem(self, example: Example, idx: int) -> str | None:
        """What is wrong with example `idx` alone (`row_problem`), or None."""
        return row_problem(self.processor, example, idx, self.split, self.limit)

    def _screened(self, example: Example, idx: int) -> str | None:
        """What is wrong with `example`, a data-file row, encoded the first time its row is drawn and
        remembered after (None for a good row, and for an example that is no data row)."""
        if "row" not in example.meta:
            return None
        key = (example.meta.get("source_split"), example.meta["row"])
        if key not in self.screened:
            self.screened[key] = self._problem(example, idx)
        return self.screened[key]

    def _made(self, idx: int) -> Example | None:
        """Example `idx`, or None when it is bad (known, or the task fails to make it now)."""
        if idx in self.bad:
            return None
        try:
            return make_example(self.task, idx, self.split)
        except VlmrlError as error:
            self._mark(idx, f"{self.split} example {idx}: {error}")
            return None

    def _replacement(self, bad_idx: int, taken: set[int]) -> tuple[int, Example]:
        """The next example after `bad_idx`, not in `taken` (the draw's), that the task makes and the
        processor encodes."""
        for idx in range(bad_idx + 1, bad_idx + 1 + MAX_REPLACEMENTS + len(taken)):
            if idx in taken:
                continue
            made = self._made(idx)
            if made is None:
                continue
            problem = self._problem(made, idx)
            if problem is None:
                return idx, made
            self._mark(idx, problem)
        raise VlmrlError(f"{MAX_REPLACEMENTS} {self.split} examples in a row after example {bad_idx} are bad "
                         f"(first: {self.bad[bad_idx]}); fix the data")

    def _mark(self, idx: int, problem: str) -> None:
        """Remember that example `idx` is bad; warn the first time (skip) or keep it as the reason to stop."""
        if idx in self.bad:
            return
        self.bad[idx] = problem
        if self.skips:
            warn(f"skipped a bad row (on_bad_row=skip): {problem}")
        elif self.stop is None:
            self.stop = problem
