"""Memory of loading a sharded run, per process, on the CPU (issue 33): how much CPU memory each
process takes while the policy loads and splits, and how much of the model it holds after.

One model at the 3B architecture's widths (Qwen2.5-VL-3B: hidden 2048, its 151936-token embedding,
--layers text layers and --blocks vision blocks; random weights) is saved once, then each launch
builds a `TrainingSession` (the run's loading, splitting and optimizer; no step) in float32:

- one process: the model whole;
- FSDP2, 2 processes, every process reads the weights (`--fsdp_cpu_ram_efficient_loading false`):
  each loads the model into CPU memory, then each unit moves to the device as it is sharded;
- FSDP2, 2 processes, the main process reads them (configs/accelerate/fsdp2.yaml: `true`): the other
  builds the model on the meta device and receives its shards;
- ZeRO-3, 2 processes: each loads the model into CPU memory, then it is partitioned one parameter at
  a time (DS_ACCELERATOR=cpu).

Per process: the peak resident memory from before loading (after the imports) to the moment the
optimizer is built (loading and splitting done; DeepSpeed's own buffers come after), less the
resident memory before loading; and the parameter bytes the process holds after splitting. On a
CPU the device is the CPU, so the peak includes what sits on the device; on GPUs the first figure
is host memory alone. A process that receives its shards still holds one whole tensor at a time
while it arrives: the table names the largest (here the embedding, a far larger share of this
shallow model than of a full-depth one).

    python benchmarks/bench_loading.py [--layers 4 --blocks 4] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = ROOT / "configs" / "accelerate"
LAUNCHES = {
    "one process": [],
    "FSDP2, 2 processes, each reads the weights": ["--config_file", str(ACCELERATE / "fsdp2.yaml"),
                                                   "--fsdp_cpu_ram_efficient_loading", "false"],
    "FSDP2, 2 processes, the main one reads them": ["--config_file", str(ACCELERATE / "fsdp2.yaml"),
                                                    "--fsdp_cpu_ram_efficient_loading", "true"],
    "ZeRO-3, 2 processes": ["--config_file", str(ACCELERATE / "zero3.yaml")],
}
MIB = 2 ** 20


def status(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: resident now; VmHWM: its
    peak since the last reset), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def held_bytes(model) -> int:
    """Parameter bytes this process holds: its shards (FSDP2), its partitions (ZeRO-3), or all."""
    total = 0
    for p in model.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else getattr(p, "_local_tensor", p)
        total += local.numel() * local.element_size()
    return total


def worker(model_dir: str, out: str) -> None:
    """One process of a launch: load and split as a run does, then write its figures."""
    import torch

    from vlmrl.config import load_config
    from vlmrl.training import session as session_module

    torch.set_num_threads(1)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here on
    before, peaks = status("VmRSS"), []
    build_optimizer = session_module.build_optimizer

    def noting_the_peak(*args, **kwargs):  # loading and splitting are done when the optimizer is built
        peaks.append(status("VmHWM"))
        return build_optimizer(*args, **kwargs)

    session_module.build_optimizer = noting_the_peak
    config = load_config(None, [f"model.name_or_path={model_dir}", f"output_dir={out}", "model.dtype=float32",
                                "model.device=cpu", "train.trackers=[]"])
    session = session_module.TrainingSession(config, total_updates=1)
    sizes = [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in session.policy.parameters()]
    figures = {"rank": session.rank, "loading": peaks[0] - before, "held": held_bytes(session.policy),
               "whole": sum(sizes) * 4, "largest": max(sizes) * 4, "line": session.strategy.line()}
    Path(out, f"rank{session.rank}.json").write_text(json.dumps(figures))
    session.close()


def launch(name: str, flags: list[str], model_dir: Path, out: Path, port: int) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker", str(model_dir), str(out)]
    if flags:
        command = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", str(port), *script]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def table(results: dict[str, list[dict]], layers: int, blocks: int) -> str:
    whole = next(iter(results.values()))[0]["whole"]
    largest = next(iter(results.values()))[0]["largest"]
    lines = [f"Model: Qwen2.5-VL-3B widths, {layers} text layers, {blocks} vision blocks, float32: "
             f"{whole / MIB:,.0f} MiB of parameters, the largest tensor {largest / MIB:,.0f} MiB.", "",
             "| launch | preflight's first line | process | CPU memory while loading (MiB) | vs the model | "
             "parameters held after (MiB) |", "|---|---|---|---:|---:|---:|"]
    for name, ranks in results.items():
        for r in ranks:
            lines.append(f"| {name} | `{r['line']}` | {r['rank']} | {r['loading'] / MIB:,.0f} | "
                         f"{r['loading'] / r['whole']:.2f}x | {r['held'] / MIB:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="text layers (the 3B has 36)")
    parser.add_argument("--blocks", type=int, default=4, help="vision blocks (the 3B has 32)")
    parser.add_argument("--results", type=Path, help="append the table to this markdown file")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from estimate_real import save_folder

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_folder("qwen2_5_vl_3b", str(model), args.layers, args.blocks)
        results = {}
        for i, (name, flags) in enumerate(LAUNCHES.items()):
            out = Path(tmp) / f"run{i}"
            out.mkdir()
            results[name] = launch(name, flags, model, out, 29800 + i)
            print(f"{name}: done", flush=True)
    text = table(results, args.layers, args.blocks)
    print(text)
    if args.results:
        with args.results.open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
