"""`geometry`: visual math QA (geometry diagrams): generated here, or from local files or a
Hugging Face hub dataset.

`source=procedural` needs no data: each example is drawn by tasks/geometry_gen.py (angles in
triangles and on parallel lines, isosceles and right triangles, Pythagoras, areas and perimeters,
circle arcs; integer, fraction, surd, pi and multiple-choice answers), deterministic from (seed,
split, idx), train and test disjoint by the problem's content; `vlmrl data geometry OUT` writes the
same problems as Geometry3K-schema files.

Adapters read three public schemas (column names as published on the hub):
- `open_r1` (lmms-lab/multimodal-open-r1-8k-verified): image, problem, solution; the gold answer is
  the last <answer>...</answer> of the solution (a \\boxed{} inside it wins), else its last
  \\boxed{}, else the `original_answer` column. The solution's reasoning feeds the reference.
- `geometry3k` (hiyouga/geometry3k, as published for RL): images (a list; the first is used),
  problem (with an `<image>` marker, removed), answer.
- `geoqa` (leonardPKU/GEOQA_R1V_Train_8K, as used by R1-V): image, problem, solution holding
  `<answer> ... </answer>`.
`auto` picks geometry3k when there is an `answer` column, else open_r1/geoqa when there is a
`solution` column. `question` is accepted for `problem`; `image_column` overrides the image column.

Files are read by the `dataset` task (tasks/dataset.py: one loader in the codebase) with the schema
as its column mapping, `<image>` markers dropped (every image of a row shown before the problem)
and the math verifier. Its rules hold here: images decoded to RGB and downscaled (data/images.py);
splits the dataset's, else test_fraction of train held out by row with split_seed; every row of
every split checked when the data loads (on_bad_row). Unlike `dataset`, rows are served in file
order unless shuffle=true (each epoch in a new seeded order).

Reward: "accuracy" (math_verify equivalence of the single <answer> with the gold, falling back to
normalized strings; choice letters "A", "(A)", "A." agree) + format_weight x "format" (strict
<think>/<answer> layout); total in [0, 1 + format_weight]. Loading is lazy and cached per source.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from vlmrl.data.columns import Columns, RowText, answer_from_solution, last_boxed  # noqa: F401  (re-exported)
from vlmrl.data.sources import DATA_SUFFIXES
from vlmrl.errors import VlmrlError
from vlmrl.tasks.base import Example, Task, TaskParams, check, in_split, register_task
from vlmrl.tasks.dataset import (
    INSTRUCTION,
    DatasetParams,
    DatasetTask,
    FileParams,
    Loaded,
    reasoning_from_solution,
    reference_of,
)
from vlmrl.tasks.geometry_gen import KINDS, Problem, make_problem
from vlmrl.rewards.verify import Rubric, extract_tag, math_equal, think_answer_format

PROCEDURAL = "procedural"
SCHEMAS = ("auto", "open_r1", "geometry3k", "geoqa")
MAX_IMAGE_SIZE = 4096
"""Largest side of a generated diagram: 16 megapixels, past what any model's processor keeps (a
side of 100000 drew for minutes before the first problem)."""
_TAGS = re.compile(r"</?(?:think|answer)>")


def _prompt(problem: str) -> str:
    """The prompt of a problem text (Geometry3K's `<image>` marker dropped): the same for files and
    for generated problems, so exported data reads back as it was served."""
    return " ".join(problem.replace("<image>", " ").split()) + f"\n{INSTRUCTION}"


def _reference(reasoning: str, answer: str) -> str:
    """The reference completion (SFT target) of a worked solution and its answer."""
    return f"<think> {reasoning} </think> <answer> {answer} </answer>"


@dataclass
class GeometryParams(FileParams):
    """Parameters of the geometry / visual math QA task: its own below, the file parameters
    (train_split ... format_weight) the dataset task's (`FileParams`), but `shuffle` off."""

    shuffle: bool = False
    """Serve train rows in a new seeded order each epoch (false: file order, every epoch)."""
    source: str = ""
    """"procedural" (problems generated here: no data needed), a local .json/.jsonl/.parquet file,
    a folder of them named {split}.{ext} or {split}-*.{ext} (a single file is the train split), or a
    Hugging Face hub dataset id."""
    schema: str = "auto"
    """Column layout: auto, open_r1, geometry3k or geoqa (see `vlmrl tasks list`)."""
    image_column: str = ""
    """Column holding the image(s); empty: "image" or "images"."""
    image_size: int = 224
    """source=procedural: side of the square diagram in pixels (64 to 4096)."""
    kinds: tuple[str, ...] = KINDS
    """source=procedural: the kinds of problem drawn from (triangle, isosceles, parallel,
    pythagoras, area, arc)."""
    choice_share: float = 0.25
    """source=procedural: share of problems given as four choices A-D (answered with the letter)."""

    def validate(self) -> None:
        TaskParams.validate(self)
        check(bool(self.source.strip()), "geometry needs source=procedural or a PATH_OR_HUB_ID (a "
              ".json/.jsonl/.parquet file, a folder of them, or a hub dataset id)")
        check(64 <= self.image_size <= MAX_IMAGE_SIZE,
              f"image_size must be in 64..{MAX_IMAGE_SIZE}, got {self.image_size}")
        check(bool(self.kinds) and set(self.kinds) <= set(KINDS),
              f"kinds must be some of {', '.join(KINDS)}, got {list(self.kinds)}")
        check(0.0 <= self.choice_share <= 1.0, f"choice_share must be in [0, 1], got {self.choice_share}")
        check(self.format_weight >= 0, f"format_weight must be >= 0, got {self.format_weight}")
        if self.source == PROCEDURAL:
            return
        check(self.schema in SCHEMAS, f"schema must be one of {', '.join(SCHEMAS)}, got {self.schema!r}")
        self.validate_files()
        looks_local = self.source.startswith(("/", ".", "~")) or Path(self.source).suffix in DATA_SUFFIXES
        check(not looks_local or Path(self.source).expanduser().exists(),
              f"geometry source {self.source!r} does not exist")


class GeometryFiles(DatasetTask):
    """The `dataset` task with geometry's schemas as its column mapping and geometry's prompt."""

    name = "geometry"

    def __init__(self, params: GeometryParams) -> None:
        self.geometry = params
        super().__init__(DatasetParams(seed=params.seed, path=params.source, markers="drop", verifier="math",
                                       **params.file_params()))

    def choose_columns(self, names: list[str]) -> Columns:
        """The columns of the schema (auto: geometry3k with an `answer` column, else open_r1)."""
        schema = self.geometry.schema
        if schema == "auto":
            schema = "geometry3k" if "answer" in names else "open_r1" if "solution" in names else ""
            if not schema:
                raise VlmrlError(f"cannot tell the schema of columns {names}; need an 'answer' or 'solution' column")
        image = self.geometry.image_column or next((c for c in ("image", "images") if c in names), "")
        problem = next((c for c in ("problem", "question") if c in names), "")
        answer = "answer" if schema == "geometry3k" else "solution"
        missing = [what for what, col in (("image", image), ("problem", problem)) if not col or col not in names]
        if answer not in names:
            missing.append(answer)
        if missing:
            raise VlmrlError(f"schema {schema!r} needs columns {missing} but the data has {names}")
        fallback = "original_answer" if answer == "solution" and "original_answer" in names else ""
        return Columns(prompt=problem, answer=answer, images=image, layout=schema, answer_fallback=fallback,
                       strict_solution=True)

    def prompt_text(self, text: RowText) -> str:
        return _prompt(text.prompt)

    def answer_and_reference(self, text: RowText) -> tuple[str, str]:
        gold = _TAGS.sub(" ", text.answer).strip()
        return gold, reference_of(reasoning_from_solution(text.solution), gold, self.answer_format)

    def _example(self, idx: int, split: str) -> Example:
        example = super()._example(idx, split)
        example.meta["schema"] = self._data.columns.layout
        example.meta["image_size"] = list(example.image.size) if example.image else []
        return example


@register_task
class GeometryTask(Task):
    """Visual math QA from a dataset."""

    name = "geometry"
    description = ("visual math QA from local files or a hub id (schemas: open_r1, geometry3k, geoqa); "
                   "math-verify accuracy")
    Params = GeometryParams
    params: GeometryParams

    @functools.cached_property
    def files(self) -> GeometryFiles:
        """The `dataset` task reading the files (source other than procedural)."""
        return GeometryFiles(self.params)

    @property
    def _data(self) -> Loaded:
        """The loaded files: their columns and the rows each split serves."""
        return self.files._data

    @property
    def bad_rows(self) -> list[tuple[str, int, str]]:
        """(dataset split, row, what is wrong) of every row left out with on_bad_row=skip."""
        return [] if self.params.source == PROCEDURAL else self.files.bad_rows

    def data_line(self) -> str:
        """The preflight's line on the files (the mapping, the rows); "" for generated problems."""
        return "" if self.params.source == PROCEDURAL else self.files.data_line()

    def data_fingerprint(self) -> dict[str, str]:
        """The files' fingerprint (the dataset task's); {} for generated problems."""
        return {} if self.params.source == PROCEDURAL else self.files.data_fingerprint()

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "test") if self.params.source == PROCEDURAL else self.files.splits

    def size(self, split: str = "train") -> int | None:
        """How many rows `split` of the files serves (one epoch); None for generated problems (no end)."""
        return None if self.params.source == PROCEDURAL else self.files.size(split)

    def generated_problem(self, idx: int, split: str) -> Problem:
        """Problem `idx` of `split` from the generator (source=procedural): drawn again until its
        content belongs to the split, so train and test never share a problem."""
        p, rng = self.params, self.rng(split, idx)
        for _ in range(1000):
            problem = make_problem(rng, p.image_size, p.kinds, p.choice_share)
            if in_split(problem.key, split):
                return problem
        raise RuntimeError("no generated problem landed in the split")  # pragma: no cover - p = 0.5 ** 1000

    def _generated(self, idx: int, split: str) -> Example:
        problem = self.generated_problem(idx, split)
        meta = {"idx": idx, "split": split, "kind": problem.kind, "schema": PROCEDURAL,
                "image_size": list(problem.image.size)}
        return Example(image=problem.image, prompt=_prompt(problem.problem), answer=problem.answer, meta=meta,
                       reference_completion=_reference(problem.solution, problem.answer))

    def _example(self, idx: int, split: str) -> Example:
        if self.params.source == PROCEDURAL:
            return self._generated(idx, split)
        return self.files.example(idx, split)

    def score(self, example: Example, completion: str) -> dict[str, float]:
        """accuracy + format_weight * format; total in [0, 1 + format_weight]."""
        answer = extract_tag(completion, "answer")
        correct = float(answer is not None and math_equal(answer, example.answer))
        rubric = Rubric({"accuracy": 1.0, "format": self.params.format_weight})
        return rubric({"accuracy": correct, "format": think_answer_format(completion)})
