"""A study's arms at equal steps and at equal cost: the tables of docs/results.md's distillation study.

    python benchmarks/study_clock.py runs/study-distill [--split test] [--target teacher|0.9]

Reads OUTPUT_DIR/ARM/seed_S/metrics.jsonl of a `vlmrl compare` study (finished or partial runs) and
prints, per arm, Markdown tables of:
- the cost of a step: the mean wall-clock `seconds` and CPU seconds (`time/cpu`: the main process's
  user + sys) per training step, evaluation excluded;
- held-out accuracy (eval/<split>/accuracy) at every evaluated step, mean +- sample std over the
  seeds that reached it, and the first evaluated step at which each seed reached the target: the
  teacher's held-out accuracy on that seed's held-out set (eval/<split>/teacher/accuracy, logged
  at step 0 by the distilling runs; the held-out examples depend on the run's seed, so every arm's
  run of seed s is evaluated on the same ones), or a fixed accuracy;
- accuracy at equal cost: for each arm, over its finished runs (those with final/), the accuracy at
  the last evaluated step whose cumulative CPU seconds (and, beside it, wall seconds) are within the
  budget, mean over seeds; the budget is the cost of the arm that costs least on average, its
  costliest seed's (so that arm is at its last step in every seed).
CPU seconds are the cost to compare on a loaded machine: the wall clock also counts the other
programs' time slices. Prints only; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows_of(run: Path) -> list[dict]:
    """The metric rows of one run that have a step, in order (a torn last line skipped)."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def arms_of(root: Path) -> tuple[dict[str, dict[int, list[dict]]], set[tuple[str, int]]]:
    """arm -> seed -> rows, for every OUTPUT_DIR/ARM/seed_S with a metrics.jsonl; and the
    (arm, seed) of the finished runs."""
    arms: dict[str, dict[int, list[dict]]] = {}
    done = set()
    for log in sorted(root.glob("*/seed_*/metrics.jsonl")):
        arm, seed = log.parent.parent.name, int(log.parent.name.removeprefix("seed_"))
        arms.setdefault(arm, {})[seed] = rows_of(log.parent)
        if (log.parent / "final").is_dir():
            done.add((arm, seed))
    return arms, done


def cumulative(rows: list[dict], key: str) -> dict[int, float]:
    """step -> the sum of `key` over the training steps up to it."""
    total, out = 0.0, {}
    for row in rows:
        total += float(row.get(key) or 0.0)
        out[row["step"]] = total
    return out


def evals(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if isinstance(row.get(key), (int, float))}


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f}% ± {100 * spread:.1f}"


def cost_table(arms: dict[str, dict[int, list[dict]]]) -> list[str]:
    lines = ["| arm | runs | steps | wall s / step | CPU s / step | CPU / wall |", "|---|---|---|---|---|---|"]
    for arm, seeds in arms.items():
        steps = [row for rows in seeds.values() for row in rows if row["step"] > 0 and "seconds" in row]
        wall = statistics.fmean(row["seconds"] for row in steps) if steps else float("nan")
        cpu_rows = [row["time/cpu"] for row in steps if "time/cpu" in row]
        cpu = statistics.fmean(cpu_rows) if cpu_rows else float("nan")
        lines.append(f"| {arm} | {len(seeds)} | {max((r['step'] for r in steps), default=0)} | {wall:.2f} | "
                     f"{cpu:.2f} | {cpu / wall:.2f} |")
    return lines


def accuracy_table(arms: dict[str, dict[int, list[dict]]], key: str, targets: dict[int, float]) -> list[str]:
    steps = sorted({step for seeds in arms.values() for rows in seeds.values() for step in evals(rows, key)})
    lines = ["| arm | " + " | ".join(f"step {s}" for s in steps) + " | first step >= target, per seed |",
             "|---|" + "---|" * (len(steps) + 1)]
    for arm, seeds in arms.items():
        cells = [mean_std([evals(rows, key)[s] for rows in seeds.values() if s in evals(rows, key)]) for s in steps]
        reached = []
        for seed, rows in sorted(seeds.items()):
            target = targets.get(seed)
            hits = [s for s, value in sorted(evals(rows, key).items()) if target is not None and value >= target]
            reached.append(f"{seed}: {hits[0] if hits else '-'}")
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {', '.join(reached)} |")
    return lines


def equal_cost_table(arms: dict[str, dict[int, list[dict]]], done: set[tuple[str, int]], key: str) -> list[str]:
    """Accuracy of each arm at the cheapest arm's total cost (CPU, and wall clock beside it)."""
    def totals(seeds: dict[int, list[dict]], clock: str) -> list[float]:
        return [cumulative(rows, clock)[rows[-1]["step"]] for rows in seeds.values() if rows]

    lines = ["| arm | budget | accuracy within the CPU budget (step) | accuracy within the wall budget (step) |",
             "|---|---|---|---|"]
    finished = {arm: {seed: rows for seed, rows in seeds.items() if (arm, seed) in done} for arm, seeds in arms.items()}
    finished = {arm: seeds for arm, seeds in finished.items() if seeds}
    if not finished:
        return lines
    budgets = []
    for clock in ("time/cpu", "seconds"):
        cheapest = min(finished.values(), key=lambda seeds: statistics.fmean(totals(seeds, clock)))
        budgets.append(max(totals(cheapest, clock)))
    cpu_budget, wall_budget = budgets
    for arm, seeds in finished.items():
        cells = []
        for clock, budget in (("time/cpu", cpu_budget), ("seconds", wall_budget)):
            values, steps = [], []
            for rows in seeds.values():
                spent = cumulative(rows, clock)
                within = [s for s in evals(rows, key) if spent.get(s, float("inf")) <= budget * 1.0001 and s > 0]
                if within:
                    values.append(evals(rows, key)[max(within)])
                    steps.append(max(within))
            cells.append(f"{mean_std(values)} ({'/'.join(map(str, steps)) or '-'})")
        lines.append(f"| {arm} | CPU {cpu_budget / 60:.1f} min, wall {wall_budget / 60:.1f} min | {cells[0]} | "
                     f"{cells[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study_dir", type=Path)
    parser.add_argument("--split", default="test")
    parser.add_argument("--target", default="teacher", help="'teacher' (its logged accuracy) or an accuracy in [0, 1]")
    args = parser.parse_args()
    arms, done = arms_of(args.study_dir)
    key, teacher_key = f"eval/{args.split}/accuracy", f"eval/{args.split}/teacher/accuracy"
    teacher = {seed: row[teacher_key] for seeds in arms.values() for seed, rows in seeds.items() for row in rows
               if teacher_key in row}
    targets = teacher if args.target == "teacher" else {seed: float(args.target) for seeds in arms.values()
                                                        for seed in seeds}
    print("target per seed: " + (", ".join(f"{seed}: {100 * value:.1f}%" for seed, value in sorted(targets.items()))
                                 or "n/a") + f" ({'the teacher' if args.target == 'teacher' else 'given'})\n")
    for table in (cost_table(arms), accuracy_table(arms, key, targets), equal_cost_table(arms, done, key)):
        print("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
