"""folder_lock.py: one process at a time in a folder, a dead holder never blocks, and the trainer
refuses a run folder that another process trains in before it reads or writes anything there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.config import load_config
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


def test_this_process_may_take_its_folder_again_and_holds_it_until_the_last_release(tmp_path):
    folder = tmp_path / "run"
    first = hold(folder, "a")
    second = hold(folder, "b")  # e.g. train() called again after an error left the first session open
    first.release()
    first.release()  # a second release of one hold gives nothing more back
    assert holder_seen_from_another_process(folder) == str(os.getpid())
    second.release()
    assert holder_seen_from_another_process(folder) == "None"


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
