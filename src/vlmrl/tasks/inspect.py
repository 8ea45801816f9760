"""`vlmrl tasks list` and `vlmrl tasks show`: look at the tasks before training on them.

`format_task_list` describes each registered task and its parameters; `show_task` prints a few
examples (prompt, answer, reference completion and the score it gets) and saves their images, so a
person can check the images are legible and the rewards sensible.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from vlmrl.errors import VlmrlError
from vlmrl.tasks.base import get_task, list_tasks, param_table, task_class


def format_task_list() -> str:
    """Each task's name, one-line description, and parameters with type, default and meaning."""
    lines: list[str] = []
    for name in list_tasks():
        cls = task_class(name)
        lines.append(f"{name}: {cls.description}")
        for param, type_name, default, doc in param_table(cls.Params):
            lines.append(f"    {param}: {type_name} = {default!r}  # {doc}")
        lines.append("")
    lines.append("Show examples: vlmrl tasks show NAME [--split S] [--n 4] [--out DIR] [key=value ...]")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")


def show_task(name: str, params: dict[str, Any], split: str = "train", n: int = 4, out_dir: str | None = None) -> str:
    """Text describing examples 0..n-1 of `split`; their images are written to
    `out_dir/{name}_{split}_{i}.png` when `out_dir` is given."""
    if n < 0:
        raise VlmrlError(f"--n must be >= 0, got {n}")
    task = get_task(name, **params)
    task.check_split(split)
    folder = Path(out_dir) if out_dir else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "defaults"
    lines = [f"task {name} ({shown}), split {split}, splits: {', '.join(task.splits)}"]
    for i in range(n):
        example = task.example(i, split=split)
        scores = task.score(example, example.reference_completion)
        width, height = example.image.size
        where = ""
        if folder is not None:
            path = folder / f"{name}_{split}_{i}.png"
            example.image.save(path)
            where = f" -> {path}"
        lines += [f"\n=== example {i} ===", "prompt:", _indent(example.prompt), f"answer: {example.answer}",
                  "reference completion:", _indent(example.reference_completion),
                  "reference score: " + ", ".join(f"{k}={v:.3f}" for k, v in scores.items()),
                  f"image: {width}x{height}{where}"]
    return "\n".join(lines)
