"""What writing the logs costs a step on its path, written there and on the log thread (issue 54,
item 1: "metrics, rollout logs and the report written off the hot path"), side by side in one run.

Two GRPO runs of the shapes demo's settings (8 prompts x 8 completions, 40 new tokens, the small model,
random weights, the same seed) with the logs at their most: metrics to `metrics.jsonl` and
TensorBoard (`train.trackers=[tensorboard]`, the default) and the step's rollouts written every step
(`train.log_rollouts_every=1`; the demo writes them every 5th), one with `train.background_logs=false`
(written on the step's path), one with `true` (handed to the log thread). Per run, from its
metrics.jsonl: the mean step, `time/log` (the logs' time on the step's path: the row before's
metrics and this step's rollouts) and `time/log_write` (the thread's time, hidden); the two runs'
metrics.jsonl (wall-time values aside) and rollout files are checked equal. Then the HTML report of
the run (`vlmrl report`, not written by the training loop).

    OMP_NUM_THREADS=1 python benchmarks/overlap_logging.py [--steps 5] [--size small] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

WALL_TIME = ("seconds", "tokens_per_s", "time/")
"""Metrics whose values are clocks: the only ones the two runs may differ in."""


def without_clocks(run: Path) -> list[str]:
    """metrics.jsonl's lines with the clocks' values set to null."""
    return [json.dumps({k: None if k.startswith(WALL_TIME) else v for k, v in json.loads(line).items()})
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def rollout_files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "rollouts").rglob("*")) if p.is_file()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--size", default="small")
    parser.add_argument("--results", type=Path, help="append the lines to this markdown file")
    args = parser.parse_args()

    from vlmrl.config import load_config
    from vlmrl.demo import GRPO_8X8, PRESETS
    from vlmrl.models import build_tiny_model
    from vlmrl.report import write_report
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training import trainer

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    preset = PRESETS["shapes"]
    figures, runs = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_model(work / "model", size=args.size)
        for background in (False, True):
            overrides = [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={work / str(background)}",
                         *preset.shared, *GRPO_8X8, f"rollout.max_new_tokens={preset.max_new_tokens}", "train.lr=1e-4",
                         "train.micro_batch_size=64", f"train.steps={args.steps}", "train.save_every=0",
                         "train.log_rollouts_every=1", "train.trackers=[tensorboard]", "eval.every=0",
                         f"train.background_logs={str(background).lower()}"]
            runs[background] = trainer.train(load_config(None, overrides))
            rows = read_metrics(runs[background] / "metrics.jsonl")[1:]
            figures[background] = {key: statistics.fmean(row[key] for row in rows)
                                   for key in ("seconds", "time/log", "time/log_write")}
        same = (without_clocks(runs[True]) == without_clocks(runs[False])
                and rollout_files(runs[True]) == rollout_files(runs[False]))
        started = time.perf_counter()
        write_report(runs[True])
        report = time.perf_counter() - started
    lines = [f"`OMP_NUM_THREADS=1 python benchmarks/overlap_logging.py --steps {args.steps} --size {args.size}`", "",
             f"The shapes demo's GRPO settings (8 x 8, 40 new tokens, the {args.size} model), metrics to metrics.jsonl "
             f"and TensorBoard, rollouts (64 completions) written every step; mean over steps 2-{args.steps}; load "
             f"average before: {load}; metrics.jsonl (clocks aside) and rollout files of the two runs "
             f"{'equal' if same else 'DIFFERENT'}:", "",
             "| `train.background_logs` | a step (wall, s) | `time/log`: on the path (s) | share of the step "
             "| `time/log_write`: on the thread, hidden (s) |", "|---|---|---|---|---|"]
    for background in (False, True):
        f = figures[background]
        lines.append(f"| {str(background).lower()} | {f['seconds']:.3f} | {f['time/log']:.4f} | "
                     f"{f['time/log'] / f['seconds']:.2%} | {f['time/log_write']:.4f} |")
    lines += ["", f"The report (`vlmrl report`, once, after the run, not in a step): {report:.3f} s."]
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as out:
            out.write("\n" + "\n".join(lines) + "\n")
    if not same:
        raise SystemExit("the logs written on the thread differ from those written on the path")


if __name__ == "__main__":
    main()
