"""AdamW's step, multi-tensor ("foreach", torch's default) against fused (vlmrl's, optim.py): time and
the memory the step allocates on top of parameters, gradients and moments.

Run: `python benchmarks/bench_optimizer.py [--params 3.75e9 --dtype bfloat16 --device cuda]`
(the default: 50M float32 parameters on the CPU).

The parameters are split into `--tensors` equal tensors with random gradients; one step creates the
moments, then the median of `--repeats` steps is timed, and the peak rise of memory over those
steps is read (CUDA: peak allocated; CPU: resident memory, sampled every millisecond with freed
memory handed back to the system). foreach's step holds one temporary of the parameters' size
(its sqrt(v) + eps); the fused kernel none. `--results FILE` appends the table in Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_trl import MemoryPeak, machine, publish, sync  # noqa: E402

IMPLEMENTATIONS = {"foreach": {"foreach": True}, "fused": {"fused": True}}


def measure(impl: str, args) -> dict[str, float]:
    """Median seconds per step and the peak memory rise (MiB) of `impl`'s steps."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = int(args.params) // args.tensors
    params = [torch.nn.Parameter(torch.randn(size, device=device, dtype=dtype)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **IMPLEMENTATIONS[impl])
    optimizer.step()  # the moments exist from here on
    memory, times = MemoryPeak(device), []
    memory.start()
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        optimizer.step()
        sync(device)
        times.append(time.perf_counter() - start)
    rise = memory.stop()
    memory.running = False
    del optimizer, params
    return {"step": statistics.median(times), "memory": rise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50e6, help="trainable parameters (3.75e9: Qwen2.5-VL-3B)")
    parser.add_argument("--tensors", type=int, default=400, help="how many tensors they are split into")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--results", default=None, help="append the table (Markdown) to this file")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors return to the system: RSS = live memory
        os.execv(sys.executable, [sys.executable] + sys.argv)

    results = {impl: measure(impl, args) for impl in IMPLEMENTATIONS}
    size_mib = args.params * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size() / 2 ** 20
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_optimizer.py"] + sys.argv[1:])
    foreach, fused = results["foreach"], results["fused"]
    lines = [f"### {datetime.date.today().isoformat()}: AdamW step, {args.params:.3g} {args.dtype} parameters "
             f"({size_mib:.0f} MiB) in {args.tensors} tensors, {args.device}", "",
             f"- machine: {machine()}", f"- command: `{command}`", "",
             "| | foreach | fused | fused / foreach |", "|---|---:|---:|---:|",
             f"| step (ms) | {foreach['step'] * 1e3:.1f} | {fused['step'] * 1e3:.1f} | "
             f"{fused['step'] / foreach['step']:.3f} |",
             f"| memory the step allocates (MiB) | {foreach['memory']:.0f} | {fused['memory']:.0f} | |", ""]
    publish(lines, args.results)


if __name__ == "__main__":
    main()
