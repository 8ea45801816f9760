"""A full disk (disk.py): the preflight estimates what a run writes; running out of space while
writing a checkpoint, metrics, rollouts or the report is one clear error; the partial checkpoint
goes, the previous one stays, and resume=true continues once space is freed (ENOSPC injected)."""

from __future__ import annotations

import errno
import shutil

import pytest
from safetensors.torch import load_file

from vlmrl import disk
from vlmrl.config import load_config
from vlmrl.disk import DiskFull, is_disk_full, writing
from vlmrl.report.tracking import MetricsLog, read_metrics
from vlmrl.safety import checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)

LETTER_TASK = "letter_task:LetterTask"


def full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_recognised_however_it_is_raised():
    assert is_disk_full(full())
    assert is_disk_full(RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                     'message: "No space left on device" })'))  # safetensors
    try:
        try:
            raise full()
        except OSError as error:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from error
    except RuntimeError as chained:
        assert is_disk_full(chained)  # torch.save, raised from the OSError
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("bad value"))


def test_writing_names_what_and_where(tmp_path):
    target = tmp_path / "run" / "metrics.jsonl"
    with pytest.raises(DiskFull, match=rf"^the disk is full: writing metrics to {target} failed \(.* free on the "
                                       rf"filesystem of {tmp_path}\)$"):
        with writing("metrics", target):
            raise full()
    with pytest.raises(PermissionError):  # anything else passes through untouched
        with writing("metrics", target):
            raise PermissionError("no")


def test_metrics_on_a_full_disk(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.log({"step": 1, "loss": 0.5})

    def no_space(*args, **kwargs):
        raise full()

    monkeypatch.setattr(type(log.path), "open", no_space)
    with pytest.raises(DiskFull, match="writing metrics to .*metrics.jsonl"):
        log.log({"step": 2})
    monkeypatch.undo()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]


def config(tmp_path, model_dir, *overrides):
    return load_config(None, [f"model.name_or_path={model_dir}", "model.device=cpu", f"task.name={LETTER_TASK}",
                              f"output_dir={tmp_path / 'run'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
                              "rollout.max_new_tokens=4", "rollout.generation_batch_size=2", "train.steps=3",
                              "train.save_every=1", "train.keep_checkpoints=2", "train.trackers=[]",
                              "algorithm.beta=0.05", *overrides])


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint_and_resumes(tmp_path, tiny_model_dir,
                                                                                letter_task, monkeypatch):
    from vlmrl.training.trainer import train

    real_save = checkpoint.save_model
    saves = []

    def fills_up(folder, model, processor):  # the second checkpoint runs out of space half-way
        saves.append(folder)
        real_save(folder, model, processor)
        if len(saves) == 2:
            raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(checkpoint, "save_model", fills_up)
    run = tmp_path / "run"
    with pytest.raises(DiskFull, match=(
            rf"^the disk is full: writing checkpoint step 2 to {run}/checkpoints/.tmp_step_000002 failed .*\. The "
            rf"partial checkpoint was removed and {run}/checkpoints/step_000001 is intact: free some space, then "
            r"rerun with resume=true$")):
        train(config(tmp_path, tiny_model_dir))
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert checkpoint.read_checkpoint(run / "checkpoints" / "step_000001")["step"] == 1
    monkeypatch.undo()
    train(config(tmp_path, tiny_model_dir, "resume=true"))  # space freed: continues from step 1
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert (run / "final").is_dir() and checkpoint.latest_checkpoint(run).name == "step_000003"


def test_the_preflight_says_what_the_run_writes(tmp_path, tiny_model_dir, letter_task, monkeypatch, capsys):
    from vlmrl.safety.preflight import check

    report = check(config(tmp_path, tiny_model_dir, "train.steps=10", "train.save_every=2"))
    weights = sum(p.numel() * 4 for p in load_file(f"{tiny_model_dir}/model.safetensors").values())
    estimate = report.disk
    # 5 saves, 2 kept + the one being written; each: weights + AdamW's 2 moments + the reference copy
    assert (estimate.checkpoints, estimate.checkpoint, estimate.final) == (3, 4 * weights, weights)
    assert estimate.fits and "disk       about" in "\n".join(report.lines())
    lora = check(config(tmp_path, tiny_model_dir, "train.steps=10", "train.save_every=2", "model.lora.enabled=true",
                        "algorithm.ref_refresh_steps=5")).disk  # a refreshed reference: a full copy is kept
    assert lora.checkpoint - 3 * lora.final == weights + lora.final  # adapter, its 2 moments; base + adapter
    sft = check(config(tmp_path, tiny_model_dir, "train.steps=10", "train.log_rollouts_every=1"), mode="sft").disk
    assert sft.logs == 10 * 2_000  # metrics only: SFT writes no rollouts
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10, 10, 1024))
    from vlmrl.cli import main

    config_file = tmp_path / "c.yaml"
    config_file.write_text(f"model: {{name_or_path: {tiny_model_dir}, device: cpu}}\ntask: {{name: '{LETTER_TASK}'}}\n"
                           f"output_dir: {tmp_path / 'run2'}\ntrain: {{steps: 10, save_every: 2}}\n")
    capsys.readouterr()
    assert main(["check", str(config_file)]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "ok, but this run may fill its disk" in out
