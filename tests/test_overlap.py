"""The host side overlapped changes no number: the next calls' examples made and encoded ahead on a
worker thread (training/prefetch.py) and checkpoints written from a copy on a background thread
(safety/checkpoint_writer.py) give the losses, checkpoints and final weights of a run without them;
a failure in either stops the run in one line at the step that needs it; a kill while a checkpoint
is written leaves the one before, from which resume continues exactly. Rewards scored in the
background while the next generate call runs (training/background_scoring.py) give the scores, the
metrics and the failure of scoring each call in turn. Logs written on a background thread
(training/log_writer.py) are the files written on the step's path, line for line, and an error
mid-run still leaves every line up to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from http_servers import LocalServer, json_answer
from letter_task import LetterTask
from vlmrl.config import load_config
from vlmrl.disk import DiskFull
from vlmrl.errors import VlmrlError
from vlmrl.models.loading import load_policy, load_processor
from vlmrl.report import tracking
from vlmrl.report.tracking import read_metrics
from vlmrl.safety import checkpoint, preflight
from vlmrl.safety.checkpoint import STATE_FILE, read_checkpoint
from vlmrl.training import session as session_module
from vlmrl.training import trainer as trainer_module
from vlmrl.training.log_writer import LogWriter
from vlmrl.training.prefetch import Prefetcher, call_indices
from vlmrl.training.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)

TESTS = Path(__file__).parent
TIMING = ("seconds", "tokens_per_s", "time/")
PLAIN = ("train.prefetch_batches=0", "train.background_checkpoints=false")
OVERLAPPED = ("train.prefetch_batches=2", "train.background_checkpoints=true")


class ThreadedLetters(LetterTask):
    """The letter task, noting which thread first made each train example; `bad` ones fail."""

    def __init__(self, bad: tuple[int, ...] = ()):
        super().__init__()
        self.made: dict[int, str] = {}
        self.bad = set(bad)

    def _example(self, idx: int, split: str):
        if split == "train":
            self.made.setdefault(idx, threading.current_thread().name)
            if idx in self.bad:
                raise ValueError(f"row {idx} is unreadable")
        return super()._example(idx, split)


def overrides(run: Path, model_dir: str, *extra: str) -> list[str]:
    """3 steps of 2 prompts x 2 completions, one prompt per generate call (2 calls a step), a checkpoint
    after each step, a reference copy refreshed at step 2 (saved with every checkpoint)."""
    return [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={run}", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "rollout.generation_batch_size=1", "train.micro_batch_size=4", "train.lr=1e-3", "algorithm.beta=0.05",
            "algorithm.ref_refresh_steps=2", "train.log_rollouts_every=0", "train.trackers=[]", "train.save_every=1",
            "train.keep_checkpoints=3", "train.steps=3", *extra]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def assert_same(a, b, where: str = "") -> None:
    """Equal plain data, tensors equal to the bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_checkpoint(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for settings in a.glob("*.json"):
        assert settings.read_text() == (b / settings.name).read_text(), settings.name
    assert_same(torch.load(a / STATE_FILE, weights_only=True), torch.load(b / STATE_FILE, weights_only=True), a.name)
    for name in ("model.safetensors", "reference.safetensors"):
        assert_same(load_file(a / name), load_file(b / name), f"{a.name}/{name}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_model_dir) -> tuple[Path, ThreadedLetters]:
    """The run without overlap: every example made on the main thread, every checkpoint written on it."""
    task = ThreadedLetters()
    run = train(load_config(None, overrides(tmp_path_factory.mktemp("plain") / "run", tiny_model_dir, *PLAIN)), task)
    return run, task


def test_the_overlapped_run_equals_the_plain_one_and_resumes_exactly(plain, tmp_path, tiny_model_dir, letter_task,
                                                                     monkeypatch, capsys):
    plain_run, plain_task = plain
    writers = []

    def recording(*args):
        writers.append(threading.current_thread().name)
        return checkpoint.write_checkpoint(*args)

    monkeypatch.setattr(session_module, "write_checkpoint", recording)
    task = ThreadedLetters()
    run = train(load_config(None, overrides(tmp_path / "run", tiny_model_dir, *OVERLAPPED)), task)

    # where the work ran: steps 2 and 3's examples (4..5 after the preflight's first batch) on the
    # worker, every checkpoint on the writer's thread; without overlap, all on the main thread
    assert {task.made[idx] for idx in (2, 3, 4, 5)} == {"vlmrl-prefetch"}
    assert {plain_task.made[idx] for idx in (2, 3, 4, 5)} == {"MainThread"}
    assert writers == ["vlmrl-checkpoint"] * 3
    out = capsys.readouterr().out
    assert "preflight: checkpoints written in the background (host copy " in out and " GiB available beside " in out
    rows = read_metrics(run / "metrics.jsonl")
    assert all(row["time/data_ahead"] > 0 and row["time/data"] >= 0 for row in rows[1:])
    assert [("time/checkpoint" in row) for row in rows] == [False, True, True]
    assert sum("time/checkpoint_write" in row for row in rows) >= 1  # the writes' own time, hidden
    assert all(row["time/data_ahead"] == 0 for row in read_metrics(plain_run / "metrics.jsonl"))

    # the same numbers: every step's metrics, every checkpoint to the bit, the final weights
    assert without_timing(rows) == without_timing(read_metrics(plain_run / "metrics.jsonl"))
    for step in (1, 2, 3):
        name = f"checkpoints/step_{step:06d}"
        assert_same_checkpoint(run / name, plain_run / name)
    assert_same(load_file(run / "final/model.safetensors"), load_file(plain_run / "final/model.safetensors"))

    # resumed from a checkpoint written in the background, the overlap off (a setting a resume may
    # change: it leaves the run what it was): the plain run's last step, exactly
    for gone in ("checkpoints/step_000003", "final"):
        checkpoint._remove(run / gone)
    train(load_config(None, overrides(tmp_path / "run", tiny_model_dir, *PLAIN, "resume=true")), ThreadedLetters())
    assert without_timing(read_metrics(run / "metrics.jsonl")) == without_timing(read_metrics(plain_run / "metrics.jsonl"))
    assert_same(load_file(run / "final/model.safetensors"), load_file(plain_run / "final/model.safetensors"))


def test_a_host_copy_that_does_not_fit_writes_on_the_step_s_path_and_says_why(plain, tmp_path, tiny_model_dir,
                                                                            letter_task, monkeypatch, capsys):
    """Background checkpoints asked for, the host's RAM too small for their copy beside the run: the
    run is not refused, it writes on the step's path, says so before step 1, and its checkpoints are
    the background run's (the plain run's, which test_the_overlapped_run_equals_the_plain_one holds equal)."""
    writers, write = [], checkpoint.write_checkpoint

    def recording(*args, **kwargs):
        writers.append(threading.current_thread().name)
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_checkpoint", recording)  # save_checkpoint's, and the thread's
    monkeypatch.setattr(session_module, "write_checkpoint", recording)
    monkeypatch.setattr(preflight, "free_memory", lambda device: 4 * 2**20)  # the CPU's RAM: 4 MiB available
    run = train(load_config(None, overrides(tmp_path / "run", tiny_model_dir, *OVERLAPPED,
                                            "model.gradient_checkpointing=false")), ThreadedLetters())
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("preflight: checkpoints")][-1]
    assert line.startswith("preflight: checkpoints written on the step's path, not in the background: their host copy (")
    assert "does not fit in the 4.0 MiB available beside the run's " in line and line.endswith("(10% kept spare)")
    assert writers == ["MainThread"] * 3
    for step in (1, 2, 3):
        name = f"checkpoints/step_{step:06d}"
        assert_same_checkpoint(run / name, plain[0] / name)


def test_a_lora_checkpoint_s_host_copy_holds_the_adapter_alone(tmp_path, tiny_model_dir):
    """A background checkpoint of a LoRA policy copies the adapter's tensors, not the base model's
    (session.own_weights), and writes the adapter file save_pretrained writes from the live model;
    the preflight counts that copy."""
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.lora.enabled=true", "model.lora.r=4"])
    policy, processor = load_policy(tiny_model_dir, device="cpu", dtype="float32", lora=config.model.lora)
    weights = session_module.own_weights(policy)
    adapter = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert set(weights) == adapter and all("lora_" in name for name in weights)
    policy.save_pretrained(tmp_path / "live")
    policy.save_pretrained(tmp_path / "copy", state_dict=checkpoint.host_copy(weights))
    assert_same(load_file(tmp_path / "live/adapter_model.safetensors"),
                load_file(tmp_path / "copy/adapter_model.safetensors"))
    memory = preflight.MemoryEstimate("cpu", 0, 0, 0, 0, 0, 0, 0, free=2**40)
    adapter_bytes = sum(value.numel() * 4 for value in weights.values())
    plan = preflight.checkpoint_plan(config, policy, "train", memory)
    assert plan.copy == 3 * adapter_bytes  # LoRA with no refresh: its reference is the base, not saved
    sharded = preflight.checkpoint_plan(config, policy, "train", memory, preflight.Sharding(2))
    assert sharded.copy == sum(p.numel() * 4 for p in policy.parameters()) + 2 * adapter_bytes  # gathered whole


class HeldWriter:
    """A CheckpointWriter that holds its write until the test runs it."""

    def start(self, write) -> None:
        self.write = write


def background_save(tmp_path: Path, model_dir: str, whole_of) -> tuple:
    """A session's background checkpoint of a tiny policy (one AdamW step taken, a reference copy)
    taken with `whole_of(policy, optimizer)` as its gathered state; training then goes on (another
    optimizer step, a refresh of the reference) before the writer's thread writes it. Returns the
    state and reference at save time, and the folder written."""
    from types import SimpleNamespace

    from vlmrl.config import AlgorithmConfig
    from vlmrl.training.reference import ReferencePolicy

    policy, processor = load_policy(model_dir, device="cpu", dtype="float32")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    reference = ReferencePolicy(policy, AlgorithmConfig(beta=0.05, ref_refresh_steps=1, ref_mix=0.5))

    def step() -> None:
        for p in policy.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()

    step()
    session = SimpleNamespace(processor=processor, optimizer=optimizer, policy=policy, reference=reference,
                              scheduler=scheduler, writer=HeldWriter(), run_dir=tmp_path, command="train",
                              guard=SimpleNamespace(state_dict=dict), carried={},
                              config=SimpleNamespace(train=SimpleNamespace(keep_checkpoints=2)))
    then = checkpoint.host_copy((optimizer.state_dict(), reference.saved_weights()))
    session_module.TrainingSession.write_in_background(session, 1, 7, whole_of(policy, optimizer))
    step()  # training goes on while the thread has not written yet
    assert reference.maybe_refresh(policy, 1)
    session.writer.write()
    return then, tmp_path / "checkpoints/step_000001"


def test_a_zero3_background_checkpoint_holds_the_reference_of_its_step(tmp_path, tiny_model_dir):
    """ZeRO-3 gathers the policy and its optimizer state, not the reference (whole and live on each
    process): the background checkpoint copies it at save time, so a refresh (an in-place lerp) that
    comes before the thread writes is not in it."""
    weights = lambda policy, optimizer: checkpoint.Gathered(checkpoint.host_copy(session_module.own_weights(policy)),
                                                           checkpoint.host_copy(optimizer.state_dict()))
    (_, reference), folder = background_save(tmp_path, tiny_model_dir, weights)
    assert_same(load_file(folder / "reference.safetensors"), reference)


def test_an_fsdp2_background_checkpoint_holds_the_optimizer_state_of_its_step(tmp_path, tiny_model_dir):
    """FSDP2's full optimizer state (cpu_offload) hands a 0-d CPU tensor, AdamW's `step`, back as the
    live one: the background path clones what shares storage with the live state, so the next
    optimizer step (which increments it in place) is not in trainer_state.pt."""
    whole = lambda policy, optimizer: checkpoint.Gathered(checkpoint.host_copy(session_module.own_weights(policy)),
                                                         optimizer.state_dict(), {})  # live, as FSDP2's step; {}: a gathered reference
    (state, _), folder = background_save(tmp_path, tiny_model_dir, whole)
    saved = torch.load(folder / STATE_FILE, weights_only=True)["optimizer"]
    assert {int(s["step"]) for s in saved["state"].values()} == {1}
    assert_same(saved, state)


def test_unshared_leaves_no_tensor_of_the_live_optimizer_state():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    live = optimizer.state_dict()  # every tensor the live one
    fresh = torch.zeros(2)
    copied = checkpoint.unshared({"optimizer": live, "fresh": fresh}, checkpoint.live_storages(optimizer))
    storages = checkpoint.live_storages(optimizer)
    tensors = [v for s in copied["optimizer"]["state"].values() for v in s.values()]
    assert len(tensors) == 6 and not {t.untyped_storage().data_ptr() for t in tensors} & storages
    assert copied["fresh"] is fresh  # a fresh host copy is not copied twice
    optimizer.step()
    assert {int(s["step"]) for s in copied["optimizer"]["state"].values()} == {1}


def test_a_bad_example_met_by_the_worker_stops_the_run_at_its_step_in_one_line(tmp_path, tiny_model_dir, letter_task):
    task = ThreadedLetters(bad=(4,))  # the first prompt of step 3
    run = tmp_path / "run"
    with pytest.raises(VlmrlError) as stopped:
        train(load_config(None, overrides(run, tiny_model_dir, *OVERLAPPED)), task)
    assert task.made[4] == "vlmrl-prefetch"  # the worker met it first, during step 2
    assert str(stopped.value) == (
        "bad data at step 3: train example 4: task 'letters' cannot make train example 4: ValueError: row 4 is "
        f"unreadable; stopped with a checkpoint of step 2 in {run}/checkpoints/step_000002. Fix the data, or set "
        "task.params.on_bad_row=skip to replace bad rows by the next good ones, then resume=true")
    assert read_checkpoint(run / "checkpoints" / "step_000002")["step"] == 2  # written in the background, whole


def test_a_failed_background_write_stops_the_run_in_one_line_and_keeps_the_one_before(tmp_path, tiny_model_dir,
                                                                                      letter_task, monkeypatch):
    durable = checkpoint.make_durable

    def full_at_step_2(folder: Path) -> None:
        if folder.name == ".tmp_step_000002":
            raise OSError(28, "No space left on device", str(folder / "model.safetensors"))
        durable(folder)

    monkeypatch.setattr(checkpoint, "make_durable", full_at_step_2)
    run = tmp_path / "run"
    with pytest.raises(DiskFull) as stopped:
        train(load_config(None, overrides(run, tiny_model_dir, *OVERLAPPED)), ThreadedLetters())
    message = str(stopped.value)
    assert "\n" not in message and message.startswith(
        f"the disk is full: writing checkpoint step 2 to {run}/checkpoints/.tmp_step_000002 failed")
    assert message.endswith(f"The partial checkpoint was removed and {run}/checkpoints/step_000001 is intact: free "
                            "some space, then rerun with resume=true")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    assert len(read_metrics(run / "metrics.jsonl")) == 3  # raised at the end of the step after the failed write


KILLED_RUN = """
import sys, time
from pathlib import Path
from vlmrl.config import load_config
from vlmrl.safety import checkpoint
from vlmrl.training.trainer import train

durable = checkpoint.make_durable
def stuck_at_step_2(folder):
    if folder.name == ".tmp_step_000002":
        while True:  # every file written, not yet renamed into place: killed here
            time.sleep(1)
    durable(folder)
checkpoint.make_durable = stuck_at_step_2
train(load_config(None, sys.argv[1:]))
"""


@pytest.mark.slow  # ~10 s: a fresh Python process to kill
def test_a_kill_while_a_checkpoint_is_written_leaves_the_one_before_and_resume_is_exact(plain, tmp_path,
                                                                                         tiny_model_dir, letter_task):
    run = tmp_path / "run"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", KILLED_RUN, *overrides(run, tiny_model_dir, *OVERLAPPED)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    try:  # step 3 trained while step 2's checkpoint was written: then killed mid-write
        while not (metrics.exists() and len(metrics.read_text().splitlines()) == 3):
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert (run / "checkpoints" / ".tmp_step_000002" / STATE_FILE).exists()  # half-way: its files, not its name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".tmp_step_000002", "step_000001"]
    assert read_checkpoint(run / "checkpoints" / "step_000001")["step"] == 1

    train(load_config(None, overrides(run, tiny_model_dir, *OVERLAPPED, "resume=true")))
    plain_run = plain[0]
    assert without_timing(read_metrics(metrics)) == without_timing(read_metrics(plain_run / "metrics.jsonl"))
    assert_same(load_file(run / "final/model.safetensors"), load_file(plain_run / "final/model.safetensors"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]


def test_the_worker_prepares_the_calls_that_come_next_in_order(tiny_model_dir):
    assert [c for _, c in zip(range(5), call_indices(2, 4, 2, 8))] == [[2, 3], [4, 5], [10, 11], [12, 13], [18, 19]]
    task = ThreadedLetters(bad=(5,))
    prefetcher = Prefetcher(task, load_processor(tiny_model_dir), limit=None, encode=True, depth=2)
    try:
        first, waited = prefetcher.take([0], first=0, layout=(2, 1, 4))  # not foreseen: the trainer draws it
        assert first is None and waited == 0
        assert [indices for indices, _ in prefetcher.pending] == [[1], [4]]
        second, _ = prefetcher.take([1], first=0, layout=(2, 1, 4))
        assert second.examples[0].meta == {"idx": 1} and second.prompt["input_ids"].shape[0] == 1
        third, _ = prefetcher.take([4], first=4, layout=(2, 1, 4))
        assert third.error is None and [indices for indices, _ in prefetcher.pending] == [[5], [8]]
        fourth, _ = prefetcher.take([5], first=4, layout=(2, 1, 4))  # kept for the trainer to meet it again
        assert fourth.examples is None and str(fourth.error) == (
            "task 'letters' cannot make train example 5: ValueError: row 5 is unreadable")
    finally:
        prefetcher.close()
    assert {task.made[idx] for idx in (1, 4, 5)} == {"vlmrl-prefetch"}


def test_a_sampler_whose_rewards_cannot_be_built_leaves_no_prefetching_thread(tmp_path, tiny_model_dir, monkeypatch):
    from types import SimpleNamespace

    from vlmrl.training import experience

    def broken(*args):
        raise VlmrlError("no such reward")

    monkeypatch.setattr(experience, "build_rewards", broken)
    config = load_config(None, overrides(tmp_path / "run", tiny_model_dir, *OVERLAPPED, "rollout.share_prompt_cache=false"))
    session = SimpleNamespace(config=config, processor=load_processor(tiny_model_dir))
    before = {t for t in threading.enumerate() if t.name == "vlmrl-prefetch"}
    with pytest.raises(VlmrlError, match="^no such reward$"):
        experience.GroupSampler.for_run(session, ThreadedLetters())
    assert {t for t in threading.enumerate() if t.name == "vlmrl-prefetch"} == before


class HeldLetters(ThreadedLetters):
    """The letter task, its first train example held until `go` is set."""

    def __init__(self):
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def _example(self, idx: int, split: str):
        self.started.set()
        self.go.wait(10)
        return super()._example(idx, split)


def test_close_stops_the_worker_after_the_call_it_is_on(tiny_model_dir):
    task = HeldLetters()
    prefetcher = Prefetcher(task, load_processor(tiny_model_dir), limit=None, encode=False, depth=3)
    prefetcher.take([0], first=0, layout=(4, 1, 4))  # asks for [1], [2], [3]
    assert task.started.wait(10)
    threading.Timer(0.3, task.go.set).start()  # the call the worker is on ends after close() is called
    prefetcher.close()  # returns once that call is done: no thread left inside a task at the exit
    assert not prefetcher.thread.is_alive() and sorted(task.made) == [1]  # [2] and [3] dropped


def test_a_call_off_the_planned_grid_is_not_foreseen_and_does_not_hang(tiny_model_dir):
    """Indices that are none of the round's calls (the layout's grid) give (None, 0) at once and
    ask the worker for nothing; the next call on the grid plans again."""
    prefetcher = Prefetcher(ThreadedLetters(), load_processor(tiny_model_dir), limit=None, encode=False, depth=2)
    try:
        assert prefetcher.take([1, 2], first=0, layout=(4, 2, 8)) == (None, 0.0)  # calls are [0, 1], [2, 3]
        assert not prefetcher.pending and prefetcher.plan is None
        assert prefetcher.take([2, 3], first=0, layout=(4, 2, 8)) == (None, 0.0)
        assert [indices for indices, _ in prefetcher.pending] == [[8, 9], [10, 11]]
    finally:
        prefetcher.close()


# --------------------------------------------------------------------------- rewards scored beside generation


class RowLetters(ThreadedLetters):
    """The letter task whose examples carry their index as a data column, `row`, sent to reward services."""

    def _example(self, idx: int, split: str):
        example = super()._example(idx, split)
        example.meta["columns"] = {"row": idx}
        return example


class SlowService(LocalServer):
    """A reward service: (characters of the completion mod 3) / 2 per completion, so groups have
    signal. `together`: each answer held until another call is in flight too or has come since (at
    most 5 s: a step's calls out at once show as `peak` 2 however slowly the machine generates). Its failures, by the
    row a call scores: row 2 a 500 after 0.3 s, row 3 at once a list one value short (the later call
    fails first in time)."""

    def __init__(self, together: bool = False, failing: bool = False):
        self.together, self.failing = together, failing
        super().__init__(self.answer)
        self.url = self.address("/score")

    def answer(self, request):
        rows, texts = request.json["row"], [c[0]["content"] for c in request.json["completions"]]
        if self.failing and 2 in rows:
            time.sleep(0.3)
            return 500, {}, b""
        if self.failing and 3 in rows:
            return json_answer({"rewards": [0.5] * (len(texts) - 1)})
        mine, deadline = len(self.requests), time.monotonic() + 5  # this call is the last one recorded
        while self.together and self.in_flight < 2 and len(self.requests) == mine and time.monotonic() < deadline:
            time.sleep(0.01)  # held until another call is out too, or has come since
        return json_answer({"rewards": [(len(text) % 3) / 2 for text in texts]})


def scored_run(run: Path, model_dir: str, url: str, background: bool) -> list[str]:
    """2 steps of 2 generate calls, rewarded by the task and the service at `url` (no retries); the
    other overlaps off, no reference, a checkpoint at the end (or at a stop)."""
    rewards = json.dumps(["task", {"name": url, "label": "service", "kwargs": {"retries": 0}}])
    return overrides(run, model_dir, *PLAIN, "train.steps=2", "train.save_every=0", "algorithm.beta=0",
                     f"rewards={rewards}",
                     f"train.background_scoring={str(background).lower()}")


def test_rewards_scored_in_the_background_equal_scoring_each_call_in_turn(tmp_path, tiny_model_dir, letter_task):
    runs, peaks = {}, {}
    for background in (False, True):
        service = SlowService(together=background)  # in turn a held answer would wait its 5 s
        try:
            runs[background] = train(load_config(None, scored_run(tmp_path / str(background), tiny_model_dir,
                                                                  service.url, background)), RowLetters())
        finally:
            service.close()
        peaks[background] = service.peak
        assert len(service.requests) == 4  # one call per generate call
    # in turn, each call waited for the one before; in the background both calls of a step were out at once
    assert peaks == {False: 1, True: 2}
    rows = {background: read_metrics(run / "metrics.jsonl") for background, run in runs.items()}
    assert all(row["time/score_ahead"] == 0 for row in rows[False])
    assert all(row["time/score_ahead"] > 0 for row in rows[True])  # the service's answers, hidden
    assert all("reward/service" in row for row in rows[True])
    assert without_timing(rows[True]) == without_timing(rows[False])
    assert_same(load_file(runs[True] / "final/model.safetensors"), load_file(runs[False] / "final/model.safetensors"))


def test_a_reward_that_fails_in_the_background_stops_the_run_as_scoring_in_turn_does(tmp_path, tiny_model_dir,
                                                                                        letter_task):
    """Step 2's first call fails (a 500) after its second call failed (one value short): both ways the
    run stops on the first call's failure, with a checkpoint of step 1."""
    stops = {}
    for background in (False, True):
        service = SlowService(failing=True)
        run = tmp_path / str(background)
        try:
            with pytest.raises(VlmrlError) as stop:
                train(load_config(None, scored_run(run, tiny_model_dir, service.url, background)), RowLetters())
        finally:
            service.close()
        stops[background] = str(stop.value).replace(str(run), "RUN").replace(service.url, "URL")
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    assert stops[True] == stops[False]
    assert stops[True].startswith("a reward failed at step 2: reward 'service' (URL) failed: ServiceDown: ")
    assert "HTTP Error 500" in stops[True] and "returned 1 values" not in stops[True]


def test_a_judge_s_concurrency_bounds_its_requests_over_the_calls_under_way():
    """Two generate calls' batches judged at once (background scoring) share the judge's `concurrency`:
    at most 2 requests out, not 2 per batch; every completion of both batches judged."""
    from vlmrl.rewards.judge import judge_reward

    def answer(request):
        time.sleep(0.05)
        return json_answer({"choices": [{"message": {"role": "assistant", "content": "Score: 1"}}]})

    server = LocalServer(answer)
    try:
        judge, _ = judge_reward({"url": server.address("/v1"), "model": "m", "template": "{completion}",
                                 "concurrency": 2, "retries": 0})
        batch = {"prompts": [[{"role": "user", "content": "q"}]] * 4, "answer": ["a"] * 4,
                 "completions": [[{"role": "assistant", "content": f"c{i}"}] for i in range(4)]}
        threads = [threading.Thread(target=lambda: scores.append(judge(**batch))) for _ in range(2)]
        scores: list = []
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        server.close()
    assert server.peak == 2 and len(server.requests) == 8
    assert scores == [[{"total": 1.0, "unparsable": 0.0}] * 4] * 2


def test_the_chunk_scorer_calls_each_reward_where_it_may_and_fails_as_scoring_in_turn():
    """A reward of the trainer's thread is called there at hand-off; one in the reward worker on one
    background thread, the calls in order; a service's on the service threads. The scores are
    score_completions's; a failure is the first failing reward of the list, even when a later one
    failed sooner, and a trainer-thread reward after a failing one is not called."""
    from types import SimpleNamespace

    from vlmrl.rewards.reward import IN_WORKER, SERVICE, Reward
    from vlmrl.rewards.score import RewardError
    from vlmrl.rollout.scoring import score_completions
    from vlmrl.tasks.base import Example
    from vlmrl.training.background_scoring import ChunkScorer

    seen = []

    def reward(label: str, fails: bool = False, wait_s: float = 0.0):
        def fn(completions):
            time.sleep(wait_s)
            seen.append((label, completions[0][0]["content"], threading.current_thread().name))
            if fails:
                raise ValueError(f"{label} is down")
            return [len(c[0]["content"]) * {"w": 1, "h": 10, "s": 100}.get(label, 1) for c in completions]
        return Reward(label, fn, takes=frozenset({"completions"}), spec=label,
                      runs={"w": IN_WORKER, "s": SERVICE}.get(label[0], "here"))

    def rollout(*texts: str):
        return SimpleNamespace(rows=[Example(image=None, prompt="p", answer="a", meta={})] * len(texts),
                               texts=list(texts))

    rewards = [reward("w"), reward("h"), reward("s")]
    scorer = ChunkScorer(rewards, "sum", 2, background=True)
    try:
        calls = [rollout(f"c{i}", f"cc{i}") for i in range(3)]
        scorings = [scorer.submit(call) for call in calls]
        results = [scorer.result(scoring, 2) for scoring in scorings]
    finally:
        scorer.close()
    threads = {label: {thread.rstrip("0123456789") for other, _, thread in seen if other == label} for label in "whs"}
    assert threads == {"w": {"vlmrl-score-in_worker_"}, "h": {"MainThread"}, "s": {"vlmrl-score-service_"}}
    assert [text for label, text, _ in seen if label == "w"] == ["c0", "c1", "c2"]
    for call, result in zip(calls, results):
        assert_same(result, score_completions(rewards, call, "sum", 2))

    seen.clear()
    failing = [reward("s_slow", fails=True, wait_s=0.3), reward("h_fails", fails=True), reward("h_after")]
    scorer = ChunkScorer(failing, "sum", 2, background=True)
    try:
        with pytest.raises(RewardError, match=r"^reward 's_slow' \(s_slow\) failed: ValueError: s_slow is down"):
            scorer.result(scorer.submit(rollout("x", "y")), 2)
    finally:
        scorer.close()
    assert [label for label, _, _ in seen] == ["h_fails", "s_slow"]  # h_after not called; s_slow failed later


WALL_TIME = ("seconds", "tokens_per_s", "time/cpu", "time/data", "time/data_ahead", "time/generate", "time/score",
             "time/score_ahead", "time/train", "time/checkpoint", "time/log", "time/log_write")
"""The metrics that measure wall or CPU time, the only values two runs of the same seed may differ in."""


def masked_lines(path: Path) -> list[str]:
    """metrics.jsonl's lines, each with the values of WALL_TIME set to null (every other key and value,
    and their order, as written: json reads and writes a float back to the same text)."""
    return [json.dumps({key: None if key in WALL_TIME else value for key, value in json.loads(line).items()})
            for line in path.read_text().splitlines()]


def rollout_files(run: Path) -> dict[str, bytes]:
    """Every file under run/rollouts (the step files and the images), by its relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "rollouts").rglob("*")) if p.is_file()}


def slow_thread_noting(monkeypatch, threads: list[str], delay: float) -> None:
    """metrics.jsonl rows and rollout files are written `delay` s late, each noting its thread's name."""
    log, write = tracking.MetricsLog.log, trainer_module.write_rollouts

    def late(function):
        def wrapper(*args):
            threads.append(threading.current_thread().name)
            time.sleep(delay)
            return function(*args)
        return wrapper

    monkeypatch.setattr(tracking.MetricsLog, "log", late(log))
    monkeypatch.setattr(trainer_module, "write_rollouts", late(write))


def test_logs_written_in_the_background_are_the_logs_written_on_the_path(tmp_path, tiny_model_dir, letter_task,
                                                                         monkeypatch):
    runs, threads = {}, {}
    for background in (False, True):
        threads[background] = []
        slow_thread_noting(monkeypatch, threads[background], 0.2)
        runs[background] = train(load_config(None, overrides(
            tmp_path / str(background), tiny_model_dir, *PLAIN, "train.steps=2", "train.save_every=1",
            "algorithm.beta=0", "train.log_rollouts_every=1", f"train.background_logs={str(background).lower()}")),
            ThreadedLetters())
        monkeypatch.undo()
    assert set(threads[False]) == {"MainThread"} and set(threads[True]) == {"vlmrl-logs"}
    assert len(threads[True]) == 4  # 2 rows of metrics, 2 steps of rollouts
    # the same lines in the same order, every value but the clocks' (WALL_TIME); the same rollout files, to the byte
    assert masked_lines(runs[True] / "metrics.jsonl") == masked_lines(runs[False] / "metrics.jsonl")
    files = rollout_files(runs[True])
    assert {"rollouts/step_000001.jsonl", "rollouts/step_000002.jsonl"} <= files.keys()
    assert files == rollout_files(runs[False])
    # the 0.2 s writes were on the step's path, or on the thread (hidden)
    rows = {background: read_metrics(run / "metrics.jsonl") for background, run in runs.items()}
    assert rows[False][1]["time/log"] >= 0.4 and rows[False][1]["time/log_write"] == 0  # row 1 and rollouts 2
    assert rows[True][1]["time/log"] < 0.2 and rows[True][1]["time/log_write"] >= 0.2


def test_an_error_mid_run_leaves_the_logs_of_every_step_before_it(tmp_path, tiny_model_dir, letter_task,
                                                                   monkeypatch):
    """The update of step 3 raises; no checkpoint drains the writer (save_every=0): closing the run does."""
    threads = []
    slow_thread_noting(monkeypatch, threads, 0.3)
    update = trainer_module.update_policy
    calls = []

    def failing_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the update of step 3 broke")
        return update(*args)

    monkeypatch.setattr(trainer_module, "update_policy", failing_at_step_3)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="step 3 broke"):
        train(load_config(None, overrides(run, tiny_model_dir, *PLAIN, "train.save_every=0", "algorithm.beta=0",
                                          "train.log_rollouts_every=1", "train.background_logs=true")),
              ThreadedLetters())
    assert set(threads) == {"vlmrl-logs"}
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert sorted(p.name for p in (run / "rollouts").glob("step_*")) == ["step_000001.jsonl", "step_000002.jsonl"]


def test_the_log_writer_keeps_the_order_and_raises_a_failed_write_on_the_caller_s_thread():
    done = []
    writer = LogWriter()
    for i in range(20):  # more than the queue holds: the caller waits for room
        writer.put(lambda i=i: done.append(i))
    writer.drain()
    assert done == list(range(20))
    writer.put(lambda: (_ for _ in ()).throw(DiskFull("the disk is full: writing metrics")))
    writer.put(lambda: done.append("after"))  # not written: the run stops on the failure
    with pytest.raises(DiskFull, match="writing metrics"):
        writer.drain()
    assert done == list(range(20))
    writer.close()
    assert writer.thread is None and writer.take_seconds() >= 0
