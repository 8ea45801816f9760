"""The GPU check in one call (issue 46 item 6): decode, the training phase against TRL, the tests
marked gpu, as ONE table, within 8 minutes on an H100 or H200. Run through `benchmarks/gpu_check.sh`
(which installs the wheels the GPU image lacks); `--device cpu` rehearses it at tiny size.

Three parts, each a process of its own (the GPU's memory is free again after each), each under a
time limit so the whole call ends in time and a part that runs out still leaves the others' rows:

- decode: `bench_decode.py` at the 3B setting (the Qwen2.5-VL-3B architecture, random weights, bf16,
  8 prompts x G=8, 896 px, 256 tokens): ms per decode step of the static and the compiled path;
- step: `bench_vs_trl.py`, vlmrl's step and TRL's side by side on a shortened setting (18 of the
  36 text layers, 16 of the 32 vision blocks, 4 prompts x G=8, 448 px, 64 tokens: both trainers'
  models, references and optimizer states fit an H100 together, and TRL's step takes seconds, not
  minutes): step, training phase, its MFU, peak memory;
- tests: every test marked gpu.

The table gives each figure with the issue's target where there is one (on the GPU only: the CPU
rehearsal's figures say nothing about them). Written to OUT: the table as a RESULTS.md section
(`RESULTS.md`), each part's output (`PART.log`) and figures (`PART.json`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
GPU_TESTS = ["tests/test_block_attention.py", "tests/test_fused_kernels.py", "tests/test_stochastic_rounding.py",
             "tests/test_decoding.py", "tests/test_vision_attention.py", "tests/test_decode_waste.py"]

SETTINGS = {  # per device: each part's arguments and time limit (s); the GPU's add up to 7 min 30 s
    "cuda": {
        "decode": (["--arch-3b", "--prompts", "8", "--group", "8", "--image", "896", "--tokens", "256",
                    "--warmup", "1", "--repeats", "1"], 160),
        "step": (["--arch-3b", "--layers", "18", "--vision-depth", "16", "--dtype", "bfloat16", "--prompts", "4",
                  "--group", "8", "--image", "448", "--tokens", "64", "--micro", "16", "--warmup", "1", "--steps", "1",
                  "--time-budget", "110"], 140),
        "tests": ([], 150),
    },
    "cpu": {
        "decode": (["--size", "tiny", "--prompts", "2", "--group", "2", "--image", "56", "--tokens", "8",
                    "--warmup", "1", "--repeats", "3"], 300),
        "step": (["--size", "tiny", "--prompts", "2", "--group", "2", "--image", "56", "--tokens", "8", "--micro", "4",
                  "--warmup", "1", "--steps", "1", "--decode", "static"], 300),
        "tests": ([], 300),
    },
}

TARGETS = {  # issue 46's targets at the 3B setting
    "decode_ms": 10.0,  # ms per decode step, compiled
    "mfu": 0.35,  # training MFU
    "memory": 0.6,  # peak memory, vlmrl / TRL
    "step": 0.15,  # step time, vlmrl / TRL
}


@dataclass
class Part:
    """One part's run: its exit status (None: stopped at its time limit), seconds, figures."""

    name: str
    returncode: int | None
    seconds: float
    figures: dict | None = None
    summary: str = ""

    @property
    def state(self) -> str:
        if self.returncode is None:
            return f"stopped at its limit after {self.seconds:.0f} s"
        return f"{'ok' if self.returncode == 0 else f'failed (exit {self.returncode})'} in {self.seconds:.0f} s"


def run_part(name: str, argv: list[str], limit: float, out: Path) -> Part:
    """Run `argv` for at most `limit` seconds, its output to OUT/NAME.log; its figures from OUT/NAME.json."""
    start = time.perf_counter()
    log = out / f"{name}.log"
    print(f"+ {shlex.join(argv)}  (limit {limit:.0f} s)", flush=True)
    with open(log, "w") as sink:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
    seconds = time.perf_counter() - start
    figures = out / f"{name}.json"
    text = log.read_text(errors="replace")
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|error)[^=\n]*?)\s*=*$", text, re.M)
    return Part(name, code, seconds, json.loads(figures.read_text()) if figures.exists() else None,
                found[-1] if found else "")


def verdict(value: float | None, target: float, device: str, lower_is_better: bool = True) -> str:
    if value is None or device != "cuda":
        return "n/a (CPU rehearsal)" if device != "cuda" else "not measured"
    return "met" if (value <= target if lower_is_better else value >= target) else "missed"


def check_table(device: str, decode: Part, step: Part, tests: Part) -> list[str]:
    """The one table: figure, measured, target, met (targets judged on CUDA only)."""
    rows = []
    paths = (decode.figures or {}).get("paths", {})
    for path in ("static", "compiled"):
        ms = paths.get(path, {}).get("ms_per_step")
        target = TARGETS["decode_ms"] if path == "compiled" else None
        rows.append((f"decode ms/step, {path}", "n/a" if ms is None else
                     f"{ms:.2f} (generation {paths[path]['generation_s']:.3f} s)",
                     f"<= {target:.0f}" if target else "", verdict(ms, target, device) if target else ""))
    figures = step.figures or {}

    def pair(label: str, fmt: str) -> tuple[float | None, str]:
        values = figures.get(label)
        if not values or "TRL" not in values:
            return None, "n/a"
        ratio = values["vlmrl"] / values["TRL"] if values["TRL"] else None
        text = f"{fmt.format(values['vlmrl'])} vs TRL {fmt.format(values['TRL'])}"
        return ratio, text + (f": {ratio:.3f}x" if ratio is not None else "")

    ratio, text = pair("step (s)", "{:.3f} s")
    rows.append(("step, vlmrl vs TRL (shortened setting)", text, f"<= {TARGETS['step']}x", verdict(ratio, TARGETS["step"], device)))
    rows.append(("training phase, vlmrl vs TRL", pair("training phase (s)", "{:.3f} s")[1], "", ""))
    mfu_label = next((label for label in figures if label.startswith("training MFU (of datasheet")), None)
    mfu = figures[mfu_label]["vlmrl"] if mfu_label else None
    rows.append((f"training MFU, vlmrl{mfu_label[len('training MFU'):] if mfu_label else ''}",
                 "n/a" if mfu is None else f"{mfu:.1%} (TRL {figures[mfu_label].get('TRL', float('nan')):.1%})",
                 f">= {TARGETS['mfu']:.0%}", verdict(mfu, TARGETS["mfu"], device, lower_is_better=False)))
    ratio, text = pair("peak memory (MiB)", "{:.0f} MiB")
    rows.append(("peak memory, vlmrl vs TRL", text, f"<= {TARGETS['memory']}x", verdict(ratio, TARGETS["memory"], device)))
    passed = tests.returncode == 0 and "passed" in tests.summary and "skipped" not in tests.summary
    rows.append(("tests marked gpu", tests.summary or "no summary", "all pass",
                 ("met" if passed else "missed") if device == "cuda" else "n/a (CPU rehearsal)"))
    lines = ["| figure | measured | target | met |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    lines += ["", "Parts: " + "; ".join(f"{p.name} {p.state}" for p in (decode, step, tests))]
    return lines


def machine(device: str) -> str:
    """bench_vs_trl.machine()'s line without importing torch in this process (about 3 s of CPU after
    the parts): the CPU, its cores, the GPU (nvidia-smi's name), torch's version."""
    names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")] \
        if os.path.exists("/proc/cpuinfo") else []
    cpu = names[0] if names else (platform.processor() or platform.machine())
    gpu = ""
    if device == "cuda":
        try:
            found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")[0].strip()
        except (OSError, subprocess.TimeoutExpired):
            found = ""
        gpu = f", GPU {found}" if found else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}; torch {importlib.metadata.version('torch')}, {platform.platform()}"


def commands(device: str, out: Path, decode_paths: str) -> dict[str, tuple[list[str], float]]:
    """Each part's command line and time limit on `device`."""
    settings, python = SETTINGS[device], sys.executable
    decode_args, decode_limit = settings["decode"]
    step_args, step_limit = settings["step"]
    return {
        "decode": ([python, str(BENCH / "bench_decode.py"), "--device", device, *decode_args, "--paths", decode_paths,
                    "--no-kl", "--json", str(out / "decode.json")], decode_limit),
        "step": ([python, str(BENCH / "bench_vs_trl.py"), "--device", device, *step_args,
                  "--json", str(out / "step.json")], step_limit),
        "tests": ([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *GPU_TESTS],
                  settings["tests"][1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the tiny rehearsal")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="folder for the results ($OUT)")
    parser.add_argument("--decode-paths", default="static,compiled", help="the decode paths to time")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    parts = {name: run_part(name, argv, limit, out) for name, (argv, limit) in commands(
        args.device, out, args.decode_paths).items()}
    table = check_table(args.device, parts["decode"], parts["step"], parts["tests"])
    decode_setting = (parts["decode"].figures or {}).get("setting", "decode not measured")
    section = [f"## {datetime.date.today().isoformat()}: gpu_check.sh on {args.device} (issue 46 item 6)", "",
               f"- machine: {machine(args.device)}", f"- command: `benchmarks/gpu_check.sh {shlex.join(sys.argv[1:])}`",
               f"- decode: {decode_setting}",
               f"- step: {shlex.join(SETTINGS[args.device]['step'][0])}", f"- wall {time.perf_counter() - started:.0f} s",
               "", *table, ""]
    (out / "RESULTS.md").write_text("\n".join(section) + "\n")
    print("\n".join(section))
    sys.exit(0 if all(p.returncode == 0 for p in parts.values()) else 1)


if __name__ == "__main__":
    main()
