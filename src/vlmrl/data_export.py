"""`vlmrl data geometry|bars OUT`: generated datasets written as files in a public layout.

`geometry`: generated geometry problems as Geometry3K-schema files.

The geometry task's generator (`source=procedural`, tasks/geometry_gen.py) is the same whether it
serves examples to a run or writes them here: OUT/train.jsonl and OUT/test.jsonl hold one problem a
line, `{"images": ["images/train_000000.png"], "problem": "<image>Find x.", "answer": "70",
"solution": "...", "kind": "triangle"}` (Geometry3K's columns, plus the worked solution and the
kind), and OUT/images/ the diagrams. `task.params.source=OUT` then reads them back like any
Geometry3K copy; other tools read them as JSON lines. A bad OUT (a file, under /proc, not writable)
or a full disk is one line, and a failed export leaves no JSONL file (disk.py).

`bars`: bar charts asking "Which colour is the tallest bar?" (data/bars.py) in TRL's layout, the
worked example of bringing your own data (docs/own-data.md): `{"prompt": "<image>Which colour is the
tallest bar?", "images": ["images/train_000000.png"], "answer": "red", "solution": "<think> The
tallest bar is red. </think> <answer> red </answer>", "colors": [...], "heights": [...]}`.
`task.name=dataset task.params.path=OUT` reads them (the gold answer from `answer`; with
`columns={reference: solution}` the SFT target is the worked solution, a weak teacher's in train when
`teacher_confuses` is set), and a TRL-style reward function receives `answer`, `solution`, `colors`
and `heights`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from vlmrl.data.bars import QUESTION, BarsParams, chart
from vlmrl.disk import output_folder, write_file
from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task


MAX_PROBLEMS = 1_000_000
"""Most problems per split: about 10 ms and 10 kB each (at image_size 224), so a million is hours
of work and gigabytes; more is a typo."""


def write_geometry(out: str | Path, n_train: int, n_test: int, seed: int = 0,
                   params: dict | None = None) -> dict[str, Path]:
    """Write `n_train` + `n_test` generated problems under `out` (the task's other parameters in
    `params`: image_size, kinds, choice_share); returns {split: its JSONL file}."""
    params = params or {}
    check_counts(n_train, n_test)
    if fixed := sorted({"seed", "source"} & set(params)):
        raise VlmrlError(f"{', '.join(fixed)} cannot be a generator parameter here (the source is procedural; "
                         "give the seed with --seed)")
    task = get_task("geometry", source="procedural", seed=seed, **params)  # image_size etc. checked here

    def row(idx: int, split: str, image: str) -> tuple[dict, object]:
        problem = task.generated_problem(idx, split)
        return ({"images": [image], "problem": problem.problem, "answer": problem.answer,
                 "solution": problem.solution, "kind": problem.kind}, problem.image)

    return write_rows(out, "geometry", {"train": n_train, "test": n_test}, row)


def write_bars(out: str | Path, n_train: int, n_test: int, seed: int = 0,
               params: dict | None = None) -> dict[str, Path]:
    """Write `n_train` + `n_test` bar charts under `out` in TRL's layout (chart parameters in
    `params`: image_size, bars, margin, teacher_confuses); returns {split: its JSONL file}."""
    check_counts(n_train, n_test)
    unknown = sorted(set(params or {}) - set(BarsParams.__dataclass_fields__))
    if unknown:
        raise VlmrlError(f"unknown bars parameter(s) {unknown}; valid: {', '.join(BarsParams.__dataclass_fields__)}")
    settings = BarsParams(**(params or {}))
    settings.validate()

    def row(idx: int, split: str, image: str) -> tuple[dict, object]:
        drawn = chart(seed, split, idx, settings)
        teacher = settings.confused() if split == "train" else ()
        return ({"prompt": QUESTION, "images": [image], "answer": drawn.answer, "solution": drawn.solution(teacher),
                 "colors": drawn.colors, "heights": drawn.heights}, drawn.image)

    return write_rows(out, "bars", {"train": n_train, "test": n_test}, row)


def check_counts(n_train: int, n_test: int) -> None:
    """One line for a count out of range."""
    if not (1 <= n_train <= MAX_PROBLEMS and 0 <= n_test <= MAX_PROBLEMS):
        raise VlmrlError(f"--n must be in [1, {MAX_PROBLEMS:,}] and --test in [0, {MAX_PROBLEMS:,}]; "
                         f"got {n_train} and {n_test}")


Row = Callable[[int, str, str], tuple[dict, object]]
"""(idx, split, the image's relative path) -> (the JSONL row, its PIL image)."""


def write_rows(out: str | Path, name: str, counts: dict[str, int], row: Row) -> dict[str, Path]:
    """Rows 0..count-1 of each split, each image to out/images/, each split's lines to out/{split}.jsonl.

    Every file is written whole or not at all (disk.py), and the JSONL files, which make the folder
    data, are removed first and written last: an export that fails (a full disk) leaves no JSONL file
    that points at missing or mixed images."""
    out = output_folder(out, f"the {name} data")
    output_folder(out / "images", f"the {name} images")
    for split in counts:  # an earlier export's: its images are about to be replaced
        (out / f"{split}.jsonl").unlink(missing_ok=True)
    written = {}
    for split, count in counts.items():
        if count:
            written[split] = write_file(out / f"{split}.jsonl", f"the {split} rows",
                                        lambda temporary, split=split, count=count:
                                        _write_split(name, row, out, split, count, temporary))
    return written


def _write_split(name: str, row: Row, out: Path, split: str, count: int, lines_path: Path) -> None:
    """Rows 0..count-1 of `split`: each image to out/images/, each line to `lines_path`."""
    with lines_path.open("w") as lines:
        for idx in tqdm(range(count), desc=f"{name} {split}", unit="row", dynamic_ncols=True):
            image = f"images/{split}_{idx:06d}.png"
            line, picture = row(idx, split, image)
            write_file(out / image, "an image", lambda temporary: picture.save(temporary, format="PNG"))
            lines.write(json.dumps(line) + "\n")
