"""A full disk (disk.py): the preflight estimates what a run writes; running out of space while
writing a checkpoint, metrics, rollouts or the report is one clear error; the partial checkpoint
goes, the previous one stays, and resume=true continues once space is freed (ENOSPC injected)."""

from __future__ import annotations

import errno
import re
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

    def fills_up(folder, model, processor, weights=None):  # the second checkpoint runs out of space half-way
        saves.append(folder)
        real_save(folder, model, processor, weights)
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


FILLS_AT_STEP_2 = """
import errno, os
if os.environ.get("RANK") is not None:  # the processes the launcher starts, not the launcher
    from vlmrl.safety import checkpoint
    real_save = checkpoint.save_model

    def fills_up(folder, model, processor, weights=None):
        if folder.name == ".tmp_step_000002":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(folder, model, processor, weights)

    checkpoint.save_model = fills_up
"""
"""A sitecustomize module: the disk fills up while the main process writes the step 2 checkpoint."""


@pytest.mark.slow  # a two-process launch: 20-50 s
def test_a_full_disk_under_two_processes_is_the_main_process_one_line_and_no_traceback(tmp_path, tiny_model_dir):
    """The main process met the full disk; the other one went on to its next collective and died there
    in a traceback of gloo's, which was what the launch showed."""
    import os

    from launching import TESTS, launcher, run_all_or_kill, two_process_overrides

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FILLS_AT_STEP_2)
    run = tmp_path / "run"
    command = launcher("--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                       "--dynamo_backend", "no") + two_process_overrides(
        tiny_model_dir, run, "train.steps=3", "train.save_every=1", "train.trackers=[]", "train.log_rollouts_every=0")
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), str(TESTS), os.environ.get("PYTHONPATH")]))
    returncode, _, err = run_all_or_kill(command, timeout=300, env={"PYTHONPATH": path})
    assert returncode != 0
    errors = [line[line.index("error:"):] for line in err.splitlines() if "error:" in line]  # (after a progress bar)
    assert errors[0].startswith(f"error: the disk is full: writing checkpoint step 2 to {run}/checkpoints/"
                                ".tmp_step_000002 failed"), err[-3000:]  # the main process's line, first
    assert "gloo" not in err and "Connection closed by peer" not in err, err[-3000:]  # no other process's traceback
    assert re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n.*\n.*\n\s*rank\s*: 0 \(local_rank: 0\)\n"
                     r"\s*exitcode\s*: 2 ", err), err[-3000:]  # the launcher names the main process's failure
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]


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


# --------------------------------------------------------------------------- what commands write for a person


def cli_error(args: list[str], capsys) -> str:
    """Run `vlmrl ARGS` in-process: it must exit 2 with one `error:` line and no traceback; that line."""
    from vlmrl.cli import main

    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def no_leftovers(folder) -> list[str]:
    """Temporary files a write left behind under `folder` (none, when writes clean up)."""
    return [p.name for p in folder.rglob(".*.tmp")] if folder.exists() else []


@pytest.mark.parametrize("where, reason", [
    ("a_file", "{a_file} is a file, not a folder"),
    ("a_file/sub", "{a_file} is a file, not a folder"),
    ("/proc/vlmrl-out", "/proc is the kernel's virtual filesystem, not a place for files"),
])
def test_an_output_folder_that_cannot_be_is_one_line(tmp_path, where, reason):
    (tmp_path / "a_file").write_text("x")
    path = tmp_path / where
    with pytest.raises(disk.VlmrlError) as error:
        disk.output_folder(path, "the things")
    assert str(error.value) == (f"cannot write the things to {path}: {reason.format(a_file=tmp_path / 'a_file')}; "
                                "choose another path")


def test_an_unwritable_folder_is_one_line(tmp_path, monkeypatch):
    def refused(self, data):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(type(tmp_path), "write_bytes", refused)  # as root, chmod refuses nothing
    with pytest.raises(disk.VlmrlError) as error:
        disk.output_folder(tmp_path / "out", "the things")
    assert str(error.value) == (f"cannot write the things to {tmp_path / 'out'}: permission denied on "
                                f"{tmp_path / 'out'}; choose another path")


def half_then_full(path, *args, **kwargs):
    """A write that puts half a file down, then finds the disk full."""
    with open(path, "wb") as f:
        f.write(b"half a file")
    raise full()


def test_write_file_is_whole_or_absent_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "report.html"
    disk.write_text(target, "the report", "old, whole")
    with pytest.raises(DiskFull, match=rf"^the disk is full: writing the report to {target} failed \(.* free on the "
                                       rf"filesystem of {tmp_path}\)$"):
        disk.write_file(target, "the report", half_then_full)
    assert target.read_text() == "old, whole" and no_leftovers(tmp_path) == []
    (tmp_path / "folder.html").mkdir()
    with pytest.raises(disk.VlmrlError, match="folder.html is a folder, not a file; choose another path$"):
        disk.write_text(tmp_path / "folder.html", "the report", "x")


def test_report_out_of_every_wrong_kind_is_one_line(tmp_path, monkeypatch, capsys):
    from test_report import make_run_dir

    run = make_run_dir(tmp_path / "r")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    for out, reason in [(tmp_path / "a_folder", f"{tmp_path / 'a_folder'} is a folder, not a file"),
                        (tmp_path / "a_file" / "r.html", f"{tmp_path / 'a_file'} is a file, not a folder"),
                        ("/proc/r.html", "/proc is the kernel's virtual filesystem, not a place for files")]:
        assert cli_error(["report", str(run), "--out", str(out)], capsys) == (
            f"error: cannot write the report to {out}: {reason}; choose another path")
    monkeypatch.setattr(type(tmp_path), "write_text", half_then_full)
    assert cli_error(["report", str(run)], capsys).startswith(
        f"error: the disk is full: writing the report to {run / 'report.html'} failed")
    assert not (run / "report.html").exists() and no_leftovers(run) == []


def test_data_geometry_out_and_bounds_are_one_line_and_a_full_disk_leaves_no_data(tmp_path, monkeypatch, capsys):
    from PIL import Image

    (tmp_path / "a_file").write_text("x")
    assert cli_error(["data", "geometry", str(tmp_path / "a_file"), "--n", "2"], capsys) == (
        f"error: cannot write the geometry data to {tmp_path / 'a_file'}: {tmp_path / 'a_file'} is a file, not a "
        "folder; choose another path")
    assert cli_error(["data", "geometry", "/proc/geo", "--n", "2"], capsys).startswith(
        "error: cannot write the geometry data to /proc/geo: /proc is the kernel's virtual filesystem")
    assert cli_error(["data", "geometry", str(tmp_path / "g"), "image_size=100000"], capsys) == (
        "error: image_size must be in 64..4096, got 100000")
    assert cli_error(["data", "geometry", str(tmp_path / "g"), "--n", "1000001"], capsys) == (
        "error: --n must be in [1, 1,000,000] and --test in [0, 1,000,000]; got 1000001 and 100")
    assert not (tmp_path / "g").exists()  # refused before anything was written
    out = tmp_path / "data"
    from vlmrl.cli import main

    assert main(["data", "geometry", str(out), "--n", "3", "--test", "1"]) == 0  # an earlier, whole export
    saves = []
    real_save = Image.Image.save

    def fills_up(self, fp, *args, **kwargs):
        saves.append(fp)
        if len(saves) == 3:  # the third diagram finds the disk full half-way
            return half_then_full(fp)
        return real_save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", fills_up)
    assert cli_error(["data", "geometry", str(out), "--n", "3", "--test", "1", "image_size=96"], capsys).startswith(
        f"error: the disk is full: writing an image to {out / 'images' / 'train_000002.png'} failed")
    assert sorted(p.name for p in out.iterdir()) == ["images"]  # no JSONL: nothing reads the folder as data
    assert no_leftovers(out) == []


@pytest.mark.parametrize("command, what, kind", [
    (["tasks", "show", "shapes", "--n", "1", "--out", "{out}"], "the example images", "folder"),
    (["config", "--save", "{out}"], "the config", "file"),
    (["tiny-model", "{out}"], "the model", "folder"),
])
def test_the_other_outputs_of_the_wrong_kind_or_under_proc_are_one_line(tmp_path, capsys, command, what, kind):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    wrong = tmp_path / ("a_file" if kind == "folder" else "a_folder")
    reason = f"{wrong} is a file, not a folder" if kind == "folder" else f"{wrong} is a folder, not a file"
    for out, why in [(wrong, reason), ("/proc/vlmrl-out", "/proc is the kernel's virtual filesystem, not a place for "
                                                          "files")]:
        assert cli_error([part.format(out=out) for part in command], capsys) == (
            f"error: cannot write {what} to {out}: {why}; choose another path")
