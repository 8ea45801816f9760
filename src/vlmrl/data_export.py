"""`vlmrl data geometry OUT`: generated geometry problems written as Geometry3K-schema files.

The geometry task's generator (`source=procedural`, tasks/geometry_gen.py) is the same whether it
serves examples to a run or writes them here: OUT/train.jsonl and OUT/test.jsonl hold one problem a
line, `{"images": ["images/train_000000.png"], "problem": "<image>Find x.", "answer": "70",
"solution": "...", "kind": "triangle"}` (Geometry3K's columns, plus the worked solution and the
kind), and OUT/images/ the diagrams. `task.params.source=OUT` then reads them back like any
Geometry3K copy; other tools read them as JSON lines.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from vlmrl.errors import VlmrlError
from vlmrl.tasks import get_task


def write_geometry(out: str | Path, n_train: int, n_test: int, seed: int = 0,
                   params: dict | None = None) -> dict[str, Path]:
    """Write `n_train` + `n_test` generated problems under `out` (the task's other parameters in
    `params`: image_size, kinds, choice_share); returns {split: its JSONL file}."""
    params = params or {}
    if n_train < 1 or n_test < 0:
        raise VlmrlError(f"--n must be >= 1 and --test >= 0; got {n_train} and {n_test}")
    if fixed := sorted({"seed", "source"} & set(params)):
        raise VlmrlError(f"{', '.join(fixed)} cannot be a generator parameter here (the source is procedural; "
                         "give the seed with --seed)")
    task = get_task("geometry", source="procedural", seed=seed, **params)
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    written = {}
    for split, count in (("train", n_train), ("test", n_test)):
        if count == 0:
            continue
        path = out / f"{split}.jsonl"
        with path.open("w") as lines:
            for idx in tqdm(range(count), desc=f"geometry {split}", unit="problem", dynamic_ncols=True):
                problem = task.generated_problem(idx, split)
                image = f"images/{split}_{idx:06d}.png"
                problem.image.save(out / image)
                lines.write(json.dumps({"images": [image], "problem": problem.problem, "answer": problem.answer,
                                        "solution": problem.solution, "kind": problem.kind}) + "\n")
        written[split] = path
    return written
