"""folder_lock.py: one process at a time in a folder, a dead holder never blocks, and the trainer
refuses a run folder that another process trains in before it reads or writes anything there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vlmrl.config import load_config
from vlmrl.errors import VlmrlError
from vlmrl.safety.folder_lock import FolderBusy, hold, holder
from vlmrl.training.trainer import train

SRC = Path(__file__).parent.parent / "src"


def holder_seen_from_another_process(folder: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    code = "import sys; from vlmrl.safety.folder_lock import holder; print(holder(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_a_folder_another_process_holds_is_refused_and_a_dead_holder_blocks_nothing(tmp_path, held_elsewhere):
    folder = tmp_path / "run"
    with held_elsewhere(folder) as pid:
        assert holder(folder) == pid
        with pytest.raises(FolderBusy) as busy:
            hold(folder, "another vlmrl run")
        assert str(busy.value) == (f"{folder} is in use by another vlmrl run (process {pid}): wait for it to end or "
                                   "stop it, or use another folder")
    assert (folder / ".lock").read_text() == f"{pid}\n"  # left by the killed holder: stale, and ignored
    assert holder(folder) is None
    lock = hold(folder, "another vlmrl run")
    assert (folder / ".lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    assert (folder / ".lock").read_text() == "" and holder(folder) is None


def test_a_folder_this_process_holds_is_refused_to_a_second_holder_until_given_back(tmp_path):
    folder = tmp_path / "run"
    first = hold(folder, "another vlmrl run")
    with pytest.raises(FolderBusy) as busy:
        hold(folder, "another vlmrl run")  # a second session while the first is open
    assert str(busy.value) == (f"{folder} is in use by another vlmrl run in this process (process {os.getpid()}: "
                               "another thread, or a run not yet finished): wait for it to end, or use another folder")
    assert holder_seen_from_another_process(folder) == str(os.getpid())  # the refusal left the lock in place
    first.release()
    first.release()  # a second release of one hold gives nothing more back
    assert holder_seen_from_another_process(folder) == "None"
    again = hold(folder, "another vlmrl run")  # given back: the folder is free again
    again.release()


def test_of_two_threads_taking_one_folder_at_once_one_gets_it(tmp_path):
    folder, start = tmp_path / "run", threading.Barrier(8)

    def take(_):
        start.wait()
        try:
            return hold(folder, "another vlmrl run")
        except FolderBusy:
            return None

    with ThreadPoolExecutor(8) as pool:
        holds = [lock for lock in pool.map(take, range(8)) if lock is not None]
    assert len(holds) == 1
    holds[0].release()


def letter_config(run: Path, model: str, *more: str):
    return load_config(None, [f"model.name_or_path={model}", "model.device=cpu", f"output_dir={run}",
                              "task.name=letter_task:LetterTask", "rollout.prompts_per_step=2", "rollout.group_size=2",
                              "rollout.max_new_tokens=4", "train.steps=1", "train.trackers=[]", *more])


def test_two_trainers_in_two_threads_on_one_folder_one_trains_and_the_other_is_refused(tmp_path, tiny_model_dir,
                                                                                   letter_task, monkeypatch):
    from vlmrl.training import session

    run, start, refused_once = tmp_path / "run", threading.Barrier(2), threading.Event()

    def hold_until_the_other_tried(folder, what):  # the first holder goes on once the second was turned away
        try:
            lock = hold(folder, what)
        except FolderBusy:
            refused_once.set()
            raise
        refused_once.wait(10)  # (never set when both are let in: then both train)
        return lock

    monkeypatch.setattr(session, "hold", hold_until_the_other_tried)

    def one_run(_):
        start.wait()
        try:
            return train(letter_config(run, tiny_model_dir, "train.steps=2"))
        except FolderBusy as busy:
            return busy

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(one_run, range(2)))
    refused = [o for o in outcomes if isinstance(o, FolderBusy)]
    assert len(refused) == 1 and "in this process" in str(refused[0])
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert holder(run) is None


def test_a_session_that_fails_to_open_gives_its_folder_back(tmp_path, tiny_model_dir, letter_task):
    run = tmp_path / "run"
    with pytest.raises(VlmrlError, match="resume=true but .* holds no checkpoint"):
        train(letter_config(run, tiny_model_dir, "resume=true"))  # refused after the folder was taken
    assert holder(run) is None
    assert train(letter_config(run, tiny_model_dir)) == run  # the notebook's next call in that folder


def test_a_trainer_never_starts_in_a_run_folder_another_trains_in(tmp_path, tiny_model_dir, letter_task, held_elsewhere):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 99}\n')
    config = load_config(None, [f"model.name_or_path={tiny_model_dir}", "model.device=cpu", f"output_dir={run}",
                                "task.name=letter_task:LetterTask", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                "rollout.max_new_tokens=4", "train.steps=1", "train.trackers=[]"])
    with held_elsewhere(run) as pid:
        with pytest.raises(FolderBusy, match=f"^{re.escape(str(run))} is in use by another vlmrl run \\(process {pid}\\)"):
            train(config)
    assert (run / "metrics.jsonl").read_text() == '{"step": 99}\n'  # the other run's log, untouched
    assert not (run / "config.yaml").exists()
