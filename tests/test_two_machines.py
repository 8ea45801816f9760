"""Two machines, played on this one: two `accelerate launch` commands with `--num_machines 2`, machine
ranks 0 and 1, meeting on 127.0.0.1 (gloo), each with an output folder of its own (folders not
shared between machines). They train as one process does; a process killed on one machine stops the
other with one line naming the last checkpoint; the resume sends that checkpoint to the machine
whose folder lacks it and ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launching import (LR, TESTS, assert_same_statistics, assert_same_weights, final_weights, free_port, run_here,
                       two_process_overrides)
from vlmrl.report.tracking import read_metrics

ROOT = TESTS.parent
DDP = ("--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no")
FSDP2 = ("--config_file", str(ROOT / "configs" / "accelerate" / "fsdp2.yaml"))


def two_machines(strategy: tuple[str, ...], arguments, env: dict[str, str] | None = None,
                 timeout: float = 400) -> list[tuple[int, str, str]]:
    """Machine ranks 0 and 1, one process each, started at once as two launches on a free port:
    `arguments(rank)` is what each runs (`train ...`). Each launch's exit status, stdout and stderr;
    both killed, with every process they started, past `timeout` seconds (a failed test)."""
    port = str(free_port())
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    launches = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", *strategy, "--num_processes", "2", "--num_machines", "2",
         "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, "-m", "vlmrl",
         *arguments(rank)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": path, **(env or {})}) for rank in (0, 1)]
    results = []
    try:
        for launch in launches:
            stdout, stderr = launch.communicate(timeout=timeout)
            results.append((launch.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        tails = []
        for launch in launches:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGKILL)
            tails.append(launch.communicate()[1][-2000:])
        pytest.fail(f"two machines did not end within {timeout:.0f} s; their stderr:\n" + "\n---\n".join(tails))
    return results


def same_steps(one: Path, two: Path, steps: int) -> None:
    """Two runs of the same steps: rewards, loss, KL, gradient norm per step, and the final weights."""
    a, b = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert [row["step"] for row in a] == [row["step"] for row in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):
        assert x["reward"] == y["reward"]
        assert_same_statistics(x, y, ("loss", "kl", "grad_norm", "entropy"))
    assert steps == 1 or a[-1]["kl"] > 0  # the reference, refreshed after each step, differs from the policy
    assert_same_weights(final_weights(one / "final"), final_weights(two / "final"), LR)


def test_two_machines_make_the_same_steps_as_one_process(tmp_path, tiny_model_dir):
    """DDP over two machines, one step: what one process does with the same global batch. Only the
    main machine writes (metrics, rollouts, checkpoints, final model); the other's folder is never made."""
    more = ("train.steps=1", "train.log_rollouts_every=1")
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    folders = [tmp_path / "machine0", tmp_path / "machine1"]
    (rc0, out0, err0), (rc1, _, err1) = two_machines(
        DDP, lambda rank: two_process_overrides(tiny_model_dir, folders[rank], *more))
    assert rc0 == rc1 == 0, (err0[-2000:], err1[-2000:])
    assert out0.startswith("preflight: processes: 2, strategy: DDP, backend: gloo\n"), out0[:300]
    same_steps(tmp_path / "one", folders[0], 1)
    assert len((folders[0] / "rollouts" / "step_000001.jsonl").read_text().splitlines()) == 16  # both machines'
    assert [p.name for p in (folders[0] / "checkpoints").iterdir()] == ["step_000001"]
    assert not folders[1].exists()


@pytest.mark.slow  # two machines under FSDP2 and one process: about 40 s on 2 idle cores
def test_two_machines_under_fsdp2_make_the_same_steps_as_one_process(tmp_path, tiny_model_dir):
    more = ("train.steps=2",)
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    folders = [tmp_path / "machine0", tmp_path / "machine1"]
    (rc0, out0, err0), (rc1, _, err1) = two_machines(
        FSDP2, lambda rank: two_process_overrides(tiny_model_dir, folders[rank], *more))
    assert rc0 == rc1 == 0, (err0[-2000:], err1[-2000:])
    assert out0.startswith("preflight: processes: 2, strategy: FSDP2, backend: gloo\n"), out0[:300]
    same_steps(tmp_path / "one", folders[0], 2)


@pytest.mark.slow  # two machines and one process: about 30 s on 2 idle cores
def test_two_machines_one_generating_one_step_ahead_make_the_steps_of_one_process(tmp_path, tiny_model_dir):
    """Machine 1's process only generates, one step ahead (rollout.ahead=1, rollout.generators=1), while
    machine 0's trains: the steps of one process running the same one-step-lag schedule."""
    more = ("train.steps=3", "rollout.ahead=1")
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    folders = [tmp_path / "machine0", tmp_path / "machine1"]
    (rc0, out0, err0), (rc1, _, err1) = two_machines(
        DDP, lambda rank: two_process_overrides(tiny_model_dir, folders[rank], *more, "rollout.generators=1"))
    assert rc0 == rc1 == 0, (err0[-2000:], err1[-2000:])
    assert "preflight: processes: 1, strategy: single" in out0  # the trainer alone in its group
    assert [row["rollout/lag_steps"] for row in read_metrics(folders[0] / "metrics.jsonl")] == [0, 1, 1]
    same_steps(tmp_path / "one", folders[0], 3)
    assert not folders[1].exists()  # the generator writes nothing


DIES_AT_STEP_3 = """
import os, signal
if os.environ.get("RANK") == "1":  # machine 1's process (not its launcher): killed as step 3 begins
    from vlmrl.training import ahead
    collect = ahead.collect_experience

    def dies(sampler, step, cursor):
        if step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return collect(sampler, step, cursor)

    ahead.collect_experience = dies  # where the trainer's step takes its rollouts (training/ahead.py)
"""
"""A sitecustomize module: machine 1's process dies (SIGKILL) at the start of step 3."""


@pytest.mark.slow  # three runs of two machines and one of one process: about 90 s on 2 idle cores
def test_a_process_killed_on_one_machine_stops_the_other_and_the_resume_ends_as_one_process(tmp_path, tiny_model_dir):
    """Machine 1's process is killed at step 3: machine 0's stops with one line naming checkpoint
    step 2, the last complete one, which machine 1's folder does not hold. The resume sends it there
    and the run ends where one process's uninterrupted run does."""
    more = ("train.steps=4", "train.save_every=1")
    run_here(two_process_overrides(tiny_model_dir, tmp_path / "one", *more))
    folders = [tmp_path / "machine0", tmp_path / "machine1"]
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(DIES_AT_STEP_3)
    site = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), str(TESTS),
                                                          os.environ.get("PYTHONPATH")]))}
    (rc0, _, err0), (rc1, _, err1) = two_machines(
        DDP, lambda rank: two_process_overrides(tiny_model_dir, folders[rank], *more), env=site)
    assert rc0 != 0 and rc1 != 0
    errors = [line[line.index("error:"):] for line in err0.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "error: another process of the run is gone (process 0 of 2 lost it: Connection closed by peer"), err0[-3000:]
    assert errors[0].endswith(f"the last complete checkpoint is {folders[0]}/checkpoints/step_000002. Find why it "
                              "stopped (its machine's log), then launch again on every machine with resume=true")
    assert "[rank0]: Traceback" not in err0, err0[-3000:]
    assert sorted(p.name for p in (folders[0] / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert not folders[1].exists()

    (rc0, out0, err0), (rc1, _, err1) = two_machines(
        DDP, lambda rank: two_process_overrides(tiny_model_dir, folders[rank], *more, "resume=true"))
    assert rc0 == rc1 == 0, (err0[-2000:], err1[-2000:])
    assert "resume: sent checkpoint step_000002 (" in out0
    assert [p.name for p in (folders[1] / "checkpoints").iterdir()] == ["step_000002"]
    same_steps(tmp_path / "one", folders[0], 4)



GLOO_LOST = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:60305. This is typically caused by a remote worker crashing. Check the logs of the remote "
             "worker before reporting an error. GLHF!")
"""What gloo raised in machine 0's process when machine 1's was killed (torch 2.13, a RuntimeError)."""


def test_what_says_another_process_is_gone():
    from vlmrl.safety.faults import lost_process
    from vlmrl.training.session import lost_words

    assert lost_process(RuntimeError(GLOO_LOST))
    assert lost_process(torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert not lost_process(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_process(ValueError("Connection closed by peer"))  # not torch's
    assert lost_words(RuntimeError(GLOO_LOST)) == "Connection closed by peer [127.0.0.1]:60305"


def test_a_checkpoint_is_told_apart_by_its_files_sizes_and_ends(tmp_path):
    from vlmrl.training.checkpoint_copy import PROBE, manifest

    one = tmp_path / "a" / "step_000002"
    (one / "sub").mkdir(parents=True)
    (one / "model.safetensors").write_bytes(bytes(3 * PROBE))
    (one / "sub" / "config.json").write_text("{}")
    assert manifest(tmp_path / "none") is None
    files = manifest(one)
    assert [(name, size) for name, size, _ in files] == [("model.safetensors", 3 * PROBE), ("sub/config.json", 2)]
    other = tmp_path / "b" / "step_000002"
    (other / "sub").mkdir(parents=True)
    (other / "sub" / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(bytes(3 * PROBE))
    assert manifest(other) == files  # a copy
    (other / "model.safetensors").write_bytes(bytes(3 * PROBE - 1) + b"x")  # another run's: its last byte
    assert manifest(other) != files
    (other / "model.safetensors").write_bytes(bytes(3 * PROBE))
    (other / "extra.txt").write_text("")
    assert manifest(other) != files
