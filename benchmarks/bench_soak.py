"""Soak: a long run of the tiny model on CPU must keep its resident memory flat.

Runs `python -m vlmrl train` in a subprocess (the offline tiny model, the built-in shapes task,
rollouts logged every 10 steps, TensorBoard, a held-out evaluation and a checkpoint every 100 steps,
so every path of a real run is exercised), reads the process's resident set size (VmRSS) each time
a metrics line appears, and prints the RSS after warm-up, at the end, the peak, and the growth.
Exits 1 when the growth after warm-up is 10% or more (--max-growth).

    python benchmarks/bench_soak.py                  # 500 steps (about 5 minutes on 2 free cores)
    python benchmarks/bench_soak.py --steps 100      # a shorter soak
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc; psutil elsewhere)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    import psutil

    return psutil.Process(pid).memory_info().rss


def steps_logged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if line.strip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="steps before the baseline is taken (default: 10%% of the steps, at least 20)")
    parser.add_argument("--max-growth", type=float, default=0.10, help="allowed RSS growth after warm-up (0.10)")
    parser.add_argument("--model", default=None, help="model folder (default: build the tiny model)")
    parser.add_argument("--out", default=None, help="run directory (default: a temporary folder)")
    args = parser.parse_args()
    warmup = args.warmup or max(20, args.steps // 10)
    if warmup >= args.steps:
        parser.error(f"--steps must exceed the warm-up ({warmup} steps)")

    work = Path(tempfile.mkdtemp(prefix="vlmrl-soak-"))
    model = args.model or str(work / "tiny-model")
    if args.model is None:
        subprocess.run([sys.executable, "-m", "vlmrl", "tiny-model", model, "--size", "tiny"], check=True,
                       stdout=subprocess.DEVNULL)
    run = Path(args.out or work / "run")
    command = [sys.executable, "-m", "vlmrl", "train", f"model.name_or_path={model}", "model.device=cpu",
               "task.name=shapes", f"output_dir={run}", f"train.steps={args.steps}", "train.lr=1e-4",
               "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.generation_batch_size=4",
               "rollout.max_new_tokens=16", "train.micro_batch_size=16", "train.log_rollouts_every=10",
               "train.save_every=100", "eval.every=100", "eval.n=8", "eval.batch_size=8"]
    started = time.perf_counter()
    log = (work / "train.log").open("w")  # a file, not a pipe: a full pipe would stall the run
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    samples: dict[int, int] = {}  # steps done -> RSS right after that step's metrics line appeared
    metrics = run / "metrics.jsonl"
    every = max(1, args.steps // 10)
    while process.poll() is None:
        done = steps_logged(metrics)
        if done and done not in samples:
            try:
                samples[done] = rss_bytes(process.pid)
            except (OSError, ProcessLookupError):
                break
            if done % every == 0:  # progress, so that a soak stopped early still says something
                print(f"step {done}: RSS {samples[done] / 2 ** 20:.0f} MiB, {time.perf_counter() - started:.0f} s",
                      flush=True)
        time.sleep(0.05)
    process.wait()
    log.close()
    if process.returncode != 0:
        print((work / "train.log").read_text()[-3000:], file=sys.stderr)
        return process.returncode
    seconds = time.perf_counter() - started
    after = {step: rss for step, rss in samples.items() if step >= warmup}
    baseline_step = min(after)
    baseline, final = after[baseline_step], samples[max(samples)]
    peak = max(after.values())
    growth = (final - baseline) / baseline
    mib = 2 ** 20
    checkpoints = [f"{s}: {samples[s] / mib:.0f}" for s in sorted(samples) if s % every == 0]
    result = {"steps": args.steps, "seconds": round(seconds, 1), "warmup_steps": baseline_step,
              "rss_after_warmup_mib": round(baseline / mib, 1), "rss_final_mib": round(final / mib, 1),
              "rss_peak_after_warmup_mib": round(peak / mib, 1), "growth": round(growth, 4)}
    print(f"soak: {args.steps} steps in {seconds:.0f} s; RSS {baseline / mib:.0f} MiB after step {baseline_step}, "
          f"{final / mib:.0f} MiB at the end (peak {peak / mib:.0f} MiB): growth {growth:+.1%} "
          f"(limit {args.max_growth:.0%})")
    print(f"RSS by step (MiB): {', '.join(checkpoints)}")
    print(json.dumps(result))
    return 0 if growth < args.max_growth else 1


if __name__ == "__main__":
    sys.exit(main())
