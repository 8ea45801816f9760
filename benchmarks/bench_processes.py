"""Step time of one process against two under DDP, FSDP2 and ZeRO-3, on the CPU (issue 33).

Each strategy runs `vlmrl train` on the same offline model, task and global batch for --steps
steps, under the launch it names (the CLI; `accelerate launch --config_file configs/accelerate/
ddp.yaml`; `... fsdp2.yaml`; `... zero3.yaml`, with DS_ACCELERATOR=cpu), and the step time is the median of the run's `seconds` in
metrics.jsonl after the first step (the first step compiles nothing here, but fills allocator
caches and settles the fast paths). Also reported: the medians of time/generate and time/train,
and whether the runs' first-step rewards agree (the same samples on any number of processes).

    python benchmarks/bench_processes.py --size small --steps 5 [--threads 1] [--results benchmarks/RESULTS.md]

Two processes on a 2-core machine each get one core; one process gets both only with
OMP_NUM_THREADS=2 (--threads), so the comparison is one process on --threads threads against two
processes on one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = {
    "one process": [],
    "DDP, 2 processes": ["--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml")],
    "FSDP2, 2 processes": ["--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml")],
    "ZeRO-3, 2 processes": ["--config_file", str(ROOT / "configs" / "accelerate" / "zero3.yaml")],
}


def command(flags: list[str], port: int) -> list[str]:
    if not flags:
        return [sys.executable, "-m", "vlmrl", "train"]
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", str(port),
            "-m", "vlmrl", "train"]


def run(name: str, flags: list[str], overrides: list[str], out: Path, threads: int, port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads if not flags else 1), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command(flags, port) + overrides + [f"output_dir={out}"], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    first = done.stdout.splitlines()[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(row[key] for row in later)

    return {"name": name, "line": first.removeprefix("preflight: "), "step": median("seconds"),
            "generate": median("time/generate"), "train": median("time/train"), "reward": rows[0]["reward"]}


def table(results: list[dict]) -> str:
    base = results[0]["step"]
    lines = ["| launch | preflight's first line | step (s) | generate (s) | train (s) | vs one process |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | `{r['line']}` | {r['step']:.3f} | {r['generate']:.3f} | {r['train']:.3f} | "
                     f"{r['step'] / base:.2f}x |")
    same = len({round(r["reward"], 6) for r in results}) == 1
    lines.append("")
    lines.append(f"First-step rewards {'identical' if same else 'DIFFER'} over the launches.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", help="offline model size (vlmrl tiny-model --size)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the one-process run (2 threads on 2 busy cores: many times slower)")
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-m", "vlmrl", "tiny-model", str(model), "--size", args.size], check=True,
                       capture_output=True)
        overrides = [str(ROOT / "configs" / "shapes_grpo_tiny.yaml"), f"model.name_or_path={model}",
                     "model.device=cpu", "model.dtype=float32", f"train.steps={args.steps}",
                     f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
                     f"rollout.generation_batch_size={args.prompts // 2}", f"rollout.max_new_tokens={args.tokens}",
                     "train.micro_batch_size=16", "model.gradient_checkpointing=false", "eval.every=0",
                     "train.save_every=0", "train.log_rollouts_every=0"]
        results = [run(name, flags, overrides, Path(tmp) / f"run{i}", args.threads, 29700 + i)
                   for i, (name, flags) in enumerate(LAUNCHES.items())]
    text = table(results)
    print(text)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
