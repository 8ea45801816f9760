"""`vlmrl data geometry OUT`: generated geometry problems written as Geometry3K-schema files.

The geometry task's generator (`source=procedural`, tasks/geometry_gen.py) is the same whether it
serves examples to a run or writes them here: OUT/train.jsonl and OUT/test.jsonl hold one problem a
line, `{"images": ["images/train_000000.png"], "problem": "<image>Find x.", "answer": "70",
"solution": "...", "kind": "triangle"}` (Geometry3K's columns, plus the worked solution and the
kind), and OUT/images/ the diagrams. `task.params.source=OUT` then reads them back like any
Geometry3K copy; other tools read them as JSON lines. A bad OUT (a file, under /proc, not writable)
or a full disk is one line, and a failed export leaves no JSONL file (disk.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from vlmrl.disk import output_folder, write_file
from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task


MAX_PROBLEMS = 1_000_000
"""Most problems per split: about 10 ms and 10 kB each (at image_size 224), so a million is hours
of work and gigabytes; more is a typo."""


def write_geometry(out: str | Path, n_train: int, n_test: int, seed: int = 0,
                   params: dict | None = None) -> dict[str, Path]:
    """Write `n_train` + `n_test` generated problems under `out` (the task's other parameters in
    `params`: image_size, kinds, choice_share); returns {split: its JSONL file}.

    Every file is written whole or not at all (disk.py), and the JSONL files, which make the folder
    data, are removed first and written last: an export that fails (a full disk) leaves no JSONL file
    that points at missing or mixed diagrams."""
    params = params or {}
    if not (1 <= n_train <= MAX_PROBLEMS and 0 <= n_test <= MAX_PROBLEMS):
        raise VlmrlError(f"--n must be in [1, {MAX_PROBLEMS:,}] and --test in [0, {MAX_PROBLEMS:,}]; "
                         f"got {n_train} and {n_test}")
    if fixed := sorted({"seed", "source"} & set(params)):
        raise VlmrlError(f"{', '.join(fixed)} cannot be a generator parameter here (the source is procedural; "
                         "give the seed with --seed)")
    task = get_task("geometry", source="procedural", seed=seed, **params)  # image_size etc. checked here
    out = output_folder(out, "the geometry data")
    output_folder(out / "images", "the geometry diagrams")
    for split in ("train", "test"):  # an earlier export's: its diagrams are about to be replaced
        (out / f"{split}.jsonl").unlink(missing_ok=True)
    written = {}
    for split, count in (("train", n_train), ("test", n_test)):
        if count:
            written[split] = write_file(out / f"{split}.jsonl", f"the {split} problems",
                                        lambda temporary, split=split, count=count:
                                        _write_split(task, out, split, count, temporary))
    return written


def _write_split(task, out: Path, split: str, count: int, lines_path: Path) -> None:
    """Problems 0..count-1 of `split`: each diagram to out/images/, each line to `lines_path`."""
    with lines_path.open("w") as lines:
        for idx in tqdm(range(count), desc=f"geometry {split}", unit="problem", dynamic_ncols=True):
            problem = task.generated_problem(idx, split)
            image = f"images/{split}_{idx:06d}.png"
            write_file(out / image, "a diagram", lambda temporary: problem.image.save(temporary, format="PNG"))
            lines.write(json.dumps({"images": [image], "problem": problem.problem, "answer": problem.answer,
                                    "solution": problem.solution, "kind": problem.kind}) + "\n")
