"""Faults during a run: NaN rewards, losses and gradients, stop signals, damaged checkpoints, and
what may never run code (remote code, pickles)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlmrl import grpo
from launching import launcher
from vlmrl.config import load_config
from vlmrl.errors import Interrupted, VlmrlError
from vlmrl.models import load_policy
from vlmrl.cli import main
from vlmrl.report.tracking import read_metrics
from vlmrl.rollout.sampling import SampledLogprobs
from vlmrl.rewards.reward import build_rewards
from vlmrl.rollout.scoring import score_completions
from vlmrl.safety.checkpoint import DamagedCheckpoint, find_resumable, read_checkpoint
from vlmrl.safety.faults import SAME_STOP_S, StopSignals
from vlmrl.safety.folder_lock import holder
from vlmrl.tasks import Example
from vlmrl.training.trainer import train

TESTS = Path(__file__).parent
LETTER_TASK = "letter_task:LetterTask"  # tests/letter_task.py, loaded by import path
TIMING = ("seconds", "tokens_per_s", "time/")



def overrides(run: Path, model_dir: str, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}", f"output_dir={run}",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.generation_batch_size=2", "train.micro_batch_size=16", "train.lr=1e-3", "algorithm.beta=0.05",
            "train.log_rollouts_every=0", "train.trackers=[]", *extra]


def config(run: Path, model_dir: str, *extra: str):
    return load_config(None, overrides(run, model_dir, *extra))


def params(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForImageTextToText.from_pretrained(folder).state_dict()


def same_params(a: Path, b: Path) -> bool:
    pa, pb = params(a), params(b)
    return all(torch.equal(pa[k], pb[k]) for k in pa)


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


# --------------------------------------------------------------------------- numerical faults


class NanTask:
    name = "nan_task"

    def score(self, example, completion):
        return {"total": float("nan"), "accuracy": 0.0}


def test_a_nan_reward_is_an_error_naming_the_task_and_the_completion():
    example = Example(image=None, prompt="Count the circles.", answer="3")
    rollout = SimpleNamespace(rows=[example], texts=["<answer>three</answer>"])
    with pytest.raises(VlmrlError, match=r"task 'nan_task'\) must give one finite number.*'total': nan.*"
                                         r"for completion '<answer>three</answer>'"):
        score_completions(build_rewards([], NanTask()), rollout)


def poison(monkeypatch, bad_calls: set[int], where: str = "loss") -> None:
    """Make grpo.policy_loss give a NaN loss (or a finite loss with NaN gradients) on these calls
    (one call per step here: one micro-batch)."""
    real, calls = grpo.policy_loss, [0]

    def policy_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] not in bad_calls:
            return out
        if where == "loss":
            return out._replace(loss=out.loss * float("nan"))
        loss = out.loss.clone()
        loss.register_hook(lambda grad: grad * float("nan"))  # the loss stays finite, its gradients do not
        return out._replace(loss=loss)

    monkeypatch.setattr(grpo, "policy_loss", policy_loss)


def test_a_nan_loss_skips_the_update_and_is_counted(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    poison(monkeypatch, {2})
    run = train(config(tmp_path / "run", tiny_model_dir, "train.steps=3", "train.save_every=1",
                       "train.keep_checkpoints=0"))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1]
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None  # NaN is written as null
    assert rows[0]["loss"] is not None and rows[2]["grad_norm"] is not None
    checkpoints = run / "checkpoints"
    assert same_params(checkpoints / "step_000001", checkpoints / "step_000002")  # step 2 changed nothing
    assert not same_params(checkpoints / "step_000002", checkpoints / "step_000003")
    assert [r["lr"] for r in rows] == [1e-3] * 3  # the schedule moved on


def test_nan_gradients_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    poison(monkeypatch, {1, 2, 3, 4, 5}, where="grad")
    with pytest.raises(VlmrlError, match=r"NaN/inf in 2 updates in a row \(train.max_bad_steps=2\); stopped "
                                         r"after step 2 with a checkpoint in .*step_000002") as error:
        train(config(tmp_path / "run", tiny_model_dir, "train.steps=5", "train.max_bad_steps=2"))
    assert "holding the last good weights" in str(error.value)
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["skipped_steps"] for r in rows] == [1, 2] and all(r["loss"] is not None for r in rows)
    state = read_checkpoint(run / "checkpoints" / "step_000002")
    assert state["extra"]["faults"] == {"skipped": 2, "in_a_row": 2}
    assert same_params(Path(tiny_model_dir), run / "checkpoints" / "step_000002")
    assert not (run / "final").exists()


def test_sft_skips_nan_updates(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    from vlmrl.training import sft as sft_module
    from vlmrl.training.logprobs import LogprobScorer

    real = LogprobScorer.__call__

    def nan_logprobs(*args, **kwargs):
        logp, entropy = real(*args, **kwargs)
        return logp * float("nan"), entropy

    monkeypatch.setattr(LogprobScorer, "__call__", nan_logprobs)
    run = sft_module.sft(config(tmp_path / "run", tiny_model_dir, "train.steps=2", "sft.batch_size=4",
                                "train.max_bad_steps=0"))
    assert [r["skipped_steps"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert same_params(Path(tiny_model_dir), run / "final")


def test_the_sampler_marks_non_finite_logits_instead_of_crashing():
    """NaN or +inf logits, or a row with every token at -inf, would stop `generate` ('probability
    tensor contains either inf, nan or element < 0'): such a row samples uniformly and is counted.
    -inf on some tokens is no fault (min_new_tokens masks the end of turn with it)."""
    recorder = SampledLogprobs(1.0, banned=[])
    scores = torch.tensor([[0.0, 1.0, float("-inf")], [float("nan"), 0.0, 0.0], [float("inf"), 0.0, 0.0],
                           [float("-inf")] * 3])  # (4, 3)
    out = recorder(torch.zeros(4, 1, dtype=torch.long), scores)
    assert torch.equal(out[0], scores[0]) and torch.equal(out[1:], torch.zeros(3, 3))
    assert recorder.broken_rows() == 3
    recorder(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3))
    assert recorder.broken_rows() == 3  # a row stays counted once
    assert torch.isfinite(recorder.logprobs(torch.zeros(4, 2, dtype=torch.long))).all()


def nan_model(tiny_model_dir: str, folder: Path) -> Path:
    """A copy of the tiny model with NaN in one text layer's weights."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    name, weight = next((n, p) for n, p in model.named_parameters() if "layers.0" in n and "q_proj.weight" in n)
    with torch.no_grad():
        weight[0, 0] = float("nan")
    model.save_pretrained(folder)
    for item in Path(tiny_model_dir).iterdir():  # tokenizer and processor files
        if not (folder / item.name).exists():
            shutil.copy(item, folder / item.name)
    return folder


def test_nan_weights_stop_training_at_step_1_naming_the_tensors(tmp_path, tiny_model_dir, letter_task):
    bad = nan_model(tiny_model_dir, tmp_path / "nan-model")
    with pytest.raises(VlmrlError, match=r"stopped at step 1: the logits of \d+ completion\(s\) were NaN/inf: \d+ "
                                         r"weight tensor\(s\) hold NaN/inf \(.*layers\.0\..*q_proj\.weight.*\); they "
                                         r"came with the model folder.*no checkpoint was written"):
        train(config(tmp_path / "run", str(bad), "train.steps=2", "train.save_every=1"))
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_nan_weights_are_one_line_in_eval(tmp_path, tiny_model_dir, capsys):
    bad = nan_model(tiny_model_dir, tmp_path / "nan-model")
    assert main(["eval", str(bad), "--task", "shapes", "--n", "2", "--max-new-tokens", "4", "--k", "0", "--no-blind",
                 "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err
    assert "evaluation stopped: the logits of 2 completion(s) were NaN/inf" in err and "Traceback" not in err


def test_an_update_that_makes_the_weights_inf_is_never_saved(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    """train.lr=1e39 (past float32's largest, 3.4e38): the first update's loss and gradient are
    finite, its weights are not. The checkpoint of step 1 is refused (it would rotate good
    checkpoints out), naming the tensors. At 1e30 the weights stay finite and the next step's
    logits are not: that stop names an overflow. (The config refuses such an lr, train.lr's range:
    the guards behind it are reached here with the ranges unchecked.)"""
    monkeypatch.setattr("vlmrl.fields.check_ranges", lambda *args, **kwargs: None)
    with pytest.raises(VlmrlError, match=r"the weights hold NaN/inf \(.*\); the checkpoint of step 1 is not written"):
        train(config(tmp_path / "run", tiny_model_dir, "train.steps=3", "train.save_every=1", "train.lr=1e39"))
    assert not (tmp_path / "run" / "checkpoints" / "step_000001").exists()
    with pytest.raises(VlmrlError, match=r"stopped at step 2: the logits of \d+ completion\(s\) were NaN/inf with finite "
                                         r"weights: an activation overflowed .*Checkpoint of step 1: "):
        train(config(tmp_path / "run2", tiny_model_dir, "train.steps=3", "train.save_every=1", "train.lr=1e30"))


# --------------------------------------------------------------------------- stop signals


def test_ctrl_c_finishes_the_step_saves_and_stops(tmp_path, tiny_model_dir, letter_task, monkeypatch):
    import vlmrl.training.ahead as trainer_module  # where the trainer's step collects its experience

    real, calls = trainer_module.collect_experience, [0]

    def collect(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C in the middle of step 2
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "collect_experience", collect)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as stop:
        train(config(tmp_path / "run", tiny_model_dir, "train.steps=4"))
    assert stop.value.exit_code == 130 and stop.value.step == 2
    assert "SIGINT received: stopped after step 2" in str(stop.value)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "step_000002")["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # handlers given back


def test_one_stop_from_several_senders_is_one_signal_and_a_later_second_stops_at_once():
    """A Ctrl-C that reaches the run twice (the terminal's process group, and a `vlmrl compare` or a
    scheduler passing it on) still stops it after the step with a checkpoint."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever an earlier test left
    stops = StopSignals()
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the same stop, from a second sender: not "stop at once"
        assert stops.received == signal.SIGINT and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        stops.received_at -= SAME_STOP_S + 0.1  # a person asking again, later: stop at once
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stops.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow  # 60 s of CPU (a subprocess and three runs); the SIGINT test above is its fast cousin
def test_sigterm_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_dir):
    """A real SIGTERM to `python -m vlmrl train` after its first metrics line: exit 143 with a
    checkpoint; resume=true then logs exactly what a run never interrupted logs."""
    steps = "train.steps=3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = tmp_path / "stopped"
    # Output goes to files: a pipe nobody reads during the run fills up and stalls it.
    out_file, err_file = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    process = subprocess.Popen([sys.executable, "-m", "vlmrl", "train", *overrides(run, tiny_model_dir, steps)],
                               stdout=out_file, stderr=err_file, env=env)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and process.poll() is None:
        assert time.monotonic() < deadline, "no metrics line within 120 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    out_file.close(), err_file.close()
    out, err = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 143, err[-2000:]
    done = len(read_metrics(metrics))
    assert 1 <= done < 3 and f"SIGTERM received: stopped after step {done}" in err
    assert "preflight: train" in out
    assert read_checkpoint(run / "checkpoints" / f"step_{done:06d}")["step"] == done

    sys.path.insert(0, str(TESTS))
    try:
        resumed = train(config(run, tiny_model_dir, steps, "resume=true"))
        straight = train(config(tmp_path / "straight", tiny_model_dir, steps))
    finally:
        sys.path.remove(str(TESTS))
    resumed_rows, straight_rows = read_metrics(resumed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert without_timing(resumed_rows) == without_timing(straight_rows)
    assert same_params(resumed / "final", straight / "final")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_to_the_launcher_stops_its_processes_with_a_checkpoint(tmp_path, tiny_model_dir):
    """SIGKILL to `accelerate launch` (two processes): they once trained on to their last step,
    holding the run folder. Each follows its launcher (faults.parent_to_follow): a SIGTERM when it
    dies, so both stop after their step with a checkpoint, and the folder is free."""
    run = tmp_path / "run"
    command = launcher("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                       "--dynamo_backend", "no") + ["train", *overrides(run, tiny_model_dir, "train.steps=500")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert time.monotonic() < deadline and process.poll() is None, "no metrics line within 180 s"
            time.sleep(0.05)
        workers = children(process.pid)
        assert len(workers) == 2
        process.kill()
        process.wait()
        deadline = time.monotonic() + 120
        while any(running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(running(pid) for pid in workers), "the launcher's processes trained on"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    steps = len(read_metrics(run / "metrics.jsonl"))
    assert steps < 500 and read_checkpoint(run / "checkpoints" / f"step_{steps:06d}")["step"] == steps
    assert holder(run) is None


# --------------------------------------------------------------------------- checkpoints


def test_keep_last_and_resume_past_a_damaged_checkpoint(tmp_path, tiny_model_dir, letter_task, capsys):
    settings = ["train.steps=3", "train.save_every=1", "train.keep_checkpoints=2"]
    run = train(config(tmp_path / "run", tiny_model_dir, *settings))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    straight = read_metrics(run / "metrics.jsonl")
    state = run / "checkpoints" / "step_000003" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # a kill while copying, a full disk...
    capsys.readouterr()
    resumed = train(config(tmp_path / "run", tiny_model_dir, *settings, "resume=true"))
    err = capsys.readouterr().err
    assert f"checkpoint {run / 'checkpoints' / 'step_000003'} is damaged: trainer_state.pt cannot be read" in err
    assert f"resuming from {run / 'checkpoints' / 'step_000002'}" in err
    assert without_timing(read_metrics(resumed / "metrics.jsonl")) == without_timing(straight)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir):
    """A whole checkpoint folder, copied by each test that damages it."""
    sys.path.insert(0, str(TESTS))
    try:
        run = train(config(tmp_path_factory.mktemp("ckpt") / "run", tiny_model_dir, "train.steps=1",
                           "train.save_every=1"))
    finally:
        sys.path.remove(str(TESTS))
    return run / "checkpoints" / "step_000001"


def damaged_copy(checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(checkpoint, folder)
    return folder


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    (lambda f: (f / "trainer_state.pt").write_bytes(b""), "trainer_state.pt cannot be read"),
    (lambda f: (f / "model.safetensors").unlink(), "no model weights"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-10]),
     r"model.safetensors is truncated: \d+ of \d+ bytes"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope"),
     "model.safetensors has an unreadable header"),
    (lambda f: (f / "reference.safetensors").write_bytes(b"\x00"), r"reference.safetensors is truncated \(1 bytes\)"),
    (lambda f: (f / "config.json").write_text('{"model_type": "qwen2'),  # cut off while written
     r"config.json is unreadable \(Unterminated string starting at: line 1 column 16"),
    (lambda f: (f / "config.json").unlink(), "config.json is missing"),
    (lambda f: (f / "tokenizer_config.json").write_text("[]"), "tokenizer_config.json holds a JSON list, not an object"),
])
def test_a_damaged_checkpoint_is_named(checkpoint, tmp_path, damage, message):
    folder = damaged_copy(checkpoint, tmp_path)
    assert read_checkpoint(folder)["step"] == 1
    damage(folder)
    with pytest.raises(DamagedCheckpoint, match=f"checkpoint {folder} is damaged: {message}"):
        read_checkpoint(folder)
    with pytest.raises(VlmrlError, match="no checkpoint to resume from is whole: checkpoint .* is damaged"):
        find_resumable(tmp_path / "run")


# --------------------------------------------------------------------------- nothing runs code


class Payload:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_trainer_state_is_read_without_running_code(checkpoint, tmp_path, capsys):
    folder = damaged_copy(checkpoint, tmp_path)
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    state["extra"] = Payload()
    torch.save(state, folder / "trainer_state.pt")
    with pytest.raises(DamagedCheckpoint, match="trainer_state.pt cannot be read .*UnpicklingError"):
        read_checkpoint(folder)
    assert "code ran" not in capsys.readouterr().out


def test_pickled_weights_are_refused(tiny_model_dir, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, folder)
    torch.save(params(folder), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(VlmrlError, match=r"holds its weights as pytorch_model.bin \(PyTorch pickle\) and no "
                                         r"model.safetensors: vlmrl loads safetensors weights only"):
        load_policy(str(folder), device="cpu")


def test_remote_code_only_when_the_config_says_so(tmp_path, tiny_model_dir, monkeypatch):
    import transformers

    from vlmrl.models.loading import load_trainable_policy

    seen = []
    for cls in (transformers.AutoModelForImageTextToText, transformers.AutoProcessor):
        real = cls.from_pretrained.__func__

        def spy(klass, *args, _real=real, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code"), kwargs.get("use_safetensors")))
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    for flag in (False, True):
        seen.clear()
        settings = config(tmp_path, tiny_model_dir, f"model.trust_remote_code={str(flag).lower()}")
        load_trainable_policy(settings, torch.device("cpu"), None)
        assert ("AutoProcessor", flag, None) in seen and ("AutoModelForImageTextToText", flag, True) in seen
