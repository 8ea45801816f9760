"""AdamW's step: multi-tensor ("foreach", torch's default), fused (vlmrl's for float32 weights,
optim.py) and RoundingAdamW (vlmrl's for bf16 weights, stochastic_rounding.py), eager and with its
arithmetic compiled: time and the memory the step allocates on top of parameters, gradients and
moments.

Run: `python benchmarks/bench_optimizer.py [--params 3.75e9 --dtype bfloat16 --device cuda]`
(the default: 50M float32 parameters on the CPU).

The parameters are split into `--tensors` equal tensors with random gradients; one step creates the
moments, then the median of `--repeats` steps is timed, and the peak rise of memory over those
steps is read (CUDA: peak allocated; CPU: resident memory, sampled every millisecond with freed
memory handed back to the system). foreach's step holds one temporary of the parameters' size
(its sqrt(v) + eps); the fused kernel none; RoundingAdamW a few float32 pieces of CHUNK elements.
With `--dtype bfloat16`, also the update each keeps: 1M weights of N(0, 0.02), ten steps at lr 1e-6
along random gradients, the mean drift along float32 AdamW's direction over float32's (1 = all of
it; rounded to nearest, small updates vanish). `--results FILE` appends the table in Markdown.
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

from vlmrl.training.stochastic_rounding import RoundingAdamW  # noqa: E402

IMPLEMENTATIONS = {
    "foreach": lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=True),
    "fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
    "rounding": lambda params: RoundingAdamW(params, lr=1e-4),
    "rounding, compiled": lambda params: RoundingAdamW(params, lr=1e-4, compiled=True),
}


def measure(impl: str, args) -> dict[str, float]:
    """Median seconds per step and the peak memory rise (MiB) of `impl`'s steps."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    size = int(args.params) // args.tensors
    params = [torch.nn.Parameter(torch.randn(size, device=device, dtype=dtype)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = IMPLEMENTATIONS[impl](params)
    optimizer.step()  # the moments exist from here on (and a compiled step is compiled)
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


def kept_update(impl: str, device: torch.device) -> float:
    """The share of float32 AdamW's drift that `impl` keeps in bf16 weights (see the docstring)."""
    generator = torch.Generator().manual_seed(0)
    start = (torch.randn(1_000_000, generator=generator) * 0.02).bfloat16().to(device)
    grads = [torch.randn(1_000_000, generator=generator).to(device) for _ in range(10)]
    drifts = []
    for make, dtype in ((IMPLEMENTATIONS["fused"], torch.float32), (IMPLEMENTATIONS[impl], torch.bfloat16)):
        weights = torch.nn.Parameter(start.to(dtype, copy=True))
        optimizer = make([weights])
        for group in optimizer.param_groups:
            group["lr"], group["weight_decay"] = 1e-6, 0.0
        for grad in grads:
            weights.grad = grad.to(dtype)
            optimizer.step()
        drifts.append(weights.detach().float() - start.float())
    exact, kept = drifts
    return float((kept * exact.sign()).mean() / exact.abs().mean())


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
    foreach = results["foreach"]
    lines = [f"### {datetime.date.today().isoformat()}: AdamW step, {args.params:.3g} {args.dtype} parameters "
             f"({size_mib:.0f} MiB) in {args.tensors} tensors, {args.device}", "",
             f"- machine: {machine()}", f"- command: `{command}`", "",
             "| | step (ms) | / foreach | memory the step allocates (MiB) | bf16 update kept |",
             "|---|---:|---:|---:|---:|"]
    for impl, result in results.items():
        kept = f"{kept_update(impl, torch.device(args.device)):.3f}" if args.dtype == "bfloat16" else ""
        lines.append(f"| {impl} | {result['step'] * 1e3:.1f} | {result['step'] / foreach['step']:.3f} | "
                     f"{result['memory']:.0f} | {kept} |")
    lines.append("")
    publish(lines, args.results)


if __name__ == "__main__":
    main()
