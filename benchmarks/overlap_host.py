"""The host side of a step overlapped (issue 54, item 1): the data phase and the checkpoint phase
with and without their background workers, side by side in one run.

A dataset written to disk in TRL's layout (`train.jsonl`, `images/`): each row a question over
--images JPEG photos-like images (random noise, which compresses and decodes like a photo, not like a
flat drawing) of --side pixels. The `dataset` task reads and decodes each row's images from the files
when the step draws it, and the processor resizes and normalises them: the data phase. Two GRPO runs
of the tiny model, the same seed:

- plain: `train.prefetch_batches=0 train.background_checkpoints=false`, everything on the step's path;
- overlapped: `train.prefetch_batches=1 train.background_checkpoints=true`: the next call's examples
  made and encoded on a worker thread while the model generates and trains, and each step's
  checkpoint (`train.save_every=1`) copied and written on a background thread.

First, whether one worker thread is enough (`gil`): the worker's time on one generate call's
examples (make + decode + processor) alone, beside a thread running torch matmuls (which let the
GIL go, as the model's kernels do), and beside a thread running a pure-Python loop (which holds it).

Per run, the mean over steps 2.. of `time/data` (the data phase left on the step's path),
`time/data_ahead` (the worker's time, hidden), `time/checkpoint` (the checkpoint's time on the path),
and the step's wall time; and whether the two runs' losses and rewards are equal (they must be).

    OMP_NUM_THREADS=1 python benchmarks/overlap_host.py [--images 8 --side 448 --prompts 4 --steps 8]
        [--size tiny] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

TIMING = ("seconds", "tokens_per_s", "time/")
SIDES = {"plain": ("train.prefetch_batches=0", "train.background_checkpoints=false"),
         "overlapped": ("train.prefetch_batches=1", "train.background_checkpoints=true")}


def write_dataset(folder: Path, rows: int, images: int, side: int) -> None:
    """`rows` train rows (and 8 test rows) of `images` distinct noise JPEGs each, TRL's layout."""
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, count in (("train", rows), ("test", 8)):
        lines = []
        for row in range(count):
            paths = []
            for k in range(images):
                path = f"images/{split}_{row:05d}_{k}.jpg"
                pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / path, quality=90)
                paths.append(path)
            lines.append(json.dumps({"prompt": "<image>" * images + "How many pictures are there?",
                                     "images": paths, "answer": str(images)}))
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def run(side: str, work: Path, model: Path, data: Path, args: argparse.Namespace) -> list[dict]:
    """One GRPO run of `side`'s settings; its metrics rows."""
    from vlmrl.config import load_config
    from vlmrl.report.tracking import read_metrics
    from vlmrl.training.trainer import train

    overrides = [f"model.name_or_path={model}", "model.device=cpu", "task.name=dataset", f"task.params.path={data}",
                 "task.params.verifier=exact", "task.params.check_images=false", f"output_dir={work / side}",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.generation_batch_size={args.per_call}",
                 f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.tokens}",
                 f"train.micro_batch_size={args.prompts * args.group}", f"train.steps={args.steps}",
                 "train.save_every=1", "train.keep_checkpoints=2", "train.log_rollouts_every=0", "train.trackers=[]",
                 "eval.every=0", *SIDES[side]]
    return read_metrics(train(load_config(None, overrides)) / "metrics.jsonl")


def gil(model: Path, data: Path, args: argparse.Namespace) -> list[str]:
    """The worker's seconds on one call's examples, alone and beside a busy main thread (median of 3)."""
    import threading

    import torch

    from vlmrl.models.loading import load_processor
    from vlmrl.tasks import get_task
    from vlmrl.training.prefetch import Prefetcher

    task = get_task("dataset", path=str(data), verifier="exact", check_images="false")
    prefetcher = Prefetcher(task, load_processor(str(model)), limit=None, encode=True, depth=1)
    prefetcher.close()
    indices = list(range(args.per_call))

    def matmuls(stop: threading.Event) -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a

    def python_loop(stop: threading.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1

    lines = []
    for name, busy in (("alone", None), ("beside torch matmuls", matmuls), ("beside a pure-Python loop", python_loop)):
        times = []
        for _ in range(3):
            stop = threading.Event()
            other = threading.Thread(target=busy, args=(stop,)) if busy else None
            if other:
                other.start()
            times.append(prefetcher.prepare(indices).seconds)
            stop.set()
            if other:
                other.join()
        lines.append(f"- {name}: {statistics.median(times):.3f} s")
    return [f"The worker's time on one call ({args.per_call} prompts x {args.images} images), median of 3:", *lines, ""]


def mean_after_first(rows: list[dict], key: str) -> float:
    """The mean of `key` over steps 2..; for time/checkpoint (logged in the row after its save) over
    the saves after the first (which also makes the writer's copy of the processor, once)."""
    return statistics.fmean(row.get(key, 0.0) for row in rows[2 if key == "time/checkpoint" else 1:])


def report(args: argparse.Namespace, results: dict[str, list[dict]], wall: float) -> list[str]:
    """The markdown table of the two runs, and the equality check."""
    keys = ("time/data", "time/data_ahead", "time/checkpoint", "time/generate", "time/train", "seconds")
    lines = [f"`OMP_NUM_THREADS=1 python benchmarks/overlap_host.py --images {args.images} --side {args.side} --prompts "
             f"{args.prompts} --per-call {args.per_call} --steps {args.steps} --size {args.size}`", "",f"{args.prompts} prompts x {args.group} completions, {args.images} JPEG images of {args.side} px per "
             f"prompt read from disk, {args.per_call} prompt(s) per generate call, {args.tokens} new tokens, "
             f"the {args.size} model, a checkpoint after every step; mean over steps 2-{args.steps} (s; time/checkpoint: "
             f"the saves of steps 2-{args.steps - 1}):", "",
             "| run | " + " | ".join(f"`{key}`" for key in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for side, rows in results.items():
        lines.append(f"| {side} | " + " | ".join(f"{mean_after_first(rows, key):.4f}" for key in keys) + " |")
    same = [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in results["plain"]] == \
        [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in results["overlapped"]]
    plain, overlapped = results["plain"], results["overlapped"]
    lines += ["", f"step time overlapped / plain: {mean_after_first(overlapped, 'seconds') / mean_after_first(plain, 'seconds'):.2f}; "
              f"data phase left on the path: {mean_after_first(overlapped, 'time/data'):.4f} s of "
              f"{mean_after_first(plain, 'time/data'):.4f} s; checkpoint on the path: "
              f"{mean_after_first(overlapped, 'time/checkpoint'):.4f} s of {mean_after_first(plain, 'time/checkpoint'):.4f} s; "
              f"every loss, reward and metric but the clocks equal: {same}; {wall:.0f} s in all"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=448)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--per-call", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()

    from vlmrl.models import build_tiny_model

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_model(work / "model", size=args.size)
        write_dataset(work / "data", rows=args.prompts * (args.steps + 2), images=args.images, side=args.side)
        threads = gil(model, work / "data", args)
        results = {side: run(side, work, model, work / "data", args) for side in SIDES}
    lines = report(args, results, time.perf_counter() - started)
    lines[2:2] = threads
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as out:
            out.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
