"""How fast the tasks make examples: 1,000 examples per task and split on one CPU core.

Run: `python benchmarks/bench_tasks.py [--n 1000]`. Prints a table (seconds to make n examples, and
to score their reference completions). The target is under 5 s per 1,000 examples. Geometry reads
a small dataset (200 rows, 224x224 diagrams, open-r1 schema, parquet) written to a temporary folder
first; its one-off load time is reported separately, and its examples wrap around the 200 rows.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw


def write_geometry_data(folder: Path, rows: int = 200) -> Path:
    """A parquet file in the open-r1 schema: image, problem, solution."""
    import datasets

    datasets.disable_progress_bars()
    images, problems, solutions = [], [], []
    for i in range(rows):
        image = Image.new("RGB", (224, 224), "white")
        draw = ImageDraw.Draw(image)
        draw.polygon([(20, 200), (200, 200), (20 + i % 150, 30)], outline="black", width=2)
        draw.text((100, 205), f"{i + 3} cm", fill="black")
        images.append(image)
        problems.append(f"The base of the triangle is {i + 3} cm and its height is 4 cm. What is its area?")
        solutions.append(f"<think> Area = base x height / 2 = {i + 3} x 4 / 2. </think> "
                         f"<answer> \\boxed{{{2 * (i + 3)}}} </answer>")
    features = datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"),
                                  "solution": datasets.Value("string")})
    path = folder / "geometry.parquet"
    datasets.Dataset.from_dict({"image": images, "problem": problems, "solution": solutions},
                               features=features).to_parquet(str(path))
    return path


def time_task(task, split: str, n: int) -> tuple[float, float]:
    """(seconds to make n examples, seconds to score their reference completions)."""
    start = time.perf_counter()
    examples = [task.example(i, split) for i in range(n)]
    made = time.perf_counter() - start
    start = time.perf_counter()
    for example in examples:
        task.score(example, example.reference_completion)
    return made, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="examples per task and split")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    from vlmrl.tasks import get_task

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        source = write_geometry_data(Path(tmp))
        start = time.perf_counter()
        geometry = get_task("geometry", source=str(source))
        geometry.splits  # loads the dataset
        load = time.perf_counter() - start
        tasks = [("cryptogram", get_task("cryptogram")), ("shapes", get_task("shapes")),
                 ("grounding", get_task("grounding")), ("geometry", geometry)]
        for name, task in tasks:
            for split in task.splits:
                made, scored = time_task(task, split, args.n)
                rows.append((name, split, made, scored))
    print(f"{args.n} examples per task and split, one core (geometry: dataset load {load:.2f} s, once)\n")
    print(f"{'task':<12}{'split':<8}{'make (s)':>10}{'score refs (s)':>16}{'ms/example':>12}")
    for name, split, made, scored in rows:
        print(f"{name:<12}{split:<8}{made:>10.2f}{scored:>16.2f}{1000 * made / args.n:>12.2f}")
    slow = [f"{name}/{split}" for name, split, made, _ in rows if made * 1000 / args.n >= 5.0]
    print("\nall under 5 s per 1,000 examples" if not slow else f"\nover 5 s per 1,000: {', '.join(slow)}")


if __name__ == "__main__":
    main()
