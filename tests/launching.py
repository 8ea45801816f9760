"""Helpers for tests that start `vlmrl` in processes of its own: one process (the CLI), or several
under `accelerate launch`. Imported by tests/test_trainer.py and tests/test_sharding.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
CLI = [sys.executable, "-m", "vlmrl"]


def free_port() -> int:
    """A TCP port nothing listens on now. accelerate's default, 29500, is only probed before it is
    bound: two launches at once (two test runs on one machine) can both find it free and collide."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launcher(*flags: str) -> list[str]:
    """`accelerate launch FLAGS -m vlmrl` on a free port (flags: --multi_gpu --num_processes 2, or
    --config_file configs/accelerate/X.yaml)."""
    return [sys.executable, "-m", "accelerate.commands.launch", *flags, "--main_process_port", str(free_port()),
            "-m", "vlmrl"]


def run_all_or_kill(command: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `command` (the CLI, or a launcher and the processes it starts) to its end: its exit
    status, stdout and stderr. After `timeout` seconds, kill all of them (the launcher's workers too,
    which would otherwise hang on, holding the pipes) and fail with what they had printed."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                   str(TESTS), os.environ.get("PYTHONPATH")])), **(env or {})})
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the session's every process
        _, stderr = process.communicate()
        pytest.fail(f"{' '.join(command[2:6])} timed out after {timeout:.0f} s; its stderr:\n{stderr[-3000:]}")
