"""Rollouts one step ahead against synchronous DDP, on the same 2 CPU processes (issue 54 item 2).

Both arms run the shapes demo's GRPO settings (src/vlmrl/demo.py: 8 prompts x 8 completions, 40
new tokens, DAPO-style) under `accelerate launch --multi_gpu --num_processes 2` for --steps steps,
from the same model, with the same seed:
- "DDP": both processes generate and train their half of every step (rollout.ahead=0);
- "ahead": the second process only generates, one step ahead, with the weights of the step before,
  while the first trains on the rollouts it made before (rollout.ahead=1 rollout.generators=1).
Reported per arm and seed: the median step time after the first step (`seconds` in metrics.jsonl),
steps per second from it, the medians of time/generate and time/train (and time/rollout_wait: the
trainer's wait for the generator), and the held-out accuracy on eval.n test examples after the last
step. Each process runs on one thread (OMP_NUM_THREADS=1).

    python benchmarks/ahead.py [--model runs/demo/sft/final] [--steps 8] [--seeds 0 1 2] [--eval-n 64]

Without --model the demo's offline `small` model is built (random weights: its accuracy is chance
and says only that both arms learn alike, not how well); the demo's warm start
(`vlmrl demo` writes it to runs/demo/sft/final) is the model the demo's GRPO starts from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from launching import free_port  # noqa: E402
from vlmrl.demo import PRESETS, ensure_tiny_model  # noqa: E402

ARMS = {"DDP": ["rollout.ahead=0"], "ahead": ["rollout.ahead=1", "rollout.generators=1"]}


def overrides(model: Path, out: Path, steps: int, seed: int, eval_n: int) -> list[str]:
    """The demo's GRPO phase, cut to `steps` steps, evaluated once after the last."""
    preset = PRESETS["shapes"]
    grpo = [o for o in preset.grpo if not o.startswith(("train.steps=", "train.warmup_steps=", "eval.", "train.save_every=",
                                                        "train.log_rollouts_every="))]
    return [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={out}",
            f"rollout.max_new_tokens={preset.max_new_tokens}", *preset.shared, *grpo, f"train.steps={steps}",
            "train.warmup_steps=1", f"train.save_every={steps}", "train.log_rollouts_every=0", f"eval.every={steps}",
            f"eval.n={eval_n}", "eval.blind_check=false", f"seed={seed}"]


def run(arm: str, model: Path, out: Path, steps: int, seed: int, eval_n: int) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), "-m", "vlmrl", "train", *overrides(model, out, steps, seed, eval_n), *ARMS[arm]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{arm} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows

    def median(key: str) -> float:
        values = [row[key] for row in later if key in row]
        return statistics.median(values) if values else float("nan")

    return {"arm": arm, "seed": seed, "step_s": median("seconds"), "steps_per_s": 1 / median("seconds"),
            "generate_s": median("time/generate"), "train_s": median("time/train"),
            "wait_s": median("time/rollout_wait"), "accuracy": rows[-1].get("eval/test/accuracy", float("nan")),
            "reward": statistics.mean(row["reward"] for row in rows), "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model folder (default: the demo's offline small model, built)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-n", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model or ensure_tiny_model(Path(scratch) / "model", PRESETS["shapes"].size)
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        results = []
        for seed in args.seeds:
            for arm in ARMS:
                result = run(arm, model, Path(scratch) / f"{arm}-{seed}", args.steps, seed, args.eval_n)
                results.append(result)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| arm | steps/s (median over seeds) | step s | generate s | train s | trainer waits s | held-out accuracy |")
    print("|---|---|---|---|---|---|---|")
    for arm in ARMS:
        mine = [r for r in results if r["arm"] == arm]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in mine)

        accuracies = ", ".join(f"{r['accuracy']:.3f}" for r in mine)
        print(f"| {arm} | {med('steps_per_s'):.3f} | {med('step_s'):.2f} | {med('generate_s'):.2f} | {med('train_s'):.2f} "
              f"| {med('wait_s'):.2f} | {accuracies} |")
    ratio = (statistics.median(r["steps_per_s"] for r in results if r["arm"] == "ahead")
             / statistics.median(r["steps_per_s"] for r in results if r["arm"] == "DDP"))
    print(f"ahead / DDP steps per second: {ratio:.2f}x")


if __name__ == "__main__":
    main()
