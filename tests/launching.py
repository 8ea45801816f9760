"""Helpers for tests that start `vlmrl` in processes of its own: one process (the CLI), or several
under `accelerate launch`. Imported by tests/test_trainer.py, test_sharding.py and test_zero3.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


LR = 1e-2
"""The learning rate of the equivalence runs (two_process_overrides)."""


def two_process_overrides(tiny_model_dir: str, out: Path, *more: str, lr: float = LR) -> list[str]:
    """`vlmrl train` on the tiny model and the letter task as the sharding equivalence tests run it:
    4 prompts x 4 completions a step, a reference refreshed from the policy after each step."""
    return ["train", f"model.name_or_path={tiny_model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.generation_batch_size=2", "train.micro_batch_size=4", f"train.lr={lr}",
            "algorithm.aggregation=token", "algorithm.beta=0.1", "algorithm.ref_refresh_steps=1", "algorithm.ref_mix=0.5",
            f"output_dir={out}", *more]


def final_weights(folder: Path) -> dict:
    """The state dict of the model in `folder`, loaded with plain transformers."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def run_here(arguments: list[str]) -> None:
    """`vlmrl ARGUMENTS` run to its end in this process, exit 0: the one-process side of an equivalence test (what
    `run_ok(CLI, ARGUMENTS)` runs, without starting Python and importing torch again: about 8 s on 2 busy cores)."""
    from vlmrl.cli import main

    assert main(arguments) in (0, None)


def run_ok(command: list[str], arguments: list[str], env: dict[str, str] | None = None) -> str:
    """Run to its end within 300 s and exit 0 (else fail with its stderr); its stdout."""
    returncode, stdout, stderr = run_all_or_kill(command + arguments, timeout=300, env=env)
    assert returncode == 0, stderr[-3000:]
    return stdout


def stopped_at_2_and_resumed(launch: list[str], arguments, tmp_path: Path, env: dict[str, str] | None = None):
    """A 4-step run under `launch`, and a copy of it stopped after step 2 (the later checkpoint and
    model gone) and resumed to step 4: asserts both logged the same metrics (timings aside) and
    wrote the same final weights. `arguments(out, *more)`: the run's arguments."""
    more = ("train.steps=4", "train.save_every=2", "train.schedule=cosine", "train.warmup_steps=1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_ok(launch, arguments(straight, *more), env)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "final")
    run_ok(launch, arguments(resumed, *more, "resume=true"), env)

    def strip(rows):
        return [{k: v for k, v in row.items() if not k.startswith(("seconds", "tokens_per_s", "time/"))} for row in rows]

    from vlmrl.report.tracking import read_metrics

    assert strip(read_metrics(resumed / "metrics.jsonl")) == strip(read_metrics(straight / "metrics.jsonl"))
    a, b = final_weights(straight / "final"), final_weights(resumed / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)


SURROGATE_NOISE = 1e-6
"""How far the loss (and pg_loss) of one update may move between two launches of it: two processes
against one, FSDP2 or ZeRO-3 against DDP, another CPU. The on-policy surrogate is a mean of O(1)
terms (advantage x ratio) that cancel to ~1e-4, so its rounding is that of the terms, not of the
result: float32 sums them in another order over two processes and with another vector width on
another CPU. Measured (tests/test_sharding.py's LoRA run, step 2): 3.4e-8 on an AMD EPYC with
AVX-512, 2.2e-8 with ATEN_CPU_CAPABILITY=avx2, under one ulp of an O(1) term (1.2e-7); 1e-6 is 8
such ulps. The loss is no witness of a wrong update (one micro-batch weighted 2% too high moved it
by 7e-11): the gradient norm is (it moved by 8e-3 relative; 0.2% too high: 8e-4), held to
STATISTICS_REL with the KL, the entropy and the weights."""

STATISTICS_REL = 1e-5
"""Relative tolerance of the statistics that do not cancel (KL, gradient norm, entropy, ratio
mean) between two launches of the same update: their rounding is relative to their size (measured
at most 2.5e-7 relative in the runs above)."""


def assert_same_statistics(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    """One step's statistics `keys` of two launches of the same update agree: the surrogate within
    SURROGATE_NOISE, the rest within STATISTICS_REL (1e-9 absolute for statistics that are 0)."""
    for key in keys:
        if key in ("loss", "pg_loss"):
            assert b[key] == pytest.approx(a[key], rel=0, abs=SURROGATE_NOISE), key
        else:
            assert b[key] == pytest.approx(a[key], rel=STATISTICS_REL, abs=1e-9), key


WEIGHT_NOISE_PER_LR = 2e-2
"""How far a weight may move between two launches of the same updates, as a share of the learning
rate. Adam's step is lr * m / (sqrt(v) + eps): an element whose gradient nearly cancels (terms of
1e-3 summing to 1e-9) carries a large relative rounding error, which its update passes on at the
scale of lr. Measured: 1.7e-5 = 0.17% of lr (FSDP2 against one process, lr 1e-2, two steps,
ATEN_CPU_CAPABILITY=avx2; it failed the 1e-5 this test asked before). A wrong update moves weights
by a good part of lr, and the gradient norm (STATISTICS_REL) sees a weighting off by 0.2%."""


def assert_same_weights(a: dict, b: dict, lr: float) -> None:
    """Two launches' weights (name -> tensor) within WEIGHT_NOISE_PER_LR * lr."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=WEIGHT_NOISE_PER_LR * lr)


def same_lora_runs(ddp_run: Path, other_run: Path, lr: float = LR) -> None:
    """Two LoRA runs of the same steps: loss, KL and grad norm per step (assert_same_statistics),
    the saved adapters (assert_same_weights)."""
    from safetensors.torch import load_file

    from vlmrl.report.tracking import read_metrics

    one, two = read_metrics(ddp_run / "metrics.jsonl"), read_metrics(other_run / "metrics.jsonl")
    for a, b in zip(one, two):
        assert_same_statistics(a, b, ("loss", "kl", "grad_norm"))
    assert two[1]["kl"] > 0
    a = load_file(ddp_run / "final" / "adapter_model.safetensors")
    b = load_file(other_run / "final" / "adapter_model.safetensors")
    assert all("lora_" in k for k in a)
    assert_same_weights(a, b, lr)
