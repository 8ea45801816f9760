"""benchmarks/gpu_check.sh, the GPU check in one call (issue 46 item 6), rehearsed on the CPU at tiny
size so that its first run on a lent GPU is not its first run: every part runs and the one table
and RESULTS.md section come out; the table judges the issue's targets from the parts' figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import Part, check_table  # noqa: E402


def test_the_table_judges_the_targets_on_cuda_only():
    decode = Part("decode", 0, 150.0, {"setting": "3B", "paths": {
        "static": {"ms_per_step": 38.4, "generation_s": 11.047},
        "compiled": {"ms_per_step": 9.5, "generation_s": 2.5}}})
    step = Part("step", 0, 120.0, {
        "step (s)": {"TRL": 20.0, "vlmrl": 4.0}, "training phase (s)": {"TRL": 16.0, "vlmrl": 2.0},
        "peak memory (MiB)": {"TRL": 20000.0, "vlmrl": 13000.0},
        "training MFU (of datasheet 989 TFLOP/s)": {"TRL": 0.1, "vlmrl": 0.36}})
    tests = Part("tests", 1, 80.0, summary="1 failed, 11 passed in 80.0s")
    assert check_table("cuda", decode, step, tests) == [
        "| figure | measured | target | met |", "|---|---|---|---|",
        "| decode ms/step, static | 38.40 (generation 11.047 s) |  |  |",
        "| decode ms/step, compiled | 9.50 (generation 2.500 s) | <= 10 | met |",
        "| step, vlmrl vs TRL (shortened setting) | 4.000 s vs TRL 20.000 s: 0.200x | <= 0.15x | missed |",
        "| training phase, vlmrl vs TRL | 2.000 s vs TRL 16.000 s: 0.125x |  |  |",
        "| training MFU, vlmrl (of datasheet 989 TFLOP/s) | 36.0% (TRL 10.0%) | >= 35% | met |",
        "| peak memory, vlmrl vs TRL | 13000 MiB vs TRL 20000 MiB: 0.650x | <= 0.6x | missed |",
        "| tests marked gpu | 1 failed, 11 passed in 80.0s | all pass | missed |",
        "", "Parts: decode ok in 150 s; step ok in 120 s; tests failed (exit 1) in 80 s"]
    skipped = Part("tests", 0, 9.0, summary="15 skipped, 74 deselected in 9.0s")  # no CUDA seen: not a pass
    assert "| tests marked gpu | 15 skipped, 74 deselected in 9.0s | all pass | missed |" in check_table(
        "cuda", decode, step, skipped)
    stopped = Part("step", None, 150.0)  # a part stopped at its limit: its rows say so, the others stand
    lines = check_table("cuda", decode, stopped, tests)
    assert "| step, vlmrl vs TRL (shortened setting) | n/a | <= 0.15x | not measured |" in lines
    assert lines[-1].endswith("step stopped at its limit after 150 s; tests failed (exit 1) in 80 s")
    assert "| decode ms/step, compiled | 9.50 (generation 2.500 s) | <= 10 | n/a (CPU rehearsal) |" in check_table(
        "cpu", decode, step, tests)


def rehearse(tmp_path: Path, *extra: str) -> str:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    done = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), "--device", "cpu", *extra], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = (tmp_path / "RESULTS.md").read_text()
    assert section in done.stdout  # the one table, printed and written
    assert {"decode.log", "decode.json", "step.log", "step.json", "tests.log"} <= {p.name for p in tmp_path.iterdir()}
    assert re.search(r"^\| decode ms/step, static \| \d+\.\d\d \(generation \d+\.\d{3} s\) \|", section, re.M)
    assert re.search(r"^\| step, vlmrl vs TRL \(shortened setting\) \| \d+\.\d{3} s vs TRL \d+\.\d{3} s: \d+\.\d{3}x",
                     section, re.M)
    assert re.search(r"^\| tests marked gpu \| \d+ skipped, \d+ deselected", section, re.M)  # no CUDA here
    return section


def test_the_gpu_check_rehearsed_on_the_cpu(tmp_path):
    """Every part at tiny size, the static decode path alone (the compiled one compiles for a minute
    here: the slow rehearsal below)."""
    section = rehearse(tmp_path, "--decode-paths", "static")
    assert "| decode ms/step, compiled | n/a | <= 10 | n/a (CPU rehearsal) |" in section


@pytest.mark.slow
def test_the_whole_gpu_check_rehearsed_on_the_cpu(tmp_path):
    section = rehearse(tmp_path)
    assert re.search(r"^\| decode ms/step, compiled \| \d+\.\d\d \(generation", section, re.M)
