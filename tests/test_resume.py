"""Resume continues the run its folder holds (safety/resume.py); a checkpoint that cannot be written
is one line, before step 1 where it can be, with the previous checkpoint kept; one whose trainer
state cannot go back is passed over for the one before (safety/checkpoint.py); a torn tail of
metrics.jsonl is dropped with a warning."""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from read_only import read_only_probe
from safetensors.torch import save_file

from vlmrl.cli import main
from vlmrl.config import load_config, to_dict
from vlmrl.disk import DiskFull
from vlmrl.errors import VlmrlError
from vlmrl.report.tracking import MetricsLog, read_metrics
from vlmrl.safety.alarms import Alarms
from vlmrl.safety.checkpoint import (
    DamagedCheckpoint,
    check_checkpoint_room,
    optimizer_problem,
    read_checkpoint,
    save_checkpoint,
)
from vlmrl.safety.resume import changes

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (conftest.py)

TESTS = Path(__file__).parent
TIMING = ("seconds", "tokens_per_s", "time/")


def overrides(run: Path, model_dir: str, *extra: str) -> list[str]:
    return [f"model.name_or_path={model_dir}", "model.device=cpu", "task.name=letter_task:LetterTask",
            f"output_dir={run}", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "rollout.generation_batch_size=2", "train.micro_batch_size=4", "train.lr=1e-3", "algorithm.beta=0.05",
            "sft.batch_size=2", "train.log_rollouts_every=0", "train.trackers=[]", "train.save_every=1",
            "train.keep_checkpoints=2", *extra]


def config(run: Path, model_dir: str, *extra: str):
    return load_config(None, overrides(run, model_dir, *extra))


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


# --------------------------------------------------------------------------- resume continues the same run


def test_what_a_resume_may_change():
    saved = to_dict(load_config(None, []))
    refused, allowed = changes(saved, load_config(None, [
        "model.name_or_path=other", "model.lora.enabled=true", "task.params.max_words=3", "rollout.group_size=4",
        "algorithm.beta=0", "train.lr=1e-3", "sft.batch_size=4", "seed=1", "model.device=cpu", "train.steps=7",
        "train.micro_batch_size=4", "train.save_every=2", "eval.every=5", "resume=true", "output_dir=elsewhere"]))
    assert refused == ["model.name_or_path: 'runs/tiny-model' -> 'other'", "model.lora.enabled: False -> True",
                       "task.params.max_words: (unset) -> 3", "rollout.group_size: 8 -> 4", "algorithm.beta: 0.04 -> 0.0",
                       "train.lr: 1e-06 -> 0.001", "sft.batch_size: 32 -> 4", "seed: 0 -> 1"]
    assert allowed == ["model.device: 'auto' -> 'cpu'", "train.steps: 100 -> 7", "train.micro_batch_size: 16 -> 4",
                       "train.save_every: 0 -> 2", "eval.every: 0 -> 5"]
    # with only the top-entropy share of each micro-batch trained, the micro-batch changes the update
    entropy = to_dict(load_config(None, ["algorithm.top_entropy_share=0.2"]))
    refused, allowed = changes(entropy, load_config(None, ["algorithm.top_entropy_share=0.2", "train.micro_batch_size=4"]))
    assert (refused, allowed) == (["train.micro_batch_size: 16 -> 4"], [])
    saved.pop("eval")  # a config written before a section existed: its defaults
    assert changes(saved, load_config(None, [])) == ([], [])


def test_a_resume_that_would_continue_another_run_is_refused_in_one_line(tmp_path, tiny_model_dir, letter_task,
                                                                         capsys):
    run = tmp_path / "run"
    assert main(["train", *overrides(run, tiny_model_dir, "train.steps=1")]) == 0
    started = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", *overrides(run, tiny_model_dir, "train.steps=2", "rollout.group_size=4",
                                     "algorithm.beta=0.1", "seed=3", "resume=true")]) == 2
    assert capsys.readouterr().err == (
        "error: resume=true would continue another run: rollout.group_size: 2 -> 4; algorithm.beta: 0.05 -> 0.1; "
        "seed: 0 -> 3 (from config.yaml to this config). Resume with the saved values, start a new output_dir, or "
        "set resume_changes=allow to continue with them anyway\n")
    assert len(read_metrics(run / "metrics.jsonl")) == 1 and (run / "config.yaml").read_text() == started

    # what leaves the run what it was goes through, and is said; config.yaml stays the run's first
    assert main(["train", *overrides(run, tiny_model_dir, "train.steps=2", "eval.every=2", "eval.n=2",
                                     "resume=true")]) == 0
    assert "resume: changed since config.yaml: train.steps: 1 -> 2; eval.every: 0 -> 2; eval.n: 64 -> 2\n" in \
        capsys.readouterr().out
    assert (run / "config.yaml").read_text() == started
    assert load_config(run / "config.resumed.yaml").train.steps == 2

    # resume_changes=allow: on it goes, with a warning; the next resume compares with the latest config
    assert main(["train", *overrides(run, tiny_model_dir, "train.steps=3", "eval.every=2", "eval.n=2", "seed=3",
                                     "resume=true", "resume_changes=allow")]) == 0
    out, err = capsys.readouterr()
    assert "warning: resuming with changes of what the run is (resume_changes=allow): seed: 0 -> 3\n" in err
    assert "resume: changed since config.resumed.yaml: train.steps: 2 -> 3\n" in out
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert (run / "config.yaml").read_text() == started and load_config(run / "config.resumed.yaml").seed == 3


def test_sft_does_not_continue_a_grpo_run_nor_the_reverse(tmp_path, tiny_model_dir, letter_task):
    from vlmrl.training.sft import sft
    from vlmrl.training.trainer import train

    train(config(tmp_path / "grpo", tiny_model_dir, "train.steps=1"))
    with pytest.raises(VlmrlError, match=(
            rf"^resume=true would continue another run: {tmp_path}/grpo/checkpoints/step_000001 was saved by `vlmrl "
            r"train`, which `vlmrl sft` does not continue\. Start a new output_dir .* or set resume_changes=allow")):
        sft(config(tmp_path / "grpo", tiny_model_dir, "train.steps=2", "resume=true"))
    sft(config(tmp_path / "sft", tiny_model_dir, "train.steps=1"))
    with pytest.raises(VlmrlError, match=r"was saved by `vlmrl sft`, which `vlmrl train` does not continue"):
        train(config(tmp_path / "sft", tiny_model_dir, "train.steps=2", "resume=true"))


# --------------------------------------------------------------------------- checkpoints that cannot be written


class Weights(torch.nn.Linear):
    """A model as save_checkpoint sees it: save_pretrained writes model.safetensors and config.json."""

    def save_pretrained(self, folder: Path, state_dict: dict | None = None) -> None:
        save_file({k: v.contiguous() for k, v in (state_dict or self.state_dict()).items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text('{"model_type": "linear"}')


class Processor:
    def save_pretrained(self, folder: Path) -> None:
        (folder / "processor_config.json").write_text("{}")


def save_step(run: Path, step: int) -> Path:
    """Checkpoint `step` of a tiny model after one AdamW step."""
    torch.manual_seed(0)
    model = Weights(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return save_checkpoint(run, step, model, Processor(), optimizer, scheduler, data_position=2 * step)


def left_in(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 5952 vs 5840"),  # torch's zip writer
    RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0: file "
                 "write failed"),
])
def test_a_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, failure):
    save_step(tmp_path, 1)

    def fills_up(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch, "save", fills_up)
    with pytest.raises(DiskFull, match=(
            rf"^the disk is full: writing checkpoint step 2 to {tmp_path}/checkpoints/.tmp_step_000002 failed \(.* free "
            rf"on the filesystem of .*\)\. The partial checkpoint was removed and {tmp_path}/checkpoints/step_000001 "
            r"is intact: free some space, then rerun with resume=true$")):
        save_step(tmp_path, 2)
    monkeypatch.undo()
    assert left_in(tmp_path) == ["step_000001"]
    assert read_checkpoint(tmp_path / "checkpoints" / "step_000001")["step"] == 1


def test_a_folder_that_cannot_be_written_mid_run_is_one_line(tmp_path, monkeypatch):
    save_step(tmp_path, 1)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "checkpoints" / ".tmp_step_000002"))

    monkeypatch.setattr(torch, "save", refused)
    with pytest.raises(VlmrlError, match=(
            rf"^cannot save checkpoint step 2: Permission denied \({tmp_path}/checkpoints/.tmp_step_000002\)\. The "
            rf"partial checkpoint was removed and {tmp_path}/checkpoints/step_000001 is intact: fix that, then rerun "
            r"with resume=true$")):
        save_step(tmp_path, 2)
    assert left_in(tmp_path) == ["step_000001"]


@pytest.mark.parametrize("refusal", [OSError(errno.EINVAL, "Invalid argument"), PermissionError(errno.EACCES, "denied")])
def test_a_filesystem_that_cannot_fsync_a_folder_still_saves_but_a_file_s_fsync_stays_strict(tmp_path, monkeypatch,
                                                                                             refusal):
    """Folders cannot be opened for fsync on FUSE and network filesystems (EINVAL) nor on Windows
    (PermissionError): the checkpoint, complete and renamed into place, is saved; a file that cannot
    be fsynced still stops the save in one line."""
    real_open = os.open

    def no_folders(path, flags, *args, **kwargs):
        if "dir_fd" not in kwargs and os.path.isdir(path):  # checkpoint.py's fsync, not shutil.rmtree's walk
            raise refusal
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_folders)
    assert save_step(tmp_path, 1) == tmp_path / "checkpoints" / "step_000001"
    assert read_checkpoint(tmp_path / "checkpoints" / "step_000001")["step"] == 1

    def no_fsync(path, flags, *args, **kwargs):
        if str(path).endswith(".safetensors"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return no_folders(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_fsync)
    with pytest.raises(VlmrlError, match=r"^cannot save checkpoint step 2: Input/output error \(.*model.safetensors\)"):
        save_step(tmp_path, 2)
    assert left_in(tmp_path) == ["step_000001"]


def test_a_checkpoint_place_taken_by_a_file_or_a_link_is_one_line(tmp_path):
    save_step(tmp_path, 1)
    (tmp_path / "checkpoints" / ".tmp_step_000009").mkdir()  # left by a kill while saving: cleared at the next save
    (tmp_path / "checkpoints" / "step_000002").write_text("notes")
    with pytest.raises(VlmrlError, match=rf"^cannot save checkpoint step 2: {tmp_path}/checkpoints/step_000002 is a "
                                         r"file, not a checkpoint folder; move it away, then rerun with resume=true$"):
        save_step(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_000003").symlink_to(tmp_path / "nowhere")
    with pytest.raises(VlmrlError, match=r"step_000003 is a symbolic link to .*/nowhere, which does not exist"):
        save_step(tmp_path, 3)
    assert (tmp_path / "checkpoints" / "step_000002").read_text() == "notes"
    assert left_in(tmp_path) == ["step_000001", "step_000002", "step_000003"]


@pytest.mark.parametrize("block, message", [
    (lambda c, mp: (c.mkdir(), (c / "step_000002").write_text("")),
     "{c}: {c}/step_000002 is a file, not a checkpoint folder, where this run may save its step 2 checkpoint; move "
     "it away or choose another output_dir"),
    (lambda c, mp: (c.mkdir(), (c / "step_000001").symlink_to(c.parent / "gone")),
     "{c}: {c}/step_000001 is a symbolic link to {c.parent}/gone, which does not exist, where this run may save its "
     "step 1 checkpoint; move it away or choose another output_dir"),
    (lambda c, mp: (c.mkdir(), read_only_probe(mp, c)), "{c}: permission denied on {c}; choose another path"),
    (lambda c, mp: c.write_text(""), "{c}: {c} is a file, not a folder; choose another path"),
    (lambda c, mp: c.symlink_to(c.parent / "gone"),
     "{c}: it is a symbolic link to {c.parent}/gone, which does not exist; remove it or choose another output_dir"),
])
def test_checkpoints_that_could_not_be_written_stop_the_run_before_step_1(tmp_path, tiny_model_dir, letter_task,
                                                                          monkeypatch, block, message):
    from vlmrl.training.trainer import train

    run = tmp_path / "run"
    run.mkdir()
    block(run / "checkpoints", monkeypatch)
    with pytest.raises(VlmrlError) as refused:
        train(config(run, tiny_model_dir, "train.steps=2"))
    assert str(refused.value) == "cannot write checkpoints to " + message.format(c=run / "checkpoints")
    assert not (run / "metrics.jsonl").exists() or not read_metrics(run / "metrics.jsonl")


def test_a_checkpoint_before_the_resumed_one_may_be_anything(tmp_path):
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    (tmp_path / "checkpoints" / "step_000001").rename(tmp_path / "kept")
    (tmp_path / "checkpoints" / "step_000001").symlink_to(tmp_path / "kept")  # not written again: no matter
    check_checkpoint_room(tmp_path, after=2, last=5)
    with pytest.raises(VlmrlError, match="step_000001 is a symbolic link"):
        check_checkpoint_room(tmp_path, after=0, last=5)


# --------------------------------------------------------------------------- checkpoints that cannot go back


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_model_dir):
    """A 2-step run with a checkpoint after each, copied by each test that damages it."""
    from vlmrl.training.trainer import train

    sys.path.insert(0, str(TESTS))
    try:
        return train(config(tmp_path_factory.mktemp("two") / "run", tiny_model_dir, "train.steps=2"))
    finally:
        sys.path.remove(str(TESTS))


def damage_state(folder: Path, change) -> None:
    path = folder / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def other_shape(state: dict) -> None:
    """The first parameter's moments of another shape (fused AdamW would write out of bounds)."""
    state["optimizer"]["state"][0] = {k: (torch.zeros(3) if v.dim() else v) for k, v in state["optimizer"]["state"][0].items()}


def one_group_less(state: dict) -> None:
    """The vision group gone from the optimizer and the schedule alike: whole, but not this run's."""
    optimizer = state["optimizer"]
    last = optimizer["param_groups"].pop()
    optimizer["state"] = {k: v for k, v in optimizer["state"].items() if k not in last["params"]}
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        state["scheduler"][key] = state["scheduler"][key][:-1]


@pytest.mark.parametrize("damage, message", [
    (lambda f: damage_state(f, other_shape),
     r"trainer_state.pt holds exp_avg of shape \[3\] for \S+, whose shape is \[\d+(, \d+)*\]"),
    (lambda f: damage_state(f, one_group_less),
     r"trainer_state.pt holds 1 optimizer param group\(s\) where this run's optimizer has 2"),
    (lambda f: (f / "reference.safetensors").unlink(),
     r"reference.safetensors is missing \(this run's KL term needs the reference copy saved with it\)"),
    (lambda f: damage_state(f, lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.uint8))),
     r"trainer_state.pt holds an RNG state that cannot be restored \(RuntimeError: .*\)"),
])
def test_a_checkpoint_whose_state_cannot_go_back_is_passed_over(two_steps, tmp_path, tiny_model_dir, letter_task,
                                                                capsys, damage, message):
    from vlmrl.training.trainer import train

    run = shutil.copytree(two_steps, tmp_path / "run")
    damage(run / "checkpoints" / "step_000002")
    with (run / "metrics.jsonl").open("ab") as log:
        log.write(b'{"step": 3, "loss": 0.' + b"\0" * 40)  # what a crash leaves at the end of the log
    capsys.readouterr()
    train(config(run, tiny_model_dir, "train.steps=2", "resume=true"))
    err = capsys.readouterr().err
    assert re.search(rf"warning: checkpoint {run}/checkpoints/step_000002 is damaged: {message}; trying the "
                     r"checkpoint before it\n", err), err
    assert f"warning: resuming from {run}/checkpoints/step_000001, the newest whole checkpoint\n" in err
    assert f"warning: {run}/metrics.jsonl: dropped line 3, not a whole JSON row" in err
    assert without_timing(read_metrics(run / "metrics.jsonl")) == without_timing(read_metrics(two_steps / "metrics.jsonl"))


@pytest.fixture
def state_copy(two_steps, tmp_path) -> Path:
    return shutil.copytree(two_steps / "checkpoints" / "step_000002", tmp_path / "checkpoints" / "step_000002")


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(step=5), "holds step 5, not its folder's 2"),
    (lambda s: s.update(data_position=-1), "holds data_position=-1, not a count"),
    (lambda s: s.update(extra=[1]), r"holds extra state that is not a mapping \(list\)"),
    (lambda s: s["extra"]["faults"].update(skipped="many"), "holds fault counts that are not counts"),
    (lambda s: s["optimizer"].update(param_groups=[]), "holds an optimizer with no param groups"),
    (lambda s: s["optimizer"]["param_groups"].pop(), r"holds optimizer state for parameter \d+, which no param group lists"),
    (lambda s: s["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
     r"holds optimizer moments of different shapes for parameter 0: \[\(3,\), \(\d+, \d+\)\]"),
    (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"),
     "holds an optimizer param group without its parameters or learning rate"),
    (lambda s: s["scheduler"].update(last_epoch=None), "holds no scheduler state with its step count"),
    (lambda s: s["scheduler"].update(base_lrs=[]), r"holds scheduler base_lrs=\[\], not 2 learning rates"),
    (lambda s: s["rng"].update(python=(3, (1, 2), None)), r"holds an RNG state that cannot be restored \(ValueError"),
    (lambda s: s["rng"]["numpy"]["state"].update(key=[1, 2]), r"holds an RNG state that cannot be restored"),
    (lambda s: s["rng"].update(cuda=[torch.zeros(2)]), "holds CUDA RNG states that are not byte tensors"),
])
def test_a_trainer_state_that_cannot_go_back_is_damaged(state_copy, change, message):
    random_state = torch.get_rng_state()
    assert read_checkpoint(state_copy, needs_reference=True)["step"] == 2
    damage_state(state_copy, change)
    with pytest.raises(DamagedCheckpoint, match=f"^checkpoint {state_copy} is damaged: trainer_state.pt {message}"):
        read_checkpoint(state_copy)
    assert torch.equal(torch.get_rng_state(), random_state)  # trying the saved RNG states leaves the run's as they were


def test_an_optimizer_state_is_checked_against_the_run_s_parameters():
    layout = [[("a", (2, 3)), ("b", (3,))], [("v", (4,))]]
    moments = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}
    by_position = {"state": {0: moments}, "param_groups": [{"params": [0, 1], "lr": 1.0}, {"params": [2], "lr": 1.0}]}
    assert optimizer_problem(by_position, layout) is None
    by_name = {"state": {"a": moments}, "param_groups": [{"params": ["a", "b"], "lr": 1.0}, {"params": ["v"], "lr": 1.0}]}
    assert optimizer_problem(by_name, layout) is None
    assert optimizer_problem(by_position, [[("a", (3, 2)), ("b", (3,))], [("v", (4,))]]) == \
        "holds exp_avg of shape [2, 3] for a, whose shape is [3, 2]"
    assert optimizer_problem(by_name, [[("x", (2, 3)), ("b", (3,))], [("v", (4,))]]) == \
        "holds optimizer state for a where this run's optimizer has x"
    assert optimizer_problem(by_position, [[("a", (2, 3))], [("v", (4,))]]) == \
        "holds 2 parameters in optimizer param group 0 where this run trains 1"


# --------------------------------------------------------------------------- a torn metrics.jsonl


@pytest.mark.parametrize("tail", [
    b'{"step": 3, "loss": 0.4',  # cut short
    b"\0" * 64,  # the NUL bytes a crash can leave where the last write was to go
    b'{"step": 3, "loss"' + b"\0" * 32,
    b'{"step": 2, "note": "\xff\xfe"}',  # not UTF-8 (vlmrl writes ASCII): garbage, whatever it says
])
def test_a_torn_tail_of_the_logs_is_dropped_on_resume(tmp_path, capsys, tail):
    for name, make in (("metrics.jsonl", lambda p: MetricsLog(p, resume_step=2)),
                       ("alarms.jsonl", lambda p: Alarms(p, resume_step=2))):
        path = tmp_path / name
        path.write_bytes(b'{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n' + tail)
        make(path)
        assert read_metrics(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
        assert f"warning: {path}: dropped line 3, not a whole JSON row" in capsys.readouterr().err
        os.remove(path)
