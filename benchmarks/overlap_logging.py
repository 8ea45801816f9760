"""What writing the logs costs a step (issue 54, item 1: "metrics, rollout logs and the report
written off the hot path", measured first).

One GRPO run of the shapes demo's settings (8 prompts x 8 completions, 40 new tokens, the small model,
random weights) with the logs at their most: metrics to `metrics.jsonl` and TensorBoard
(`train.trackers=[tensorboard]`, the default) and the step's rollouts written every step
(`train.log_rollouts_every=1`; the demo writes them every 5th). The trainer's two writers are timed
where the step calls them: `TrainingSession.record` (one row of metrics to every sink) and
`trainer.log_rollouts` (rollouts/step_*.jsonl, each image stored once); then the HTML report of the
run (`vlmrl report`, not written by the training loop). Each against the mean step.

    OMP_NUM_THREADS=1 python benchmarks/overlap_logging.py [--steps 5] [--size small] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def timed(owner, name: str, seconds: list[float]) -> None:
    """Replace owner.name by a wrapper that appends each call's seconds to `seconds`."""
    original = getattr(owner, name)

    def wrapper(*args):
        started = time.perf_counter()
        try:
            return original(*args)
        finally:
            seconds.append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


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
    from vlmrl.training import session, trainer

    record, rollouts = [], []
    timed(session.TrainingSession, "record", record)
    timed(trainer, "log_rollouts", rollouts)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    preset = PRESETS["shapes"]
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_model(work / "model", size=args.size)
        overrides = [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={work / 'run'}", *preset.shared,
                     *GRPO_8X8, f"rollout.max_new_tokens={preset.max_new_tokens}", "train.lr=1e-4",
                     "train.micro_batch_size=64", f"train.steps={args.steps}", "train.save_every=0",
                     "train.log_rollouts_every=1", "train.trackers=[tensorboard]", "eval.every=0"]
        run = trainer.train(load_config(None, overrides))
        steps = [row["seconds"] for row in read_metrics(run / "metrics.jsonl")][1:]
        started = time.perf_counter()
        write_report(run)
        report = time.perf_counter() - started
    step = statistics.fmean(steps)
    metrics, logged = statistics.fmean(record[1:]), statistics.fmean(rollouts[1:])
    lines = [f"`OMP_NUM_THREADS=1 python benchmarks/overlap_logging.py --steps {args.steps} --size {args.size}`", "",
             f"The shapes demo's GRPO settings (8 x 8, 40 new tokens, the {args.size} model), metrics to metrics.jsonl "
             f"and TensorBoard, rollouts written every step; mean over steps 2-{args.steps}; load average before: "
             f"{load}:", "",
             "| writer | seconds | share of the step |", "|---|---|---|",
             f"| a step (wall) | {step:.3f} | 1 |",
             f"| metrics (`session.record`: metrics.jsonl + TensorBoard) | {metrics:.4f} | {metrics / step:.2%} |",
             f"| rollouts (`log_rollouts`: 64 completions, images stored once) | {logged:.4f} | {logged / step:.2%} |",
             f"| the report (`vlmrl report`, once, after the run) | {report:.3f} | not in a step |"]
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as out:
            out.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
